"""The checkpointer: one object owning what persists between saves and loads.

A :class:`Checkpointer` holds the store (the storage backend), default save and load options,
and per process group: the last save plan (reused while the state's structure does not
change), the pending async save with its reusable host staging pool, and the gloo side group
async saves commit on. ``sp.save`` / ``sp.load`` are thin wrappers over a default one, so a
script that never makes one behaves as before; a program that saves two unrelated states (a
model and an EMA copy, two stores) makes one checkpointer per state, and their caches and
async queues do not interfere.

    ckpt = sp.Checkpointer()
    res = ckpt.save(state, "/ckpt/step_10")          # SaveResult (timings, bytes, files)
    out = ckpt.load("/ckpt/step_10", like=state)     # LoadResult: out.tree, out.timings
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, Literal, Optional, overload

from shardpoint.api.async_save import AsyncSave, GroupSaves
from shardpoint.api.loading import LoadResult, run_load
from shardpoint.api.saving import SaveOptions, SaveResult, run_save
from shardpoint.exchange.comm import Comm, group_key, new_side_comm
from shardpoint.planning.load_planner import LoadOptions
from shardpoint_core.format.manifest import Manifest
from shardpoint_core.transactions.resolve import read_metadata
from shardpoint_core.transactions.protocol import StorageBackend
from shardpoint_core.transactions.resolve import get_backend


class GroupState:
    """What a checkpointer keeps for one process group between calls."""

    def __init__(self) -> None:
        self.plan: Optional[tuple] = None  # (this rank's structure digest, coordinator's plan)
        self.saves = GroupSaves()  # the pending async save and its host pool
        self.side: Optional[Comm] = None  # gloo group for async saves' background part

    def side_comm(self, comm: Comm) -> Comm:
        """The side group over ``comm``'s ranks, made collectively on first use, and again
        when the one kept was destroyed with the default group (``destroy_process_group`` then
        ``init_process_group`` in one process: every rank sees that at the same call)."""
        if self.side is not None and not _registered(self.side.group):
            self.side = None
        if self.side is None:
            self.side = new_side_comm(comm)
        return self.side


def _registered(group: Any) -> bool:
    """Whether ``group`` (None: this rank alone) is still a live process group."""
    if group is None:
        return True
    import torch.distributed as dist

    try:
        dist.get_process_group_ranks(group)
    except (ValueError, RuntimeError, KeyError):  # "Group ... is not registered"
        return False
    return True


class Checkpointer:
    """Saves and loads checkpoints on one store with default options; see the module
    docstring. Collective calls (``save``, ``load``) take the process ``group`` per call
    (the whole world by default) and keep their caches per group."""

    def __init__(
        self,
        *,
        backend: Optional[StorageBackend] = None,
        save_options: Optional[SaveOptions] = None,
        load_options: Optional[LoadOptions] = None,
    ) -> None:
        self._backend = backend
        self.save_options = save_options or SaveOptions()
        self.load_options = load_options or LoadOptions()
        self._groups: dict = {}

    @property
    def backend(self) -> StorageBackend:
        """The store this checkpointer reads and writes (the default file store unless one
        was given)."""
        return get_backend(self._backend)

    def _group(self, comm: Comm) -> GroupState:
        key = group_key(comm)
        if key not in self._groups:
            self._groups[key] = GroupState()
        return self._groups[key]

    def save(
        self,
        state: Any,
        path: str,
        *,
        group: Any = None,
        overwrite: "bool | str" = False,
        options: Optional[SaveOptions] = None,
        async_save: bool = False,
        backend: Optional[StorageBackend] = None,
        compression: Optional[str] = None,
        incremental: "bool | str | None" = None,
    ) -> "SaveResult | AsyncSave":
        """Save ``state`` at ``path`` (see :func:`shardpoint.save`): a :class:`SaveResult`,
        or with ``async_save=True`` an :class:`AsyncSave` whose ``wait()`` gives it.
        ``backend`` overrides this checkpointer's store for this call; ``compression``
        this call's ``SaveOptions.compression``."""
        comm = Comm(group)
        opts = options or self.save_options
        if compression is not None and compression != opts.compression:
            opts = replace(opts, compression=compression)  # checked by SaveOptions
        return run_save(
            state,
            path,
            comm,
            incremental_backend(backend or self._backend, incremental),
            opts,
            overwrite,
            self._group(comm),
            async_save,
        )

    def load(
        self,
        path: str,
        like: Any = None,
        *,
        group: Any = None,
        strict: bool = True,
        options: Optional[LoadOptions] = None,
        exchange_budget_bytes: Optional[int] = None,
        backend: Optional[StorageBackend] = None,
    ) -> LoadResult:
        """Load the checkpoint at ``path`` (see :func:`shardpoint.load`) and return a
        :class:`LoadResult`: the loaded ``tree``, missing and unexpected keys, bytes read and
        exchanged, the read strategy and ``timings``."""
        comm = Comm(group)
        return run_load(
            path,
            like,
            comm,
            backend or self._backend,
            strict,
            options or self.load_options,
            exchange_budget_bytes,
        )

    def read_metadata(self, path: str) -> Manifest:
        """The checkpoint's manifest (see :func:`shardpoint.read_metadata`)."""
        return read_metadata(path, backend=self._backend)

    def open(self, path: str) -> Any:
        """A lazy read-only handle on one checkpoint (see :func:`shardpoint.open`)."""
        from shardpoint.api.lazy import Checkpoint

        return Checkpoint(path, self._backend)

    def wait(self) -> None:
        """Wait for every pending async save this checkpointer started; raises the first
        error not yet handed to the caller (local: no collective)."""
        first: Optional[BaseException] = None
        for g in self._groups.values():
            prev = g.saves.pending
            if prev is None or prev.reported:
                continue
            try:
                prev.wait()
            except BaseException as e:  # noqa: BLE001 - raised below, once
                first = first or e
        if first is not None:
            raise first

    def close(self) -> None:
        """Wait for pending async saves, then drop the caches and host pools."""
        try:
            self.wait()
        finally:
            self._groups.clear()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        pending = sum(
            1
            for g in self._groups.values()
            if g.saves.pending is not None and not g.saves.pending.done()
        )
        return (
            f"Checkpointer(backend={type(self.backend).__name__}, groups="
            f"{len(self._groups)}, pending_async_saves={pending})"
        )


