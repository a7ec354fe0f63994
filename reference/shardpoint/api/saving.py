"""``save``: a collective save of a state tree, from local plans to the committed manifest.

Every rank calls it with its own tree; planning runs on the coordinator (rank 0 of the group)
and each phase ends in an agreement step, so a failure on any rank raises the same error on
every rank instead of leaving one waiting.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import msgpack
import torch

from shardpoint.tree import dtypes
from shardpoint_core.format import errors
from shardpoint_core.commit.base import Overwrite, check_overwrite
from shardpoint.tree import values
from shardpoint.api.async_save import AsyncSave, check_priority
from shardpoint.api.heap import release_free_heap
from shardpoint.api.replicas import check_replicas
from shardpoint.exchange.comm import (
    AFTER_SAVE,
    Comm,
    after_commit,
    agree,
    exchange,
    run_collectively,
)
from shardpoint_core.stores.fsutil import os_error_text
from shardpoint_core.format.manifest import (
    FORMAT_VERSION,
    FORMAT_VERSION_1_3,
    Manifest,
    TensorEntry,
    array_path_for,
)
from shardpoint_core.arrays.identity import join_tables
from shardpoint.tree.flatten import flatten_state
from shardpoint.api.open_ahead import OpenAhead
from shardpoint.planning.save_global import encode_save_global, layouts_of, save_work_from_global
from shardpoint.planning.planner import (
    LocalPlan,
    PlanOptions,
    RankSaveWork,
    plan_objects,
    plan_save,
)
from shardpoint_core.format.treemerge import check_values_agree
from shardpoint_core.format.spec import ArraySpec
from shardpoint_core.format.compression import FORMAT_VERSION_1_5, check_compression
from shardpoint_core.arrays.compression import require_zstd
from shardpoint_core.transactions.protocol import StorageBackend
from shardpoint_core.transactions.resolve import resolve
from shardpoint_core.transactions.writer import CheckpointWriter
from shardpoint.api.staging import StagingPool, copy_pairs, stream_device_writes
from shardpoint.tree.views import PieceViews, box_view, copy_into, to_numpy

log = logging.getLogger("shardpoint")


@dataclass
class SaveOptions:
    """Writer knobs for ``save`` (none of them changes what a reader must understand)."""

    plan: PlanOptions = field(default_factory=PlanOptions)
    exchange_budget_bytes: int = 256 << 20
    cache_plan: bool = True  # reuse the last plan when no rank's structure changed
    device_staging_bytes: int = 256 << 20  # pinned bytes in flight for CUDA tensors (sync)
    # crc32c every holding and refuse replicas whose data differ ([SP-REPL-1]); one pass over
    # the state and one gather per save (see shardpoint.api.replicas and its benchmark)
    check_replicas: bool = False
    # CPU priority of an async save's background part: "low" (nice 19), "idle", "normal"
    async_priority: str = "low"
    # (format 1.5) "zstd": every chunk one zstd frame (Zarr v3's zstd codec, which
    # zarr-python and TensorStore read); None: uncompressed. compression_level: zstd's level
    # (-7 to 22, default 3). Needs the zstandard package (the zstd extra) to write and read.
    compression: Optional[str] = None
    compression_level: Optional[int] = None

    def __post_init__(self) -> None:
        check_priority(self.async_priority)
        try:
            check_compression(self.compression, self.compression_level)
        except ValueError as e:
            raise errors.InvalidOptionError(f"SaveOptions: {e}") from None


@dataclass
class SaveResult:
    """What a save did, for logs and benchmarks (same on every rank except ``rank_*``).
    ``chunks`` counts stored chunks (a shard is one); the checkpoint holds ``files`` files
    (or objects) in all: in the packed layout its data objects and the manifest; in the
    per-array one a file per chunk, a ``zarr.json`` per tensor and per Zarr group
    ([SP-LAYOUT-5]) and the manifest. ``rank_chunk_files`` of the chunks are this rank's."""

    path: str
    world_size: int
    tensors: int
    unique_bytes: int
    exchange_bytes: int
    chunks: int
    rank_bytes_written: int
    timings: dict
    files: int = 0
    rank_chunk_files: int = 0


