"""A thin checkpoint manager for training loops: numbered steps, metrics, retention, resume.

A layer over :func:`shardpoint.save` / :func:`shardpoint.load` and nothing more. One directory
per step (``<root>/step_00000042``, so names sort by step); only committed checkpoints (with a
manifest) under that name count. Anything else below the root is not the manager's and is
never counted, kept or removed, on every store alike: a user's ``exports/``, a hand-made
``step_5``; a committed checkpoint under another name (``sp.save(x, root + "/step_7")``) is
reported once retention runs (``stray``, :meth:`CheckpointManager.stray_checkpoints`, one
warning in the ``shardpoint`` log). Metrics live inside each step's checkpoint (plain values under the reserved
top-level key ``"__metrics__"``), so they can never disagree with it. Leftovers of a crash
(hidden ``.<step>.shardpoint-tmp-*`` staging directories, step directories without a manifest)
are ignored and cleaned; a ``.<step>.shardpoint-old-*`` directory left by a crash in the middle
of an overwrite is put back when its step is missing, else removed.

Retention, applied after a save commits, is a policy of :mod:`shardpoint_core.format.policy`
(``retention=AnyOf(LatestN(3), EveryNSteps(1000), BestN(2, "loss"))``), or the shortcuts
``max_to_keep`` (the newest N; None: all), ``keep_every`` and ``keep_best`` (the best N by
``best_metric``; ``best_metric`` alone only ranks steps for :meth:`best_step`). The newest
complete step is never deleted. Deletion goes through the committer: the step is locked,
hidden by one rename, then deleted, so a crash mid-delete leaves a leftover, never a half
step, and a process reading it meanwhile gets an error, never tensors of two steps.

Collective like ``save``: every rank of ``group`` calls ``save``/``load``/``wait``/``close``;
only the coordinator creates, renames or deletes directories, and only inside ``save`` and
``load`` (the job owning ``root`` resumes or saves; nothing of its own is in flight then).
``latest_step``, ``all_steps``, ``best_step`` and ``metrics`` only read and may be called on
any rank, or by an observer (an evaluation job) while training runs: constructing a manager
never touches the directory, and the clean-up of its ``save``/``load`` skips whatever a live
save holds (the committer's lock rule), so an observer cannot disturb a save in progress.
``backend``, ``save_options`` and ``load_options`` go to every save and load (with a memory
tier, the memory saves too: ``backend`` sets the layout of every step, in both tiers).

``root`` may be an object-store prefix (``s3://bucket/run``, ``gs://bucket/run``): steps are
``<root>/step_00000042`` prefixes committed by their manifest (format.md 9.1); retention
deletes a step's marker first, then its objects; the clean-up removes save prefixes that no
marker names only once they are 15 minutes old ([SP-COMMIT-15]), since nothing on the store
tells a running save from a dead one (:class:`shardpoint_core.commit.steps.StepRoot`).

Tiers (``memory=sp.MemoryTier(...)``, :mod:`shardpoint.api.manager_tiers`): every
``memory_every`` steps to host memory, replicated to peer hosts (fast); every
``storage_every`` steps to storage, copied from that memory step in the background by the
coordinator (the objects, then the manifest last; never from the trainer's tensors). A failed
copy is reported at the next ``save``/``wait`` in ``tier_warnings`` and never stops training.
``load()`` takes the newest step across both tiers, checks every piece, passes over a step it
cannot have whole (the peers first, then the same step in storage, then the next older step),
and says in ``last_load`` what it took from where. Without ``memory=``, nothing changes.

    tier = sp.MemoryTier("run42", k=1, budget_bytes=8 << 30)
    mgr = sp.CheckpointManager("/ckpt", memory=tier, storage_every=100, memory_keep=2,
                               max_to_keep=3)
    mgr.save(step, state)            # every step: memory; every 100th: storage too

    with sp.CheckpointManager("/ckpt", max_to_keep=3, async_save=True) as mgr:
        start = mgr.latest_step() or 0
        if start:
            state = mgr.load(like=state)
        for step in range(start + 1, steps + 1):
            ...
            if step % 100 == 0:
                mgr.save(step, state, metrics={"loss": loss})
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import msgpack

from shardpoint import api
from shardpoint_core.format import errors
from shardpoint.exchange.comm import Comm, agree
from shardpoint_core.commit.steps import StepRoot
from shardpoint_core.format.policy import (
    Retention,
    check_metric,
    policy_from_options,
    ranked,
    retained,
)
from shardpoint_core.format.statetree import ValueLeaf, node_at
from shardpoint_core.transactions.protocol import StorageBackend
from shardpoint.api.manager_tiers import Exchange, LoadInfo, Tiers, load_across_tiers, tier_plan

METRICS_KEY = "__metrics__"

log = logging.getLogger("shardpoint")


class CheckpointManager:
    """Numbered checkpoints under ``root`` with retention, best-k tracking and resume.

    ``async_save=True`` makes :meth:`save` return once the state is staged (the writes and the
    commit run in the background, see ``sp.save(..., async_save=True)``); retention of older
    steps runs once that save has committed, and :meth:`wait` / :meth:`close` wait for it.

    ``incremental=True``: every step is saved in the packed layout with chunk hashes and
    builds on the newest committed step before it (spec/format.md [SP-PACK-9]): unchanged
    chunks (frozen weights) are referred to, not written again. Retention keeps, beyond its
    policy, every step that a kept step builds on, until nothing kept refers to it
    ([SP-PACK-11]). With ``memory=`` the memory steps are incremental too (each
    builds on the newest memory step before it; memory retention keeps what kept steps
    build on), and each durable copy builds on the newest storage step before it.

    ``memory``: a :class:`~shardpoint.MemoryTier` (started by every rank, closed by the
    caller after the manager); then ``memory_every`` (steps between memory saves, default 1),
    ``storage_every`` (steps between durable copies, required; such a step goes to memory
    too), ``memory_keep`` (memory steps kept, default 2, plus one being copied),
    ``copy_attempts`` and ``copy_backoff_s`` (a failed durable copy is tried again that many
    times in all, after that many seconds, doubling), ``parallel_copy`` (every rank copies
    the objects its host holds, the coordinator commits once all are durable; default: the
    coordinator copies alone); storage retention is the options above. ``tier_warnings`` lists the failed copies, ``last_load``
    (:class:`~shardpoint.api.manager_tiers.LoadInfo`) where the last load came from.
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
        group: Any = None,
        backend: Optional[StorageBackend] = None,
        save_options: Optional[Any] = None,
        load_options: Optional[Any] = None,
        memory: Any = None,
        memory_every: int = 1,
        memory_keep: int = 2,
        storage_every: Optional[int] = None,
        copy_attempts: int = 3,
        copy_backoff_s: float = 1.0,
        parallel_copy: bool = False,
        incremental: bool = False,
    ) -> None:
        if incremental and backend is not None:
            from shardpoint_core.transactions.packed import PackedBackend

            if not isinstance(backend, PackedBackend):
                raise errors.InvalidOptionError(
                    f"incremental=True needs the packed layout: pass backend=PackedBackend() "
                    f"(or no backend), not {backend!r}"
                )
        #: every save builds on the newest committed step ([SP-PACK-9]); retention keeps
        #: the steps that kept ones build on ([SP-PACK-11])
        self.incremental = bool(incremental)
        if retention is not None:
            if not isinstance(retention, Retention):
                raise errors.InvalidOptionError(
                    f"retention must be a policy of shardpoint_core.format.policy (LatestN, "
                    f"EveryNSteps, BestN, AnyOf), got {retention!r}"
                )
            if (max_to_keep, keep_every, keep_best) != (None, None, None):
                raise errors.InvalidOptionError(
                    "pass retention= or max_to_keep/keep_every/keep_best, not both (combine "
                    "them with AnyOf(LatestN(n), EveryNSteps(k), BestN(b, metric)))"
                )
        self.retention = retention or policy_from_options(
            max_to_keep, keep_every, best_metric, best_mode, keep_best
        )
        if best_metric is not None:
            check_metric(best_metric, best_mode)
        self._steps = StepRoot(root, backend=backend)  # local directory or s3://, gs://
        self.root = self._steps.root
        self.max_to_keep, self.keep_every, self.keep_best = max_to_keep, keep_every, keep_best
        self.best_metric, self.best_mode = best_metric, best_mode
        if async_save and not hasattr(api, "AsyncSave"):
            raise errors.InvalidOptionError(
                "async_save=True needs a shardpoint whose save() supports async_save "
                "(sp.AsyncSave); this one saves synchronously only"
            )
        self.async_save, self.group = async_save, group
        #: the tier policy (None: every save goes to storage, as without a memory tier)
        self._tiers: Optional[Tiers] = None
        if memory is not None:
            self._tiers = Tiers(
                memory,
                memory_every,
                memory_keep,
                storage_every,
                copy_attempts=copy_attempts,
                copy_backoff_s=copy_backoff_s,
                parallel_copy=parallel_copy,
                async_save=async_save,
            )
        elif storage_every is not None:
            raise errors.InvalidOptionError(
                "storage_every= needs memory=sp.MemoryTier(...); without a memory tier every "
                "save goes to storage: call save() every N steps"
            )
        #: what the tiers' background work reported (a failed durable copy), every rank
        self.tier_warnings: list = []
        #: where the last :meth:`load` took its state from (:class:`LoadInfo`)
        self.last_load: Optional[LoadInfo] = None
        self.backend, self.save_options, self.load_options = backend, save_options, load_options
        self._comm = Comm(group)
        self._pending: Any = None  # the in-flight async save, if any
        self._metrics: dict = {}  # step -> metrics dict (cache of the manifests)
        self._committer = self._steps.committer
        self.retention_warnings: list = []  # what the last retention could not do
        #: committed checkpoints below the root under names this manager does not write
        #: (``step_7`` saved by hand), as the last retention found them: never counted,
        #: kept or removed; each is logged once
        self.stray: list = []

    # ---------------------------------------------------------------- reading (any rank)
    def path(self, step: int) -> str:
        """The directory (or object-store URL) of ``step`` (it may not exist)."""
        return self._steps.path(step)

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
        memory tier). ``all_steps`` are the storage ones."""
        return self._tiers.memory.steps() if self._tiers is not None else []

    def stray_checkpoints(self) -> list:
        """The committed checkpoints directly below the root under names this manager does
        not write (``step_7`` saved with ``sp.save``, ``final``): they are no steps, and
        retention never counts, keeps or removes them."""
        return self._steps.strays()

    def metrics(self, step: int) -> dict:
        """The metrics saved with ``step`` (empty when none were given), read through the
        manager's own backend (the default one of the root's kind when None)."""
        if step not in self._metrics:
            node = node_at(
                api.read_metadata(self.path(step), backend=self.backend).tree, (METRICS_KEY,)
            )
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

    # ---------------------------------------------------------------- collective
    def save(
        self, step: int, state: Any, *, metrics: Optional[dict] = None, force: bool = False
    ) -> Any:
        """Save ``state`` as ``step`` (collective); then apply retention.

        ``metrics`` (str -> number) are stored in the checkpoint itself. ``force=True``
        replaces an existing checkpoint of the same step (else CheckpointExistsError).
        Returns the ``SaveResult`` (an ``AsyncSave`` handle with ``async_save=True``).
        With ``memory=``: the memory save's ``SaveResult`` (None for a step due to no tier);
        a failed memory save raises here, a failed durable copy never does.
        """
        if self._tiers is not None:
            return self._save_tiered(step, state, metrics, force)
        self.wait()  # the previous save commits (or raises) before this one starts
        path, state = self._agreed(lambda: (self.path(step), self._with_metrics(state, metrics)))
        if self._comm.is_coordinator:
            # No makedirs here: save creates the root inside its collective plan step, so a
            # root it cannot create fails every rank instead of this one while the others wait.
            self._clean_leftovers()
        self._metrics.pop(step, None)
        kw: dict = {
            "group": self.group,
            "overwrite": force,
            "backend": self._save_backend(step),
            "options": self.save_options,
        }
        if self.async_save:
            kw["async_save"] = True
        try:
            result = api.save(state, path, **kw)
        except errors.CheckpointExistsError as e:  # raised on every rank alike
            if not force and self._committer.state(path) == "committed":
                raise errors.CheckpointExistsError(
                    f"step {step} is already saved at {path!r}; pass force=True to replace it",
                    spec_id=e.spec_id,
                ) from e
            # something that is no checkpoint of ours: force=True never replaces it either
            why = str(e).removeprefix(f"[{e.spec_id}] ")
            raise errors.CheckpointExistsError(
                f"step {step} cannot be saved at {path!r}: {why}", spec_id=e.spec_id
            ) from e
        if self.async_save:
            self._pending = result
        else:
            self._after_commit()
        return result

    def _save_backend(self, step: int) -> Any:
        """The backend of the save of ``step``: with ``incremental``, a packed backend that
        records hashes and builds on the newest committed step before ``step`` (none: a full
        save, whose hashes the next one compares against)."""
        if not self.incremental:
            return self.backend
        from shardpoint_core.transactions.packed import step_backend

        return step_backend(self.backend, self._storage_base(step))

    def _storage_base(self, step: int) -> Optional[str]:
        """(``incremental``, coordinator) what a save or durable copy of ``step`` builds on:
        the newest committed step before it (None: none)."""
        earlier = [s for s in self.all_steps() if s < step]
        return self.path(earlier[-1]) if earlier else None

    def _check_committed(self, step: int, path: str) -> None:
        """On the coordinator, CheckpointNotFoundError where ``step`` is not committed, on
        every store alike (what a path holds without a manifest is told apart by the reader
        per store; a step is committed or it is no step)."""
        if self._comm.is_coordinator and self._committer.state(path) != "committed":
            raise errors.CheckpointNotFoundError(
                f"step {step} is not a committed checkpoint under {self.root!r} (nothing "
                f"committed at {path!r}); committed steps: {self.all_steps()}",
                spec_id="SP-COMMIT-3",
            )

    def _agreed(self, check: Any) -> Any:
        """``check()``'s result once every rank's check passed: one rank's bad step or metrics
        fails every rank here (one small all-reduce), instead of that rank alone while the
        others wait in the save's or load's first collective."""
        err: Optional[BaseException] = None
        out = None
        try:
            out = check()
        except errors.ShardpointError as e:
            err = e
        agree(self._comm, err, errors.InvalidOptionError)
        return out

    @staticmethod
    def _with_metrics(state: Any, metrics: Optional[dict]) -> Any:
        """``state`` with ``metrics`` under the reserved key, or the reason it cannot be."""
        if metrics is not None:
            if not isinstance(metrics, dict):
                raise errors.UnsupportedValueError(
                    f"metrics must be a dict of name -> number (e.g. {{'loss': 0.31}}), got a "
                    f"{type(metrics).__name__}"
                )
            if not isinstance(state, dict):
                raise errors.UnsupportedValueError(
                    f"metrics need a dict state (they are stored under its {METRICS_KEY!r} "
                    f"key), got a {type(state).__name__}; wrap it: {{'state': state}}"
                )
            if METRICS_KEY in state:
                raise errors.UnsupportedValueError(
                    f"state key {METRICS_KEY!r} is reserved for the manager's metrics; rename it"
                )
            state = {**state, METRICS_KEY: dict(metrics)}
        return state

    def load(self, step: Optional[int] = None, like: Any = None, **load_options: Any) -> Any:
        """Load ``step`` (default: the latest committed one, as the coordinator sees it).
        Collective; ``load_options`` go to :func:`shardpoint.load` (``strict``, ``report``...).
        The manager's metrics are not part of the returned tree."""
        if self._tiers is not None:
            return self._load_tiered(step, like, load_options)
        self.wait()
        if self._comm.is_coordinator:
            self._clean_leftovers()
        asked = step is not None
        if step is None:
            latest = self.latest_step() if self._comm.is_coordinator else None
            got = self._comm.broadcast_bytes(b"" if latest is None else str(latest).encode())
            if not got:
                raise errors.CheckpointNotFoundError(
                    f"no committed checkpoint under {self.root!r} (nothing to resume from)"
                )
            step = int(got)
        kw = {"backend": self.backend, "options": self.load_options, **load_options}
        path = self._agreed(lambda: self.path(step))  # a bad step: every rank, first
        if asked:
            self._agreed(lambda: self._check_committed(step, path))
        out = api.load(path, like=like, group=self.group, **kw)
        if like is None and isinstance(out, dict):
            out.pop(METRICS_KEY, None)
        self.last_load = LoadInfo(step, "storage", path)
        return out

    def wait(self) -> None:
        """Wait for an in-flight async save, then apply retention. Its error is raised, on
        every rank, unless every rank already had it from the handle's own ``wait()``: a job
        that caught it there goes on, and its next ``save`` runs instead of failing again."""
        if self._tiers is not None:
            self._report(block=True)
        pending, self._pending = self._pending, None
        if pending is None:
            return
        reported = pending.reported
        failed, unseen = False, None
        try:
            pending.wait()
        except Exception as e:  # noqa: BLE001 - shared with every rank just below
            failed, unseen = True, (None if reported else e)
        # Collective, as in ``save``'s own settling: a rank that saw the error and one that
        # did not must both raise, or both go on.
        agree(self._comm, unseen, errors.SaveFailedError)
        if not failed:
            self._after_commit()

    # ---------------------------------------------------------------- tiers (collective)
    def _save_tiered(self, step: int, state: Any, metrics: Optional[dict], force: bool) -> Any:
        """``save`` with a memory tier: into memory when due (every rank, synchronously:
        a copy into host memory and to the peers); when due to storage, the coordinator
        starts the durable copy of that memory step in the background (after the previous
        copy finished: one copy at a time). Then the finished copy is reported, storage
        retention applied, and old memory steps removed. A memory step of the same number
        is replaced (memory is the manager's scratch: a resumed job saves its steps again;
        with ``incremental``, later memory steps built on it go first, see
        :mod:`shardpoint_core.transactions.tier_rollback`);
        ``force`` applies to storage."""
        tiers = self._tiers
        assert tiers is not None
        path, state = self._agreed(lambda: (self.path(step), self._with_metrics(state, metrics)))
        to_memory, to_storage = tiers.due(step)
        result = None
        if to_memory:
            if self.incremental:  # a rolled-back run: its later memory steps built on ``step``
                self._drop_rolled_back(step)
            be = self._memory_backend(step) if self.incremental else self.backend
            result = tiers.memory.save(
                state, step, overwrite=True, options=self.save_options, backend=be
            )
        self._report(block=to_storage, start=(step, path, force) if to_storage else None)
        return result

    def _memory_backend(self, step: int) -> Any:
        """(``incremental`` with ``memory=``) the backend of the memory save of ``step``: it
        builds on the newest committed memory step before it (the coordinator's choice,
        every rank told), so unchanged chunks are neither written nor replicated again."""
        from shardpoint_core.transactions.packed import step_backend

        tiers = self._tiers
        assert tiers is not None
        mine = (tiers.memory_base(step) or "").encode() if self._comm.is_coordinator else None
        base = self._comm.broadcast_bytes(mine).decode()
        return step_backend(self.backend, base or None)

    def _exchange(self) -> Any:
        c = self._comm
        return Exchange(c.rank, c.is_coordinator, c.broadcast_bytes, c.all_gather_bytes)

    def _drop_rolled_back(self, step: int) -> None:
        """Collective: remove the later memory steps that build on memory step ``step``,
        about to be saved again (:mod:`shardpoint_core.transactions.tier_rollback`)."""
        from shardpoint_core.transactions.tier_rollback import drop_rolled_back

        assert self._tiers is not None
        self._tell(
            drop_rolled_back(self._tiers, self._exchange(), step, lambda: self._report(True))
        )

    def _report(self, block: bool, start: Optional[tuple] = None) -> None:
        """Collective: the coordinator collects the finished durable copy (waiting for it
        with ``block``), applies storage retention after a committed one, starts the copy
        ``start`` = (step, path, force) where given, and removes old memory steps; every rank
        then learns what failed (``tier_warnings``, logged), and training goes on."""
        tiers = self._tiers
        assert tiers is not None
        ex = self._exchange()
        base = self._storage_base if self.incremental else None  # what a durable copy builds on
        self._tell(
            tiers.report(ex, block, start, self.backend, self._retain, self._clean_leftovers, base)
        )

    def _tell(self, warnings: list) -> None:
        """What the tiers' upkeep reported, logged and kept in ``tier_warnings``."""
        for w in warnings:
            log.warning("shardpoint: %s", w)
        self.tier_warnings.extend(warnings)

    def _load_tiered(self, step: Optional[int], like: Any, opts: dict) -> Any:
        """``load`` with a memory tier: the newest step across memory and storage (or
        ``step``), each checked before use (crc32c of every piece read); a memory step with
        missing or damaged pieces takes them from the peers, then from that step in storage;
        a step that cannot be had whole gives way to the next older one. ``last_load`` says
        which step came from where and what was passed over."""
        tiers = self._tiers
        assert tiers is not None
        self.wait()
        plan: list = []
        if self._comm.is_coordinator:
            self._clean_leftovers()
            plan = tier_plan(step, tiers.memory.steps(), self.all_steps())
        plan = msgpack.unpackb(
            self._comm.broadcast_bytes(msgpack.packb(plan) if self._comm.is_coordinator else None)
        )
        tree, self.last_load = load_across_tiers(
            plan,
            lambda s, in_sto: tiers.memory.restore(
                like,
                step=s,
                strict=opts.get("strict", True),
                fallback=self.path(s) if in_sto else None,
            ),
            lambda s: api.load(
                self.path(s),
                like=like,
                group=self.group,
                **{"backend": self.backend, "options": self.load_options, **opts},
            ),
            self.path,
            self._comm.all_true,
            (errors.ShardpointError,),
            f"memory ({tiers.memory.url(0).rsplit('/', 1)[0]}) or from storage ({self.root!r})",
            step,
        )
        if like is None and isinstance(tree, dict):
            tree.pop(METRICS_KEY, None)
        return tree

    def close(self) -> None:
        """Wait for the last save (with ``memory=``, the last durable copy: every rank keeps
        serving its host's memory until then); the manager may still be used for reading
        afterwards."""
        self.wait()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:  # do not mask the original error; still try not to leave a save behind
            try:
                self.close()
            except Exception:  # noqa: BLE001 - the original exception wins
                pass

    # ---------------------------------------------------------------- coordinator only
    def _after_commit(self) -> None:
        if self._comm.is_coordinator:
            self._retain()

    def retained(self, steps: list) -> set:
        """Which of the committed ``steps`` retention keeps (pure; the rule in one place:
        :func:`shardpoint_core.format.policy.retained`)."""
        return retained(self.retention, steps, self.metrics)

    def _retain(self) -> None:
        """Retention through the committer (on files locked, hidden by one atomic rename, then
        deleted; on object stores the marker first, then its objects). Its problems are
        warnings (``retention_warnings``, logged), never a failure of the save that
        committed."""
        self.retention_warnings = self._steps.retain(self.retention, self.metrics)
        for w in self.retention_warnings:
            log.warning("shardpoint: %s", w)
        self.stray = self._steps.report_strays(self.stray)
        self._metrics = {s: m for s, m in self._metrics.items() if s in self.all_steps()}

    def _clean_leftovers(self) -> None:
        """Remove what crashed saves left; restore a step whose overwrite crashed midway;
        never what a live save holds (:meth:`shardpoint_core.commit.steps.StepRoot.
        clean_leftovers`: the lock rule on files, a minimum age on object stores)."""
        self._steps.clean_leftovers()
