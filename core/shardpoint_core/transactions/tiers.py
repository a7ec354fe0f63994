"""The tier policy both checkpoint managers share (torch's and JAX's): every ``memory_every``
steps to the memory tier (fast, replicated to peer hosts), every ``storage_every`` steps to
storage, the durable copy written from the memory tier in the background by the coordinator
(:func:`~shardpoint_core.transactions.copy.copy_checkpoint`: the objects, then the manifest
last; no collective in the background, so it never meets the trainer's own collectives).

A durable copy that fails for a reason that may pass (the store unreachable, refusing or
full, a write error) is tried again, ``copy_attempts`` times in all, after ``copy_backoff_s``,
then twice that, and so on (at most a minute between tries). Each try is a transaction of its
own: a failed one leaves nothing visible at the target (what it staged is removed, or left
hidden for the managers' clean-up). A reason that cannot pass (the target taken by something
else, the memory step damaged or gone) ends the tries at once. The copy never stops
training: the manager reports its outcome (the failure, or the tries it took) at its next
``save`` or ``wait``, and a step whose copy failed is left to the next one due to storage.
Memory retention keeps the newest ``memory_keep`` memory steps, and the one being copied; it
removes only memory steps of the manager's tier.

With ``parallel_copy`` every rank writes part of each durable copy: the coordinator begins
the copy (:class:`~shardpoint_core.transactions.copy.CopyTransaction`) and gives each object
to a rank whose host holds it; every rank copies its share in the background
(:func:`~shardpoint_core.transactions.copy.copy_part`, retried as above) and the coordinator
commits once, at the first upkeep after every share is durable, or aborts the whole copy
where a share failed for good. The managers' upkeep is collective (:meth:`Tiers.report`,
through an :class:`Exchange` of the front end's process group); nothing collective runs in
the background. The load side (which step from which tier) is :mod:`.tiers_load`.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import msgpack

from shardpoint_core.commit.references import bases_closure, name_of, parent_of
from shardpoint_core.format import errors
from shardpoint_core.transactions.copy import CopyTransaction, copy_checkpoint, copy_part
from shardpoint_core.transactions.tiers_load import LoadInfo, load_across_tiers, tier_plan

log = logging.getLogger("shardpoint")

#: the failures a retry cannot mend: the target is someone else's, the source is broken
PERMANENT = (
    errors.CheckpointExistsError,
    errors.CheckpointNotFoundError,
    errors.CorruptCheckpointError,
    errors.IncompleteCheckpointError,
    errors.InvalidOptionError,
    errors.UnsupportedStoreError,
)
MAX_BACKOFF_S = 60.0


@dataclass
class CopyOutcome:
    """One finished durable copy: the memory ``step``, its target ``dst``, ``error`` (``""``:
    committed), and the ``failures`` of the tries before the last (each ``Class: message``)."""

    step: int
    dst: str
    error: str = ""
    failures: List[str] = field(default_factory=list)

    @property
    def attempts(self) -> int:
        return len(self.failures) + (1 if not self.error else 0)

    def report(self, src: str) -> Optional[str]:
        """The warning the managers log and list in ``tier_warnings`` (None: a first-try
        success, nothing to say)."""
        if self.error:
            tries = len(self.failures)
            return (
                f"step {self.step}: the durable copy of {src} to {self.dst!r} failed "
                f"({self.error}){f' after {tries} tries' if tries > 1 else ''}; training goes "
                "on, and that step is left to the next one due to storage"
            )
        if self.failures:
            return (
                f"step {self.step}: the durable copy of {src} to {self.dst!r} committed on try "
                f"{len(self.failures) + 1} (first failure: {self.failures[0]})"
            )
        return None


@dataclass
class Exchange:
    """A manager's process group as the collective upkeep needs it: this rank, whether it is
    the coordinator, and two collectives (``broadcast``: the coordinator's bytes to every
    rank, the others pass None; ``all_gather``: every rank's bytes to every rank)."""

    rank: int
    coordinator: bool
    broadcast: Callable[[Optional[bytes]], bytes]
    all_gather: Callable[[bytes], List[bytes]]


def _pack(x: Any) -> bytes:
    return bytes(msgpack.packb(x, use_bin_type=True))


def _unpack(b: bytes) -> Any:
    return msgpack.unpackb(b, raw=False)


def _positive(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise errors.InvalidOptionError(f"{name} must be an int >= 1, got {v!r}")
    return v


class Tiers:
    """The policy and the in-flight durable copy (see the module); the copy's thread runs on
    the coordinator only. ``memory``: the front end's memory tier (``save``, ``restore``,
    ``steps``, ``url``, ``remove``)."""

    def __init__(
        self,
        memory: Any,
        memory_every: int,
        memory_keep: int,
        storage_every: Optional[int],
        *,
        copy_attempts: int = 3,
        copy_backoff_s: float = 1.0,
        parallel_copy: bool = False,
        tier_class: str = "shardpoint.MemoryTier",
        async_save: bool = False,
    ) -> None:
        if async_save:  # the manager's own option, refused alike by both front ends
            raise errors.InvalidOptionError(
                "async_save=True with memory=: the memory save is the fast one, and the "
                "durable copy already runs in the background; drop async_save"
            )
        if not all(hasattr(memory, a) for a in ("save", "restore", "steps", "url", "remove")):
            raise errors.InvalidOptionError(
                f"memory= must be a {tier_class}, got {type(memory).__name__}"
            )
        if storage_every is None:
            raise errors.InvalidOptionError(
                "memory= needs storage_every=N (every N steps the memory step is copied to "
                "storage); without it nothing would ever be durable"
            )
        self.memory = memory
        self.memory_every = _positive("memory_every", memory_every)
        self.memory_keep = _positive("memory_keep", memory_keep)
        self.storage_every = _positive("storage_every", storage_every)
        self.copy_attempts = _positive("copy_attempts", copy_attempts)
        if isinstance(copy_backoff_s, bool) or not (
            isinstance(copy_backoff_s, (int, float)) and 0 <= copy_backoff_s <= MAX_BACKOFF_S
        ):
            raise errors.InvalidOptionError(
                f"copy_backoff_s must be a number of seconds in [0, {MAX_BACKOFF_S:.0f}], "
                f"got {copy_backoff_s!r}"
            )
        self.copy_backoff_s = float(copy_backoff_s)
        if parallel_copy and not hasattr(memory, "local_objects"):
            raise errors.InvalidOptionError(
                f"parallel_copy=True needs a {tier_class} (its local_objects), got "
                f"{type(memory).__name__}"
            )
        self.parallel_copy = bool(parallel_copy)
        self._thread: Optional[threading.Thread] = None
        self._step: Optional[int] = None
        self._outcome: Optional[CopyOutcome] = None
        self._closing = threading.Event()  # set: no more tries (the manager is closing)
        #: called (from the copy's thread) after each failed try, with (step, try, error)
        self.on_failure: Optional[Callable[[int, int, str], None]] = None
        # parallel copies: this rank's part (every rank), the transaction (coordinator)
        self._part: Optional[threading.Thread] = None
        self._part_result: Tuple[str, List[str]] = ("", [])
        self._txn: Optional[CopyTransaction] = None
        self._txn_step: Optional[int] = None
        #: the objects this rank's parallel parts were given, in all (every rank)
        self.part_objects = 0

    def due(self, step: int) -> Tuple[bool, bool]:
        """(to memory, to storage) for ``step``; a step due to storage goes to memory too
        (the durable copy is made from it)."""
        sto = step % self.storage_every == 0
        return sto or step % self.memory_every == 0, sto

    @property
    def copying(self) -> Optional[int]:
        """The step whose durable copy is in flight (coordinator), or None."""
        if self._txn is not None:
            return self._txn_step
        return self._step if self._thread is not None else None

    def _retrying(self, step: int, attempt_once: Callable[[], Any]) -> Tuple[str, List[str]]:
        """Run ``attempt_once`` until it succeeds, fails for good (:data:`PERMANENT`) or has
        had ``copy_attempts`` tries, sleeping the backoff between tries; (the last error, or
        ``""``; the failures of the tries)."""
        failures: List[str] = []
        delay = self.copy_backoff_s
        for attempt in range(1, self.copy_attempts + 1):
            try:
                attempt_once()
                return "", failures
            except Exception as e:  # noqa: BLE001 - reported at the next save or wait
                err = f"{type(e).__name__}: {e}"
                failures.append(err)
                hook = self.on_failure
                if hook is not None:
                    hook(step, attempt, err)
                if isinstance(e, PERMANENT) or attempt == self.copy_attempts:
                    return err, failures
                if self._closing.wait(delay):
                    return err, failures  # closing: no more tries
                delay = min(MAX_BACKOFF_S, max(delay * 2, 0.01))
        return "", failures  # unreachable: copy_attempts >= 1

    def start_copy(
        self, step: int, dst: str, backend: Any, overwrite: Any, base: Optional[str] = None
    ) -> None:
        """Coordinator: copy memory step ``step`` to ``dst`` in a background thread, tried
        again after a failure that may pass (see the module); ``base``: the storage step the
        copy builds on (a manager's ``incremental=True``; a full copy where it is unusable)."""
        src = self.memory.url(step)
        outcome = CopyOutcome(step, dst)

        def run() -> None:
            outcome.error, outcome.failures = self._retrying(
                step,
                lambda: copy_checkpoint(
                    src, dst, backend=backend, overwrite=overwrite, incremental=base
                ),
            )
            self._outcome = outcome

        self._step, self._outcome = step, None
        self._thread = threading.Thread(target=run, name=f"shardpoint-copy-{step}", daemon=True)
        self._thread.start()

    def settle(self, block: bool) -> List[CopyOutcome]:
        """Coordinator: the finished copy's outcome (in a list; empty while it runs and
        ``block`` is False, or where none was started)."""
        t = self._thread
        if t is None or (t.is_alive() and not block):
            return []
        t.join()
        self._thread, self._step = None, None
        out, self._outcome = self._outcome, None
        return [out] if out is not None else []

    def upkeep(
        self,
        block: bool,
        start: Optional[Tuple[int, str, bool]],
        backend: Any,
        retain: Callable[[], None],
        clean: Callable[[], None],
        base: Optional[Callable[[int], Optional[str]]] = None,
    ) -> List[str]:
        """Coordinator, at a manager's ``save`` or ``wait``: collect the finished copy
        (waiting for it with ``block``), apply storage retention (``retain``) after a
        committed one, start the copy ``start`` = (step, dst, overwrite) where given (after
        ``clean``, the storage clean-up, where no copy runs; building on ``base(step)``,
        see :func:`copy_base`), and remove old memory steps. Returns the warnings every rank
        is to hear; never raises a store's error."""
        said: List[str] = []
        try:
            done = self.settle(block)
            if any(not o.error for o in done):
                retain()
            said = [w for o in done for w in [o.report(self.memory.url(o.step))] if w]
            if start is not None:
                if self.copying is None:
                    clean()
                s, dst, overwrite = start
                self.start_copy(s, dst, backend, overwrite, copy_base(base, s))
            self.evict()
        except Exception as e:  # noqa: BLE001 - reported like a failed copy; training goes on
            said.append(f"tier upkeep failed ({type(e).__name__}: {e})")
        return said

    # -- the collective upkeep (every rank) ---------------------------------------------------
    def report(
        self,
        ex: "Exchange",
        block: bool,
        start: Optional[Tuple[int, str, Any]],
        backend: Any,
        retain: Callable[[], None],
        clean: Callable[[], None],
        base: Optional[Callable[[int], Optional[str]]] = None,
    ) -> List[str]:
        """Collective, at a manager's ``save`` or ``wait``: the upkeep (:meth:`upkeep`: the
        finished copy collected, retention, the copy ``start`` begun, old memory steps
        removed), and what every rank is to hear of it. With ``parallel_copy``, every rank
        copies the objects its host holds (see :meth:`_report_parallel`). ``base``
        (coordinator; a manager's ``incremental=True``): the storage step a durable copy of
        a step builds on, the newest committed one before it (:func:`copy_base`)."""
        if self.parallel_copy:
            return self._report_parallel(ex, block, start, backend, retain, clean, base)
        said = self.upkeep(block, start, backend, retain, clean, base) if ex.coordinator else []
        return list(_unpack(ex.broadcast(_pack(said) if ex.coordinator else None)))

    def _report_parallel(
        self,
        ex: "Exchange",
        block: bool,
        start: Optional[Tuple[int, str, Any]],
        backend: Any,
        retain: Callable[[], None],
        clean: Callable[[], None],
        base: Optional[Callable[[int], Optional[str]]] = None,
    ) -> List[str]:
        """Parallel copies: every rank says how its part went (waiting for it with ``block``)
        and, where a copy is to start, which objects of that memory step its host holds (one
        all-gather); the coordinator commits the copy in flight once every part is durable
        (or aborts it where one failed for good), begins the new one and gives each object
        to one rank whose host holds it, the least loaded (one broadcast); every rank then
        starts its part in the background. Only the parts run in the background; the commit
        (the manifest, a few KiB) is written at the first upkeep after the last part."""
        state = self._part_state(block)
        listing = self.memory.local_objects(start[0]) if start is not None else []
        rows = [_unpack(b) for b in ex.all_gather(_pack([state, listing]))]
        said: List[str] = []
        plan: Optional[Dict[str, Any]] = None
        if ex.coordinator:
            try:
                said = self._settle_parts([r[0] for r in rows], retain)
                if start is not None and self._txn is not None:
                    said.append(
                        f"step {start[0]}: not copied to storage (the copy of step "
                        f"{self._txn_step} is still open); the next step due to storage will be"
                    )
                elif start is not None:
                    try:
                        clean()
                        plan = self._begin_parts(
                            start, backend, [r[1] for r in rows], ex.rank, copy_base(base, start[0])
                        )
                    except Exception as e:  # noqa: BLE001 - reported; training goes on
                        err = f"{type(e).__name__}: {e}"
                        w = CopyOutcome(start[0], start[1], err, [err])
                        said.append(w.report(self.memory.url(start[0])) or err)
                self.evict()
            except Exception as e:  # noqa: BLE001 - reported like a failed copy
                said.append(f"tier upkeep failed ({type(e).__name__}: {e})")
        said, plan = _unpack(ex.broadcast(_pack([said, plan]) if ex.coordinator else None))
        if plan is not None:
            self._start_part(plan, plan["parts"][ex.rank], backend)
        return list(said)

    def _part_state(self, block: bool) -> List[Any]:
        """This rank's part: ["none"], ["running"], or ["done", error, failures]."""
        t = self._part
        if t is None:
            return ["none"]
        if t.is_alive() and not block:
            return ["running"]
        t.join()
        self._part = None
        err, failures = self._part_result
        return ["done", err, failures]

    def _settle_parts(self, states: List[List[Any]], retain: Callable[[], None]) -> List[str]:
        """Coordinator: where every part of the copy in flight is done, commit it (or abort
        it where a part failed); the warnings to give."""
        txn, step = self._txn, self._txn_step
        if txn is None or step is None or any(st[0] == "running" for st in states):
            return []
        failures = [
            f"rank {r}: {f}" for r, st in enumerate(states) if st[0] == "done" for f in st[2]
        ]
        errors_ = [f"rank {r}: {st[1]}" for r, st in enumerate(states) if st[0] == "done" and st[1]]
        self._txn, self._txn_step = None, None
        out = CopyOutcome(step, txn.path, "", failures)
        if errors_:
            out.error = errors_[0] + (f" (and {len(errors_) - 1} more)" if len(errors_) > 1 else "")
            txn.abort()
        else:
            try:
                txn.commit()
            except Exception as e:  # noqa: BLE001 - reported; training goes on
                out.error = f"{type(e).__name__}: {e}"
                out.failures.append(out.error)
        if not out.error:
            retain()
        w = out.report(self.memory.url(step))
        return [w] if w else []

    def _begin_parts(
        self,
        start: Tuple[int, str, Any],
        backend: Any,
        listings: List[Any],
        me: int,
        base: Optional[str] = None,
    ) -> Dict[str, Any]:
        """Coordinator: begin the copy of memory step ``start[0]`` (building on ``base``) and
        share its objects out: each to a rank whose host holds it (``listings``: every rank's
        [key, bytes] of that step in its host's memory; a new object of a copy built on a
        base, to a holder of the object its chunks come from), the one with the fewest bytes
        so far; an object no host lists goes to the coordinator (read from wherever it is),
        as do the flat objects of a flattened incremental source (their chunks lie in
        several steps)."""
        step, dst, overwrite = start
        txn = CopyTransaction.begin(
            self.memory.url(step), dst, backend=backend, overwrite=overwrite, incremental=base
        )
        pre = f"{txn.source_root}/" if txn.source_root else ""
        holders: Dict[str, List[int]] = {}
        for r, rows in enumerate(listings):
            for key, _size in rows:
                if key.startswith(pre):
                    holders.setdefault(key[len(pre) :], []).append(r)
        load = [0] * len(listings)
        parts: List[List[str]] = [[] for _ in listings]
        for key in txn.keys:
            r = min(holders.get(txn.origin.get(key, key)) or [me], key=lambda c: (load[c], c))
            parts[r].append(key)
            load[r] += txn.sizes.get(key, 0)
        self._txn, self._txn_step = txn, step
        return {
            "step": step,
            "src": txn.source,
            "dst": txn.path,
            "staging": txn.staging,
            "prefix": txn.source_prefix,
            "parts": parts,
            # sizes (a large object is copied piecewise onto files) and, for a flattened
            # incremental source, the chunks each flat object takes from the bases
            "sizes": {k: txn.sizes[k] for k in txn.keys if k in txn.sizes},
            "flat": {k: [list(p) for p in v] for k, v in txn.flat.items()},
        }

    def _start_part(self, plan: Dict[str, Any], keys: List[str], backend: Any) -> None:
        """Every rank: copy ``keys`` of the plan's memory step into its staging location in a
        background thread, tried again as a whole copy is."""
        step, src, dst, staging = plan["step"], plan["src"], plan["dst"], plan["staging"]

        def run() -> None:
            self._part_result = self._retrying(
                step,
                lambda: copy_part(
                    src,
                    dst,
                    staging,
                    keys,
                    backend=backend,
                    source_prefix=plan["prefix"],
                    sizes=plan.get("sizes"),
                    flat={k: v for k, v in (plan.get("flat") or {}).items() if k in keys},
                ),
            )

        self._part_result = ("", [])
        self.part_objects += len(keys)
        self._part = threading.Thread(target=run, name=f"shardpoint-part-{step}", daemon=True)
        self._part.start()

    def close(self) -> None:
        """Stop retrying (the copy in flight ends after its current try); ``settle`` then
        reports it."""
        self._closing.set()

    def evict(self) -> List[int]:
        """Coordinator: remove all but the newest ``memory_keep`` memory steps (never the one
        being copied, nor a step that one of those builds on: incremental memory steps,
        [SP-PACK-11]); the steps removed, newest first (a referrer before its base)."""
        steps = self.memory.steps()
        kept = set(steps[-self.memory_keep :]) | {self.copying} - {None}
        held = bases_closure(
            parent_of(self.memory.url(0)), [str(name_of(self.memory.url(s))) for s in kept]
        )
        gone = [
            s
            for s in steps[: -self.memory_keep][::-1]
            if s not in kept and name_of(self.memory.url(s)) not in held
        ]
        for s in gone:
            self.memory.remove(s)
        return gone

    def memory_base(self, step: int) -> Optional[str]:
        """Coordinator (a manager's ``incremental=True``): the memory step a memory save of
        ``step`` builds on, the newest committed one before it (None: none, a full save whose
        hashes the next one compares against)."""
        earlier = [s for s in self.memory.steps() if s < step]
        return str(self.memory.url(earlier[-1])) if earlier else None


def copy_base(base: Optional[Callable[[int], Optional[str]]], step: int) -> Optional[str]:
    """Coordinator: the storage step a durable copy of ``step`` builds on, ``base(step)``
    (None: no ``base``, or it failed: a full copy, never a failed one for that)."""
    if base is None:
        return None
    try:
        return base(step)
    except Exception as e:  # noqa: BLE001 - the copy is made whole instead
        log.info("shardpoint: no storage step found to build step %s's copy on (%s)", step, e)
        return None


__all__ = [
    "CopyOutcome",
    "Exchange",
    "LoadInfo",
    "PERMANENT",
    "Tiers",
    "copy_base",
    "load_across_tiers",
    "tier_plan",
]