def _strip_values(tree: Any) -> Any:
    if "dict" in tree:
        return {"dict": [[k, _strip_values(v)] for k, v in tree["dict"]]}
    for kind in ("list", "tuple"):
        if kind in tree:
            return {kind: [_strip_values(v) for v in tree[kind]]}
    return {"value": None} if "value" in tree else tree


def _structure_digest(flat) -> bytes:
    """What the plan depends on: tree shape, holdings, object ids (not plain values)."""
    import hashlib

    body = msgpack.packb(
        [
            _strip_values(flat.tree),
            [t.holding.to_wire() for t in flat.tensors],
            [[o.key, o.index, o.count, list(o.replica)] for o in flat.objects],
        ]
    )
    return hashlib.sha256(body).digest()


def _value_leaves(tree: Any) -> list:
    from shardpoint.tree.model import iter_tree_leaves

    return [[list(p), n["value"]] for p, n in iter_tree_leaves(tree) if "value" in n]


def _with_values(tree: Any, per_rank: list) -> Any:
    """``tree`` with each plain value replaced by the lowest rank's new value at its path."""
    new: dict = {}
    seen: dict = {}
    for leaves in per_rank:
        for p, v in leaves:
            new.setdefault(tuple(p), v)
            seen.setdefault(tuple(p), []).append(v)
    for p, vs in seen.items():
        if len(vs) > 1:
            check_values_agree(vs, "state" + "".join(f"[{k!r}]" for k in p))

    return _replace_values(tree, (), new)


def _replace_values(node: Any, path: tuple, new: dict) -> Any:
    """``node`` with its value leaves taken from ``new`` by path (module level: a recursive
    closure is a reference cycle)."""
    if "dict" in node:
        return {"dict": [[k, _replace_values(v, path + (k,), new)] for k, v in node["dict"]]}
    for kind in ("list", "tuple"):
        if kind in node:
            return {kind: [_replace_values(v, path + (i,), new) for i, v in enumerate(node[kind])]}
    return {"value": new[path]} if "value" in node else node