_DEFAULT: Optional[Checkpointer] = None


def default_checkpointer() -> Checkpointer:
    """The process's default checkpointer, which ``sp.save`` and ``sp.load`` use."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Checkpointer()
    return _DEFAULT


def incremental_backend(be: Optional[StorageBackend], incremental: Any) -> Any:
    """The backend of a save with ``incremental`` (None or False: ``be`` unchanged): the
    core's, shared with shardpoint_jax
    (:func:`shardpoint_core.transactions.packed.incremental_backend`)."""
    from shardpoint_core.transactions.packed import incremental_backend as core_incremental

    return core_incremental(be, incremental)


# ------------------------------------------------------------------ the public functions
@overload
def save(
    state: Any,
    path: str,
    *,
    group: Any = None,
    overwrite: "bool | str" = False,
    backend: Optional[StorageBackend] = None,
    options: Optional[SaveOptions] = None,
    incremental: "bool | str | None" = None,
    async_save: Literal[False] = False,
    compression: Optional[str] = None,
) -> SaveResult: ...


@overload
def save(
    state: Any,
    path: str,
    *,
    group: Any = None,
    overwrite: "bool | str" = False,
    backend: Optional[StorageBackend] = None,
    options: Optional[SaveOptions] = None,
    incremental: "bool | str | None" = None,
    async_save: Literal[True],
    compression: Optional[str] = None,
) -> AsyncSave: ...


@overload
def save(
    state: Any,
    path: str,
    *,
    group: Any = None,
    overwrite: "bool | str" = False,
    backend: Optional[StorageBackend] = None,
    options: Optional[SaveOptions] = None,
    incremental: "bool | str | None" = None,
    async_save: bool = False,
    compression: Optional[str] = None,
) -> "SaveResult | AsyncSave": ...


def save(
    state: Any,
    path: str,
    *,
    group: Any = None,
    overwrite: "bool | str" = False,
    backend: Optional[StorageBackend] = None,
    options: Optional[SaveOptions] = None,
    incremental: "bool | str | None" = None,
    async_save: bool = False,
    compression: Optional[str] = None,
) -> "SaveResult | AsyncSave":
    """Save ``state`` (a nested dict/list/tuple) as a checkpoint at ``path``. Collective.

    Leaves: torch tensors and numpy arrays (replicas across ranks), :class:`ShardedTensor`,
    DTensor, :class:`ShardedObject` and plain values (None, bool, int, float, str, bytes).
    The checkpoint becomes visible only once every rank has written its part; on any failure
    every rank raises and nothing is committed (a previous checkpoint at ``path`` survives).

    ``async_save=True`` returns an :class:`AsyncSave` as soon as the state is copied into a
    reusable host pool (the caller may then change its tensors); writes and the commit run
    in the background on a gloo group of their own, at a low CPU priority so that they take
    few cycles from training (``SaveOptions.async_priority``). Any save on the same group
    first waits for the previous async one and re-raises its error on every rank if ``wait``
    did not hand it over on some rank.

    ``overwrite=True`` replaces a committed checkpoint (or an empty directory) at ``path``;
    ``overwrite="any"`` also a directory that is not a checkpoint, deleting what it holds.
    Never replaced: a file, a directory of checkpoints (a CheckpointManager's root).

    ``compression="zstd"`` (format 1.5) stores every chunk as one zstd frame (Zarr v3's
    ``zstd`` codec: zarr-python and TensorStore read it); the same as
    ``SaveOptions(compression="zstd")``, whose ``compression_level`` sets the level.

    ``incremental`` (packed layout, spec/format.md section 13): build on a committed
    packed checkpoint beside ``path`` (its name or path; ``True``: the newest one beside
    it on files): chunks whose bytes it holds (same length, crc32c and 128-bit BLAKE3 hash) are not
    written again, the new checkpoint refers to them. Every chunk's hash is recorded, so
    the next save can build on this one. A checkpoint that others build on is never
    deleted or replaced (``CheckpointReferencedError``); a manager's retention keeps it
    until nothing kept refers to it.

    A thin wrapper over the default :class:`~shardpoint.Checkpointer` (which keeps the plan
    cache, the pending async save and its host pool per process group).
    """
    return default_checkpointer().save(
        state,
        path,
        group=group,
        overwrite=overwrite,
        options=options,
        async_save=async_save,
        backend=backend,
        compression=compression,
        incremental=incremental,
    )


def load(
    path: str,
    like: Any = None,
    *,
    group: Any = None,
    strict: bool = True,
    backend: Optional[StorageBackend] = None,
    report: Optional[LoadResult] = None,
    exchange_budget_bytes: Optional[int] = None,
    options: Optional[LoadOptions] = None,
) -> Any:
    """Load a checkpoint and return its tree. Collective over ``group``.

    Without ``like``: the whole tree, tensors in full on CPU (numpy arrays come back as numpy;
    a sharded object comes back as the list of its values, nested lists along its grid when
    the grid has 2+ dimensions). With ``like``: the tensors of
    ``like`` (plain, :class:`ShardedTensor`, DTensor, numpy) are filled in place from whatever
    layout the checkpoint was saved in, and the returned tree has the loaded values in
    place of plain values; a ``ShardedTensor`` leaf becomes its filled ``data`` and a
    ``ShardedObject`` leaf becomes its stored value. Keys of the checkpoint that ``like`` does
    not ask for are not read. ``options`` (:class:`LoadOptions`) picks how regions are read:
    once and exchanged, or by every rank directly, by a cost model by default.

    ``report``: a :class:`LoadResult` to fill with what the load did (missing and unexpected
    keys, bytes, strategy, timings). :meth:`shardpoint.Checkpointer.load` returns that
    result instead of the tree. This is a thin wrapper over the default checkpointer.
    """
    res = default_checkpointer().load(
        path,
        like,
        group=group,
        strict=strict,
        options=options,
        exchange_budget_bytes=exchange_budget_bytes,
        backend=backend,
    )
    if report is not None:
        for f in fields(LoadResult):
            setattr(report, f.name, getattr(res, f.name))
    return res.tree
