"""A checkpoint manager for JAX training loops: numbered steps, metrics, retention, resume.

A layer over :func:`shardpoint_jax.save` / :func:`shardpoint_jax.load`, with the directory
rules of the PyTorch reference's manager, so one root can be written by either and read by
the other: one directory per step (``<root>/step_00000042``; on an object store, ``root`` a
URL such as ``s3://bucket/run``, one prefix per step); only committed checkpoints (with
a manifest) count; metrics are plain values inside each step's checkpoint under the reserved
top-level key ``"__metrics__"``. Leftovers of a crash (hidden ``.step_N.shardpoint-tmp-*``
staging directories, step directories without a manifest; on object stores, save prefixes
no manifest names, once ``leftover_min_age_s`` old) are ignored and cleaned by the next
save or load; a ``.step_N.shardpoint-old-*`` directory left by a crash in the middle of an
overwrite is put back when its step is missing, else removed.

Retention, applied after a save commits, is the torch manager's, from
:mod:`shardpoint_core.format.policy`: ``retention=`` a policy (``AnyOf(LatestN(3), BestN(2,
"loss"))``), or the shortcuts ``max_to_keep`` (None: all), ``keep_every`` and ``keep_best``
(``best_metric`` alone only ranks steps for :meth:`best_step`); the newest committed step is
never deleted. Deletion and clean-up go through the committer's lock rule: an observer's
manager never deletes what a live save holds.

Collective: every process calls ``save``/``load``/``wait``/``close`` in the same order; only
process 0 creates, renames or deletes directories, and what it decides (a refused step, the
latest step, a failed clean-up) reaches every process, which raise the same error.
``latest_step``, ``all_steps``, ``best_step`` and ``metrics`` only read, on any process or in
an observer job; constructing a manager never touches the directory.

Tiers (``memory=spj.MemoryTier(...)``, :mod:`shardpoint_jax.manager_tiers`), as in the torch
manager: every ``memory_every`` steps to host memory, replicated to peer hosts; every
``storage_every`` steps to storage, copied from that memory step in the background by
process 0 (the objects, then the manifest last), tried again after a failure that may pass
(``copy_attempts``, ``copy_backoff_s``); a failed copy is reported at the next ``save`` or
``wait`` in ``tier_warnings`` and never stops training. ``load()`` takes the newest step
across both tiers, checks every piece, passes over a step it cannot have whole (the same
step in storage, then the next older step), and says in ``last_load`` what it took from
where.

    tier = spj.MemoryTier("run42", k=1)
    mgr = spj.CheckpointManager("/ckpt", memory=tier, storage_every=100, max_to_keep=3)
    mgr.save(step, state)            # every step: memory; every 100th: storage too

    with spj.CheckpointManager("/ckpt", max_to_keep=3, async_save=True) as mgr:
        start = mgr.latest_step() or 0
        if start:
            state = mgr.load(target=abstract_state)      # jax.ShapeDtypeStructs, shardings
        for step in range(start + 1, steps + 1):
            ...
            if step % 100 == 0:
                mgr.save(step, state, metrics={"loss": loss})
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import jax
import numpy as np

from shardpoint_core.commit.cleanup import DEFAULT_MIN_AGE_S
from shardpoint_core.commit.steps import StepRoot
from shardpoint_core.format.errors import ShardpointError as CoreError
from shardpoint_core.format.policy import (
    Retention,
    check_metric,
    policy_from_options,
    ranked,
    retained,
    step_number,
)
from shardpoint_core.format.statetree import ValueLeaf, node_at
from shardpoint_core.transactions.packed import step_backend
from shardpoint_core.transactions.protocol import StorageBackend
from shardpoint_core.transactions.resolve import backend_for
from shardpoint_jax import errors as E
from shardpoint_jax.async_save import AsyncSave
from shardpoint_jax.comm import Comm
from shardpoint_jax.loading import load as spj_load
from shardpoint_core.transactions.tiers import LoadInfo
from shardpoint_jax.manager_tiers import Tiers, load_tiered, report, save_tiered
from shardpoint_jax.saving import error_info, raise_info
from shardpoint_jax.saving import save as spj_save
from shardpoint_jax.storage import checkpoint_path, read_manifest
from shardpoint_jax.values import pack, unpack

METRICS_KEY = "__metrics__"

log = logging.getLogger("shardpoint")


class CheckpointManager:
    """Numbered checkpoints under ``root`` with retention, best-k tracking and resume.

    ``async_save=True`` makes :meth:`save` return once ``spj.save(..., async_save=True)`` has
    (the writes and the commit run in the background); retention of older steps runs once
    that save has committed, at the next :meth:`save`, :meth:`wait` or :meth:`close`.

    ``memory``: a :class:`~shardpoint_jax.MemoryTier` (made by every process, closed by the
    caller after the manager); then ``memory_every`` (steps between memory saves, default 1),
    ``storage_every`` (steps between durable copies, required; such a step goes to memory
    too), ``memory_keep`` (memory steps kept, default 2, plus one being copied),
    ``copy_attempts`` and ``copy_backoff_s`` (a failed durable copy is tried again that many
    times in all, after that many seconds, doubling), ``parallel_copy`` (every process
    copies the objects its host holds, process 0 commits once all are durable; default:
    process 0 copies alone); storage retention is the options above. ``tier_warnings`` lists the failed (or retried) copies, ``last_load``
    (:class:`~shardpoint_core.transactions.tiers.LoadInfo`) where the last load came from.
    """

    def __init__(
        self,
        root: str,
        *,
        max_to_keep: Optional[int] = None,
        keep_every: Optional[int] = None,
        best_metric: Optional[str] = None,
        best_mode: str = "min",
        keep_best: Optional[int] = None,
        retention: Optional[Retention] = None,
        async_save: bool = False,
        memory: Any = None,
        memory_every: int = 1,
        memory_keep: int = 2,
        storage_every: Optional[int] = None,
        copy_attempts: int = 3,
        copy_backoff_s: float = 1.0,
        parallel_copy: bool = False,
        backend: Optional[StorageBackend] = None,
        incremental: bool = False,
    ) -> None:
        #: the tier policy (None: every save goes to storage, as without a memory tier)
        self._tiers: Optional[Tiers] = None
        try:
            if memory is not None:
                self._tiers = Tiers(
                    memory,
                    memory_every,
                    memory_keep,
                    storage_every,
                    copy_attempts=copy_attempts,
                    copy_backoff_s=copy_backoff_s,
                    parallel_copy=parallel_copy,
                    tier_class="shardpoint_jax.MemoryTier",
                    async_save=async_save,
                )
            elif storage_every is not None:
                raise E.InvalidOptionError(
                    "storage_every= needs memory=spj.MemoryTier(...); without a memory tier "
                    "every save goes to storage: call save() every N steps"
                )
            if retention is not None:
                if not isinstance(retention, Retention):
                    raise E.InvalidRequestError(
                        f"retention must be a policy of shardpoint_core.format.policy (LatestN, "
                        f"EveryNSteps, BestN, AnyOf), got {retention!r}"
                    )
                if (max_to_keep, keep_every, keep_best) != (None, None, None):
                    raise E.InvalidRequestError(
                        "pass retention= or max_to_keep/keep_every/keep_best, not both "
                        "(combine them with AnyOf(LatestN(n), EveryNSteps(k), BestN(b, m)))"
                    )
            self.retention = retention or policy_from_options(
                max_to_keep, keep_every, best_metric, best_mode, keep_best
            )
            if best_metric is not None:
                check_metric(best_metric, best_mode)
            saves_through = backend  # (the committer below: the one of this backend)
            if incremental:  # a backend of another layout: refused now
                saves_through = step_backend(backend, None)
        except CoreError as e:  # the core's InvalidOptionError, in this package's terms
            raise E.InvalidRequestError(str(e)) from None
        self.root = checkpoint_path(root, "CheckpointManager(root)")  # a path or a URL
        # Step paths, committed steps, removal and clean-up: the core's, shared with the torch
        # manager, through the committer of the backend this manager's saves go through (the
        # one holding their locks: the lock rule then sees this process's own saves).
        self.max_to_keep, self.keep_every, self.keep_best = max_to_keep, keep_every, keep_best
        self.best_metric, self.best_mode = best_metric, best_mode
        self.async_save = bool(async_save)
        #: the backend of every save, in memory and in storage (None: the default, packed)
        self.backend = backend
        #: every save builds on the newest committed step ([SP-PACK-9]); retention keeps
        #: the steps that kept ones build on ([SP-PACK-11])
        self.incremental = bool(incremental)
        self._pending: Optional[AsyncSave] = None
        self._metrics: dict = {}  # step -> metrics (a cache of the manifests)
        self.retention_warnings: list = []  # what the last retention could not do
        #: committed checkpoints below the root under names this manager does not write
        #: (``step_7`` saved by hand), as the last retention found them: never counted,
        #: kept or removed; each is logged once
        self.stray: list = []
        self._steps = StepRoot(
            self.root, backend=backend_for(self.root, saves_through), call="CheckpointManager(root)"
        )
        #: what the tiers' background work reported (a failed or retried durable copy),
        #: on every process
        self.tier_warnings: list = []
        #: where the last :meth:`load` took its state from (:class:`LoadInfo`)
        self.last_load: Optional[LoadInfo] = None

    # Leftovers of crashed saves younger than this are left alone: on an object store nothing
    # tells a crashed save from a running one ([SP-COMMIT-15]); on files, where no lock says.
    leftover_min_age_s = DEFAULT_MIN_AGE_S

    # ---------------------------------------------------------------- reading (any process)
    def path(self, step: int) -> str:
        """The location of ``step`` (it may not exist): a directory, or a URL."""
        return self._steps.path(_step_number(step))

    def stray_checkpoints(self) -> list:
        """The committed checkpoints directly below the root under names this manager does
        not write (``step_7`` saved by hand, ``final``): no steps; retention never counts,
        keeps or removes them."""
        return self._steps.strays()

    def all_steps(self) -> list:
        """Committed steps, oldest first (incomplete ones are ignored)."""
        return self._steps.all_steps()

    def latest_step(self) -> Optional[int]:
        """The newest committed step, or None; with a memory tier, the newest across tiers
        (memory and storage)."""
        s = self.all_steps()
        if self._tiers is not None:
            s = sorted(set(s) | set(self.memory_steps()))
        return s[-1] if s else None

    def memory_steps(self) -> list:
        """The committed memory steps any reachable host holds, oldest first (empty without a
        memory tier); ``all_steps`` are the storage ones."""
        return self._tiers.memory.steps() if self._tiers is not None else []

    def metrics(self, step: int) -> dict:
        """The metrics saved with ``step`` (empty when none were given); reads the manifest
        only."""
        if step not in self._metrics:
            node = node_at(read_manifest(self.path(step)).tree, (METRICS_KEY,))
            self._metrics[step] = (
                {k: n.value for k, n in node.items() if isinstance(n, ValueLeaf)}
                if isinstance(node, dict)
                else {}
            )
        return dict(self._metrics[step])

    def best_step(self) -> Optional[int]:
        """The committed step with the best ``best_metric`` (newest on ties), or None."""
        ranked = self._ranked(self.all_steps())
        return ranked[0] if ranked else None

    def _ranked(self, steps: list) -> list:
        """Steps carrying a finite ``best_metric``, best first (newer first on ties)."""
        if self.best_metric is None:
            return []
        return ranked(steps, self.metrics, self.best_metric, self.best_mode)

    def retained(self, steps: list) -> set:
        """Which of the committed ``steps`` retention keeps (pure; the rule in one place:
        :func:`shardpoint_core.format.policy.retained`)."""
        return retained(self.retention, steps, self.metrics)

    # ---------------------------------------------------------------- collective
    def save(
        self, step: int, tree: Any, *, metrics: Optional[dict] = None, force: bool = False
    ) -> Optional[AsyncSave]:
        """Save ``tree`` as ``step`` (every process calls it); then apply retention.

        ``metrics`` (str -> number or str) are stored in the checkpoint itself. ``force=True``
        replaces a committed checkpoint of the same step (else CheckpointExistsError on every
        process). Returns None, or the :class:`AsyncSave` handle with ``async_save=True``.
        With ``memory=``: into memory when due, then the durable copy started when due (None
        returned); a failed memory save raises here, a failed durable copy never does.
        """
        if self._tiers is None:
            self.wait()  # the previous save commits (and its retention runs) first
        n, err = None, None
        try:
            n = _step_number(step)
            tree = with_metrics(tree, metrics)
        except E.ShardpointError as e:
            err = e
        if self._tiers is not None:
            self._agreed("manager-save", n, err, lambda n: None)
            assert n is not None
            self._save_tiered(n, tree, force)
            return None
        base = self._agreed("manager-save", n, err, self._before_save)
        assert n is not None  # else _agreed raised err on every process
        path = self.path(n)
        self._metrics.pop(n, None)
        backend = self.backend
        if self.incremental:  # (:func:`shardpoint_core.transactions.packed.step_backend`)
            backend = step_backend(self.backend, base)
        try:
            handle = spj_save(
                path, tree, overwrite=bool(force), async_save=self.async_save, backend=backend
            )
        except E.CheckpointExistsError as e:  # decided by process 0, raised everywhere
            raise E.CheckpointExistsError(
                f"step {n} is already saved at {path!r}; pass force=True to replace it",
                spec_id="SP-COMMIT-5",
            ) from e
        if handle is None:
            self._after_commit()
        else:
            self._pending = handle
        return handle

    def _before_save(self, step: Optional[int]) -> Optional[str]:
        """Process 0, before a save of ``step``: clean what crashed saves left; with
        ``incremental``, the base of the save, the newest committed step before ``step``
        (None: a full save that records the hashes the next one compares against), the
        same on every process."""
        self._clean_leftovers()
        if not self.incremental or step is None:
            return None
        return self._storage_base(step)

    def _storage_base(self, step: int) -> Optional[str]:
        """(``incremental``, process 0) what a save or durable copy of ``step`` builds on:
        the newest committed step before it (None: none)."""
        earlier = [s for s in self.all_steps() if s < step]
        return self.path(earlier[-1]) if earlier else None

    def load(self, step: Optional[int] = None, target: Any = None, *, strict: bool = True) -> Any:
        """Load ``step`` (default: the latest committed one, as process 0 sees it) through
        :func:`shardpoint_jax.load` (``target``, ``strict`` as there). Every process calls it.
        The metrics are not returned unless ``target`` names ``"__metrics__"``."""
        self.wait()
        want, err = None, None
        try:
            want = None if step is None else _step_number(step)
        except E.ShardpointError as e:
            err = e
        if self._tiers is not None:
            return self._load_tiered(want, err, target, strict)

        def decide(want: Optional[int]) -> int:
            self._clean_leftovers()
            have = self.all_steps()
            if want is None and not have:
                raise E.CheckpointNotFoundError(
                    f"no committed checkpoint under {self.root!r} (nothing to resume from)"
                )
            if want is not None and want not in have:
                raise E.CheckpointNotFoundError(
                    f"step {want} is not a committed checkpoint "
                    f"under {self.root!r}; committed steps: {have}"
                )
            return want if want is not None else have[-1]

        n = self._agreed("manager-load", want, err, decide)
        out = spj_load(self.path(n), target, strict=strict)
        if target is None and isinstance(out, dict):
            out.pop(METRICS_KEY, None)
        self.last_load = LoadInfo(n, "storage", self.path(n))
        return out

    def wait(self) -> None:
        """Wait for an in-flight asynchronous save (raising its error), then apply retention;
        with ``memory=``, for the durable copy in flight (reported in ``tier_warnings``, never
        raised). Every process calls it."""
        if self._tiers is not None:
            self._report(block=True)
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()
            self._after_commit()

    def close(self) -> None:
        """Wait for the last save (with ``memory=``, the last durable copy: every process
        keeps serving its host's memory until then); the manager may still be used for
        reading afterwards."""
        self.wait()

    # ---------------------------------------------------------------- tiers (collective)
    def _save_tiered(self, n: int, tree: Any, force: bool) -> None:
        """``save`` with a memory tier (:mod:`shardpoint_jax.manager_tiers`)."""
        return save_tiered(self, n, tree, force)

    def _report(self, block: bool, start: Optional[tuple] = None) -> None:
        report(self, block, start)

    def _load_tiered(
        self, want: Optional[int], err: Optional[BaseException], target: Any, strict: bool
    ) -> Any:
        return load_tiered(self, want, err, target, strict)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:  # the original error wins; still try not to leave a save behind
            try:
                self.close()
            except Exception:  # noqa: BLE001
                pass

    def _agreed(
        self,
        what: str,
        step: Optional[int],
        err: Optional[BaseException],
        decide: Callable[[Optional[int]], Any],
    ) -> Any:
        """Every process's ``step`` (or the error its arguments gave) to process 0, which
        checks they agree and returns ``decide(step)`` to all: its result, or the same error
        raised on every process (never one failing while the others wait in the save)."""
        comm = Comm(what)
        got = comm.gather(
            "args", pack({"error": error_info(err)} if err is not None else {"step": step})
        )
        if comm.rank == 0:
            try:
                infos = [unpack(b) for b in got]
                bad = [i["error"] for i in infos if "error" in i]
                if bad:
                    raise_info(bad[0], what)
                steps = [i["step"] for i in infos]
                if len(set(steps)) > 1:
                    raise E.InvalidRequestError(
                        f"processes passed different steps {steps}; every process of the job "
                        "must save or load the same step"
                    )
                outcome = {"ok": decide(steps[0])}
            except Exception as e:  # noqa: BLE001 - a storage error too: every process raises
                outcome = {"error": error_info(e)}
            comm.broadcast("outcome", pack(outcome))
        else:
            outcome = unpack(comm.broadcast("outcome"))
        if "error" in outcome:
            if err is not None:
                raise err
            raise_info(outcome["error"], what)
        return outcome["ok"]

    # ---------------------------------------------------------------- process 0 only
    def _after_commit(self) -> None:
        """Retention on process 0, its outcome on every process: the other processes return
        once the old steps are gone, and a failure is raised everywhere."""
        comm = Comm("manager-retain")
        if comm.rank == 0:
            outcome = b""
            try:
                self._retain()
            except Exception as e:  # noqa: BLE001
                outcome = pack(error_info(e))
            comm.broadcast("retained", outcome)
        else:
            outcome = comm.broadcast("retained")
            self._metrics.clear()
        if outcome:
            raise_info(unpack(outcome), "retention")

    def _retain(self) -> None:
        """Retention through the committer (StepRoot.retain): a reader gets 'no checkpoint',
        never half a step; its problems are warnings (``retention_warnings``, logged), never a
        failure of the save that committed."""
        self.retention_warnings = self._steps.retain(self.retention, self.metrics)
        for w in self.retention_warnings:
            log.warning("shardpoint: %s", w)
        self.stray = self._steps.report_strays(self.stray)
        self._metrics.clear()

    def _clean_leftovers(self) -> None:
        """Remove what crashed saves left; restore a step whose overwrite crashed midway;
        never what a live save holds (:meth:`shardpoint_core.commit.steps.StepRoot.
        clean_leftovers`: the lock rule on files, the minimum age on object stores)."""
        self._steps.clean_leftovers(self.leftover_min_age_s)


def _step_number(step: Any) -> int:
    try:
        return step_number(step)
    except CoreError as e:
        raise E.InvalidKeyError(str(e)) from None


def with_metrics(tree: Any, metrics: Optional[dict]) -> Any:
    """``tree`` with ``metrics`` under the reserved key as plain values (a 0-d array or
    numpy scalar becomes a Python number), or the reason it cannot be."""
    if metrics is None:
        return tree
    if not isinstance(metrics, dict):
        raise E.UnsupportedValueError(
            f"metrics must be a dict of name -> number (e.g. "
            f"{{'loss': 0.31}}), got a {type(metrics).__name__}"
        )
    if not isinstance(tree, dict):
        raise E.UnsupportedValueError(
            f"metrics need a dict tree (they are stored under its {METRICS_KEY!r} key), got "
            f"a {type(tree).__name__}; wrap it: {{'state': tree}}"
        )
    if METRICS_KEY in tree:
        raise E.UnsupportedValueError(
            f"tree key {METRICS_KEY!r} is reserved for the manager's metrics; rename it"
        )
    plain = {}
    for k, v in metrics.items():
        if not isinstance(k, str):
            raise E.UnsupportedValueError(f"metric name {k!r} must be a str")
        if isinstance(v, (jax.Array, np.ndarray, np.generic)):
            if np.ndim(v) != 0:
                raise E.UnsupportedValueError(
                    f"metric {k!r} has shape {np.shape(v)}; a metric is one number (or str)"
                )
            v = np.asarray(v).item()
        if v is not None and not isinstance(v, (bool, int, float, str)):
            raise E.UnsupportedValueError(
                f"metric {k!r} is a {type(v).__name__}; a metric is a number, a str or None"
            )
        plain[k] = v
    return {**tree, METRICS_KEY: plain}