# -------------------------------------------------------------------------------- one save
class SaveJob:
    """One save's state (its flat tree, plan, staging path, buffers, timings), one method per
    phase: :meth:`plan` -> :meth:`stage` -> :meth:`write` -> :meth:`commit`. This rank's
    part of the transaction is a :class:`~shardpoint_core.transactions.writer.CheckpointWriter`
    (``writer``): the coordinator begins it while planning, the other ranks join it with the
    staging path the plan brings them.

    Each phase ends in an agreement step or records its failure for the next one, so a
    failure on any rank raises the same error on every rank. An async save runs ``write`` and
    ``commit`` in a background thread, on a gloo group of their own (``comm`` argument).
    """

    def __init__(
        self,
        state: Any,
        path: str,
        comm: Comm,
        be: StorageBackend,
        opts: SaveOptions,
        overwrite: Overwrite,
        group: Any,
    ) -> None:
        self.state, self.path, self.comm, self.be = state, str(path), comm, be
        self.opts, self.overwrite = opts, overwrite
        self.codec = check_compression(opts.compression, opts.compression_level)
        if self.codec is not None:  # (1.5) refused before anything is planned or written
            if not getattr(be, "supports_compression", False):
                raise errors.InvalidOptionError(
                    f"SaveOptions(compression={opts.compression!r}): the storage backend "
                    f"{type(be).__name__} does not write compressed arrays; save with the "
                    "default backend"
                )
            require_zstd(f"SaveOptions(compression={opts.compression!r})")
        self.group = group  # the checkpointer's GroupState: plan cache, async saves
        self.async_save = False
        self.t0 = time.perf_counter()
        self.times: dict = {}
        self.flat: Any = None
        self.struct = b""
        self.plan_hit = False
        self.global_plan: Any = None  # the SavePlan, on the coordinator only
        self.staging = ""
        self.writer: Optional[CheckpointWriter] = None  # this rank's part of the save
        self.work: Optional[RankSaveWork] = None
        self._global_msg: Optional[bytes] = None  # the coordinator's plan message, to send
        self.layouts: dict = {}
        self.stats: dict = {}
        self.sources: list = []  # per chunk write: the tensor to write (host or device)
        self.sends: list = []  # [(dst rank, tensor)]
        self.recvs: list = []  # [(src rank, destination view)]
        self.staging_bytes = 0
        self.written = 0
        self.error: Optional[BaseException] = None  # a local failure, shared at commit
        self.crcs: dict = {}  # what this rank's writes recorded for the chunk tables
        self._handles: dict = {}
        self._created = False  # the arrays this rank owns exist (and ranks agreed)

    def _planned_work(self) -> RankSaveWork:
        """This rank's work, which :meth:`plan` sets before any later phase runs."""
        assert self.work is not None, "a save phase ran before plan()"
        return self.work

    def _planned_writer(self) -> CheckpointWriter:
        """This rank's writer (begun or joined by :meth:`plan`)."""
        assert self.writer is not None, "a save phase ran before plan()"
        return self.writer

    # ---------------------------------------------------------------------- phase 1: plan
    def plan(self) -> None:
        """Local plans up, the global plan decided on the coordinator (or the cached one
        reused when no rank's structure changed), this rank's work back down."""
        err0: Optional[BaseException] = None
        try:
            self.flat = flatten_state(self.state, replica=(self.comm.rank,))
            self.struct = _structure_digest(self.flat) + repr(self.opts.plan).encode()
        except Exception as e:  # noqa: BLE001 - reported collectively below
            err0 = e
        # Plan cache: when no rank's structure (tree shape, holdings, object ids) changed
        # since the last save over this group, ranks send only their values and the
        # coordinator reuses the plan ([SP-GRID-1] holds: the layout depends on structure).
        hit = (
            err0 is None and self.opts.cache_plan and (self.group.plan or (None,))[0] == self.struct
        )
        self.plan_hit = self.comm.all_true(bool(hit))

        def local() -> "bytes | list":
            if err0 is not None:
                raise err0
            f = self.flat
            objs = [(o.key, o.index, o.count, o.replica, o.value) for o in f.objects]
            if self.plan_hit:
                return values.pack([_value_leaves(f.tree), [list(o) for o in objs]])
            return LocalPlan(
                self.comm.rank, f.tree, [t.holding for t in f.tensors], objs
            ).to_parts()

        try:
            msg = run_collectively(
                self.comm,
                local,
                self._decide,
                errors.InvalidShardingError,
                same=self.collective_arguments(),
            )
        except errors.ShardpointError:
            self.group.plan = None
            raise
        if msgpack.unpackb(msg) is not None:
            raise errors.SaveFailedError(f"rank {self.comm.rank}: unexpected save plan reply")
        # the plan, one message for every rank (broadcast): each rank cuts its own work
        g = self.comm.broadcast_bytes(self._global_msg)
        self._global_msg = None
        self.staging, self.layouts, self.stats, self.work = save_work_from_global(g, self.comm.rank)
        if self.writer is None:  # not the coordinator, which began the save
            self.writer = CheckpointWriter.join(self.path, self.staging, backend=self.be)
        if self.opts.check_replicas:  # after the plan: its errors (layout) come first
            t = time.perf_counter()
            check_replicas(self.comm, self.flat.tensors)
            self.times["replica_check"] = time.perf_counter() - t
        self.times["plan_total"] = time.perf_counter() - self.t0
        self.times["plan_cached"] = self.plan_hit

    def _decide(self, payloads: list) -> list:
        """Coordinator: the global plan, the staging directory, one work item per rank."""
        t = time.perf_counter()
        if self.plan_hit:
            plan = self.group.plan[1]
            got = [values.unpack(b) for b in payloads]
            plan.tree = _with_values(plan.tree, [v for v, _ in got])
            plan.objects = plan_objects(
                [
                    LocalPlan(r, None, [], [tuple(o) for o in objs])
                    for r, (_, objs) in enumerate(got)
                ]
            )
        else:
            cache: dict = {}  # distinct holdings runs, decoded once
            plan = plan_save([LocalPlan.from_parts(p, cache) for p in payloads], self.opts.plan)
        self.times["plan"] = time.perf_counter() - t
        # the target checked before anything is written, then the staging location made;
        # known to :meth:`abandon` before the ranks hear of it
        self.writer = CheckpointWriter.begin(self.path, backend=self.be, overwrite=self.overwrite)
        self.staging = staging = self.writer.staging
        self.global_plan = plan
        # one message for every rank, broadcast after the (empty) replies: per-rank replies
        # carry each transfer twice and the coordinator would encode one per rank
        self._global_msg = encode_save_global(
            plan.columns, layouts_of(plan.tensors), plan.stats, staging
        )
        return [msgpack.packb(None)] * self.comm.size

    # ---------------------------------------------------------------------- phase 2: stage
    def stage(self, pool: Optional[StagingPool] = None) -> None:
        """Name what this rank writes and sends. Sync (``pool`` None): the arrays this rank
        owns are created, chunks covered by one piece are written straight from the caller's
        tensors, the others are assembled in buffers. Async: every byte this rank needs later
        is copied into ``pool``, so the caller may change its tensors once this returns (the
        arrays are created later, in the background). Ranks agree before going on."""
        t = time.perf_counter()
        err: Optional[BaseException] = None
        try:
            if pool is None:
                self._name_sources()
            else:
                self._copy_to_pool(pool)
        except Exception as e:  # noqa: BLE001 - shared with every rank just below
            err = e
        try:
            agree(self.comm, err, errors.SaveFailedError)
        except errors.ShardpointError as e:
            self.error = e
        self.times["stage"] = time.perf_counter() - t

    def _views(self) -> PieceViews:
        # resolve_conj/resolve_neg: a lazily conjugated or negated view has no numpy form;
        # they copy only tensors carrying those bits.
        return PieceViews(
            [
                (lt.holding, lt.data.detach().resolve_conj().resolve_neg())
                for lt in self.flat.tensors
            ]
        )

    def _chunk_dtype(self, key: str) -> torch.dtype:
        return dtypes.from_name(self.layouts[key][1]).torch

    def _name_sources(self) -> None:
        work, src = self._planned_work(), self._views()
        self._create_arrays()
        for cw in work.writes:
            if cw.direct is not None:
                v, off = src(*cw.direct)
                self.sources.append(box_view(v, off, cw.offset, cw.shape))
                continue
            buf = torch.empty(cw.shape, dtype=self._chunk_dtype(cw.key))
            for hidx, pidx, bo, bs in cw.local:
                v, off = src(hidx, pidx)
                copy_into(box_view(buf, cw.offset, bo, bs), box_view(v, off, bo, bs))
            self.sources.append(buf)
        for tr in work.sends:
            v, off = src(*tr.src_ref)
            self.sends.append((tr.dst, box_view(v, off, tr.box_offset, tr.box_shape)))
        self._name_recvs()

    def _copy_to_pool(self, pool: StagingPool) -> None:
        work, src = self._planned_work(), self._views()
        send_views = []
        for tr in work.sends:
            v, off = src(*tr.src_ref)
            send_views.append(box_view(v, off, tr.box_offset, tr.box_shape))
        requests = [(tuple(cw.shape), self._chunk_dtype(cw.key)) for cw in work.writes]
        requests += [(tuple(v.shape), v.dtype) for v in send_views]
        bufs, alloc = pool.take(requests)
        self.times["staging_alloc"] = alloc
        self.staging_bytes = pool.nbytes
        self.sources = bufs[: len(work.writes)]
        pairs = []
        for cw, buf in zip(work.writes, self.sources):
            if cw.direct is not None:
                v, off = src(*cw.direct)
                pairs.append((buf, box_view(v, off, cw.offset, cw.shape)))
            for hidx, pidx, bo, bs in cw.local:
                v, off = src(hidx, pidx)
                pairs.append((box_view(buf, cw.offset, bo, bs), box_view(v, off, bo, bs)))
        pairs += list(zip(bufs[len(work.writes) :], send_views))
        copy_pairs(pairs)
        self.sends = [(tr.dst, b) for tr, b in zip(work.sends, bufs[len(work.writes) :])]
        self._name_recvs()

    def _name_recvs(self) -> None:
        w = self._planned_work()
        self.recvs = [
            (
                tr.src,
                box_view(
                    self.sources[tr.dst_ref[0]],
                    w.writes[tr.dst_ref[0]].offset,
                    tr.box_offset,
                    tr.box_shape,
                ),
            )
            for tr in w.recvs
        ]

    def _create_arrays(self) -> None:
        """Create the arrays this rank owns (their zarr.json, [SP-COMMIT-8]) from a few
        threads. Done while staging, before the ranks agree, so no rank writes a chunk into
        an array that does not exist yet."""
        try:
            create = self._planned_work().create
            with OpenAhead(self._handle, create) as opened:
                for key in create:
                    opened(key)
        except Exception as e:  # noqa: BLE001 - raised again as the documented error
            raise self.write_error(e) from e
        self._created = True

    def _handle(self, key: str) -> Any:
        if key not in self._handles:
            shape, dt, chunk = self.layouts[key]
            self._handles[key] = self._planned_writer().open_array(
                array_path_for(key),
                ArraySpec(tuple(shape), dt, tuple(chunk), compression=self.codec),
            )
        return self._handles[key]

    # ---------------------------------------------------------------------- phase 3: write
    def write(self, comm: Comm) -> None:
        """Exchange misaligned pieces, write every chunk, make them durable (``flush``).
        A local failure is kept for :meth:`commit`, which every rank reaches."""
        if self.error is not None:
            return
        t = time.perf_counter()
        opened: Optional[OpenAhead] = None
        ops: list = []
        w, work = self._planned_writer(), self._planned_work()
        try:
            if not self._created:
                # An async save creates its arrays here, off the caller's time; the ranks
                # agree before any of them opens another rank's array to write a chunk.
                err: Optional[BaseException] = None
                try:
                    self._create_arrays()
                except Exception as e:  # noqa: BLE001 - shared with every rank just below
                    err = e
                agree(comm, err, errors.SaveFailedError)
            opened = OpenAhead(self._handle, [cw.key for cw in work.writes])
            exchange(comm, self.sends, self.recvs, self.opts.exchange_budget_bytes)
            self.sends = self.recvs = []
            self.times["exchange"] = time.perf_counter() - t
            device = []
            for cw, buf in zip(work.writes, self.sources):
                if buf.device.type != "cpu":
                    device.append((buf, cw))
                    continue
                ops.append((w.write(opened(cw.key), cw.offset, to_numpy(buf)), buf))
                self.written += buf.numel() * buf.element_size()
            if device:  # CUDA tensors (sync save): bounded pinned staging, overlapped
                ops += stream_device_writes(
                    device,
                    lambda host, cw: w.write(opened(cw.key), cw.offset, to_numpy(host)),
                    lambda op: w.wait([op]),
                    self.opts.device_staging_bytes,
                )
                self.written += sum(b.numel() * b.element_size() for b, _ in device)
            w.wait([op for op, _ in ops])
            self.times["write"] = time.perf_counter() - t
            t = time.perf_counter()
            # durable, and the crc32c of the units this rank wrote, for the chunk tables
            self.crcs = w.flush()
            self.times["flush"] = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            self.error = self.write_error(e)
            log.error("shardpoint save: rank %d failed: %s", comm.rank, self.error)
            # writes already in flight finish before the caller can remove the staging
            # directory: one still writing would hold its file's space (or recreate it)
            try:
                w.wait([op for op, _ in ops])
            except Exception:  # noqa: BLE001 - the first error is the one reported
                pass
        finally:
            if opened is not None:
                opened.close()
            self.sources = []

    def collective_arguments(self) -> list:
        """What every rank of a save must pass alike, agreed in the plan before any byte is
        written: a rank saving with another ``overwrite``, ``async_save`` or plan options
        than its peers would replace, or chunk, what the others do not expect."""
        return [
            ("checkpoint path", os.path.normpath(self.path)),
            ("overwrite flag", bool(self.overwrite)),
            ("async_save flag", bool(self.async_save)),
            ("SaveOptions.plan", repr(self.opts.plan)),
            ("SaveOptions.exchange_budget_bytes", int(self.opts.exchange_budget_bytes)),
            ("SaveOptions.check_replicas", bool(self.opts.check_replicas)),
            ("SaveOptions.compression", repr(self.codec)),
        ]

    def write_error(self, e: BaseException) -> errors.ShardpointError:
        """``e``, raised while creating arrays or writing chunks, as the error to report: a
        storage failure (the backend's own error carrying an ``OSError``, or the ``OSError``
        itself) becomes :meth:`write_failed`, whichever step a full disk happened to hit."""
        if isinstance(e, errors.SaveFailedError) and isinstance(e.__cause__, OSError):
            return self.write_failed(e.__cause__, str(e))
        return e if isinstance(e, errors.ShardpointError) else self.write_failed(e)

    def write_failed(self, e: BaseException, said: str = "") -> errors.SaveFailedError:
        """A failed write as the documented error: the checkpoint, the cause (a full disk
        names the file it could not write) and what to do about it. ``said``: the backend's
        message, kept where it already holds the cause and fix and names more (the packed
        writer names the tensor whose chunk did not fit)."""
        text = os_error_text(e)
        return errors.SaveFailedError(
            f"cannot write checkpoint {self.path!r} (into its staging directory "
            f"{self.staging!r}): {said if text in said else text}. Nothing was committed: a "
            "previous checkpoint at that path is untouched, and the partial files are removed"
        )

    # ---------------------------------------------------------------------- phase 4: commit
    def commit(self, comm: Comm) -> SaveResult:
        """Every rank reports; if all succeeded the coordinator writes the manifest and
        renames the staging directory into place, else it removes it and all ranks raise."""
        t = time.perf_counter()
        # what this rank's writes recorded for the chunk tables ([SP-MAN-7]) came with its
        # flush; taken here as well on every other outcome, so nothing stays in the backend
        if self.writer is not None:
            self.writer.take_chunk_crc32c()
        if self.error is not None:
            self.crcs = {}

        def report() -> bytes:
            e = self.error
            if e is not None:
                raise (
                    e
                    if isinstance(e, errors.ShardpointError)
                    else errors.SaveFailedError(f"{type(e).__name__}: {e}")
                )
            # the crc32c of the units this rank wrote, for the chunk tables ([SP-MAN-7])
            return msgpack.packb(
                [[p, [[f, b] for f, b in d.items()]] for p, d in self.crcs.items()],
                use_bin_type=True,
            )

        comm.after_failure = after_commit(self.path)
        try:
            files = msgpack.unpackb(
                run_collectively(comm, report, self._publish, errors.SaveFailedError)
            )
        except errors.ShardpointError:
            self.group.plan = None
            if comm.is_coordinator and self.writer is not None:
                self.writer.abort()
            raise
        if self.opts.cache_plan:
            self.group.plan = (self.struct, self.global_plan)
        self.times["commit"] = time.perf_counter() - t
        self.times["total"] = time.perf_counter() - self.t0
        self.times["staging_bytes"] = self.staging_bytes
        st = self.stats
        if comm.is_coordinator:
            log.info(
                "shardpoint save %s: %d tensors, %.1f MiB unique, %.1f MiB exchanged, "
                "plan %.3fs%s, write %.3fs, commit %.3fs, total %.3fs",
                self.path,
                st["tensors"],
                st["unique_bytes"] / 2**20,
                st["exchange_bytes"] / 2**20,
                self.times["plan_total"],
                " (cached)" if self.plan_hit else "",
                self.times.get("write", 0.0),
                self.times["commit"],
                self.times["total"],
            )
        return SaveResult(
            self.path,
            comm.size,
            st["tensors"],
            st["unique_bytes"],
            st["exchange_bytes"],
            st["chunks"],
            self.written,
            self.times,
            files=files,
            rank_chunk_files=len(self._planned_work().writes),
        )

    def abandon(self) -> None:
        """After an interrupt (KeyboardInterrupt, SystemExit, an exception a signal handler
        raised) cut a phase short: the coordinator removes the staging directory and drops
        its lock, as a failed save does, instead of leaving a whole checkpoint's worth of
        partial files behind for ``recover`` (and the lock held while the process lives)."""
        if self.comm.is_coordinator and self.writer is not None:
            self.writer.abort()

    def _publish(self, payloads: list) -> list:
        """Coordinator, every rank having succeeded: manifest last, then the rename (or the
        marker); on any failure the writer aborts, nothing of the save stays."""
        plan, w = self.global_plan, self._planned_writer()
        try:
            m = Manifest(
                plan.tree,
                _entries(plan.tensors, payloads),
                plan.objects,
                save_world_size=self.comm.size,
            )
            if self.codec is not None and m.tensors:
                m.format_version = FORMAT_VERSION_1_5  # compressed arrays [SP-ARRAY-7]
            elif any(e.chunk_crc32c is not None for e in m.tensors.values()):
                m.format_version = FORMAT_VERSION_1_3  # the bytes hold a 1.3 construct
            else:
                m.format_version = FORMAT_VERSION
            w.commit(m)
            if m.packed is not None:  # its own data objects (not its bases') and the manifest
                index = m.packed
                files = 1 + sum(index.base_of(i) is None for i in range(len(index.objects)))
            else:
                st = self.stats
                files = st["chunks"] + st["tensors"] + 1 + st.get("groups", 0)
        except BaseException as e:
            w.abort()  # a no-op where the commit aborted already
            if isinstance(e, OSError) and not isinstance(e, errors.ShardpointError):
                # the manifest's own write found the disk full
                raise errors.SaveFailedError(
                    f"cannot commit checkpoint {self.path!r}: {os_error_text(e)}. Nothing "
                    "was committed; the staged files are removed"
                ) from e
            raise
        return [msgpack.packb(files)] * self.comm.size


def _entries(tensors: dict, payloads: list) -> dict:
    """The manifest's tensor entries, each with its chunk table ([SP-MAN-7]) where every
    chunk's writer recorded its units' crc32c (``payloads``: the ranks' commit reports)."""
    merged: dict = {}  # array path -> chunk number -> its units' crc32c, every rank's
    for p in payloads:  # one pass over what the ranks sent, not one per tensor and rank
        for path, chunks in msgpack.unpackb(p, raw=False) if p else ():
            merged.setdefault(path, {}).update(chunks)
    out = {}
    for k, v in tensors.items():
        path = array_path_for(k)
        out[k] = TensorEntry(
            k,
            path,
            v.shape,
            v.dtype,
            v.chunk_shape,
            join_tables([merged], path, v.shape, v.chunk_shape),
        )
    return out


# -------------------------------------------------------------------------------- save
def run_save(
    state: Any,
    path: str,
    comm: Comm,
    be: Optional[StorageBackend],
    opts: SaveOptions,
    overwrite: "bool | str",
    group: Any,
    async_save: bool,
) -> "SaveResult | AsyncSave":
    """One save, phase by phase, with ``group`` (the checkpointer's state for ``comm``'s
    process group: plan cache, pending async save and its pool, side group). What
    :meth:`Checkpointer.save` runs."""
    path, be = resolve(path, be, "save")  # s3://... is never a local directory 's3:'
    ow = check_overwrite(overwrite)
    comm.after_failure = AFTER_SAVE
    saves = group.saves
    saves.settle(lambda err: agree(comm, err, errors.SaveFailedError))
    job = SaveJob(state, path, comm, be, opts, ow, group)
    job.async_save = async_save
    try:
        job.plan()
        if not async_save:
            job.stage()
            job.write(comm)
            res = job.commit(comm)
            release_free_heap()  # flat memory over save cycles: see api/heap.py
            return res
        job.stage(saves.pool)
        if job.error is not None:
            job.commit(comm)  # raises the staging failure on every rank, removes staging
        side = group.side_comm(comm)
    except BaseException:
        job.abandon()
        raise
    job.times["blocking"] = time.perf_counter() - job.t0

    def background() -> SaveResult:
        t = time.perf_counter()
        job.write(side)
        res = job.commit(side)
        res.timings["background"] = time.perf_counter() - t
        release_free_heap()
        return res

    return saves.start(background, job.staging_bytes, job.path, opts.async_priority)
