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
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from shardpoint_core.format import errors
from shardpoint_core.transactions.copy import copy_checkpoint

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
class LoadInfo:
    """Where a manager's ``load`` took the state from: the ``step``; the ``tier``
    (``"memory"``, ``"storage"``, or ``"memory+storage"`` where memory lacked some tensors);
    the checkpoint's ``url`` (the memory one where any tensor came from memory); for every
    tensor key its source; ``reason``: why anything came from storage; ``skipped``: the newer
    steps passed over, each with why (missing or damaged pieces, a failed load)."""

    step: int
    tier: str
    url: str
    sources: Dict[str, str] = field(default_factory=dict)
    reason: str = ""
    skipped: List[str] = field(default_factory=list)


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
        tier_class: str = "shardpoint.MemoryTier",
    ) -> None:
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
        self._thread: Optional[threading.Thread] = None
        self._step: Optional[int] = None
        self._outcome: Optional[CopyOutcome] = None
        self._closing = threading.Event()  # set: no more tries (the manager is closing)
        #: called (from the copy's thread) after each failed try, with (step, try, error)
        self.on_failure: Optional[Callable[[int, int, str], None]] = None

    def due(self, step: int) -> Tuple[bool, bool]:
        """(to memory, to storage) for ``step``; a step due to storage goes to memory too
        (the durable copy is made from it)."""
        sto = step % self.storage_every == 0
        return sto or step % self.memory_every == 0, sto

    @property
    def copying(self) -> Optional[int]:
        """The step whose durable copy is in flight (coordinator), or None."""
        return self._step if self._thread is not None else None

    def start_copy(self, step: int, dst: str, backend: Any, overwrite: Any) -> None:
        """Coordinator: copy memory step ``step`` to ``dst`` in a background thread, tried
        again after a failure that may pass (see the module)."""
        src = self.memory.url(step)
        outcome = CopyOutcome(step, dst)

        def run() -> None:
            delay = self.copy_backoff_s
            for attempt in range(1, self.copy_attempts + 1):
                try:
                    copy_checkpoint(src, dst, backend=backend, overwrite=overwrite)
                    outcome.error = ""
                    break
                except Exception as e:  # noqa: BLE001 - reported at the next save or wait
                    outcome.error = f"{type(e).__name__}: {e}"
                    outcome.failures.append(outcome.error)
                    hook = self.on_failure
                    if hook is not None:
                        hook(step, attempt, outcome.error)
                    if isinstance(e, PERMANENT) or attempt == self.copy_attempts:
                        break
                    if self._closing.wait(delay):
                        break  # closing: no more tries
                    delay = min(MAX_BACKOFF_S, max(delay * 2, 0.01))
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
    ) -> List[str]:
        """Coordinator, at a manager's ``save`` or ``wait``: collect the finished copy
        (waiting for it with ``block``), apply storage retention (``retain``) after a
        committed one, start the copy ``start`` = (step, dst, overwrite) where given (after
        ``clean``, the storage clean-up, where no copy runs), and remove old memory steps.
        Returns the warnings every rank is to hear; never raises a store's error."""
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
                self.start_copy(s, dst, backend, overwrite)
            self.evict()
        except Exception as e:  # noqa: BLE001 - reported like a failed copy; training goes on
            said.append(f"tier upkeep failed ({type(e).__name__}: {e})")
        return said

    def close(self) -> None:
        """Stop retrying (the copy in flight ends after its current try); ``settle`` then
        reports it."""
        self._closing.set()

    def evict(self) -> List[int]:
        """Coordinator: remove all but the newest ``memory_keep`` memory steps (never the one
        being copied); the steps removed."""
        steps = self.memory.steps()
        gone = [s for s in steps[: -self.memory_keep] if s != self.copying]
        for s in gone:
            self.memory.remove(s)
        return gone


def tier_plan(step: Optional[int], memory: List[int], storage: List[int]) -> List[List[Any]]:
    """What a tiered ``load`` tries, in order: ``[step, in memory, in storage]`` for ``step``
    where given, else for every step either tier holds, newest first."""
    mem, sto = set(memory), set(storage)
    cands = [step] if step is not None else sorted(mem | sto, reverse=True)
    return [[s, s in mem, s in sto] for s in cands if s in mem or s in sto]


__all__ = ["CopyOutcome", "LoadInfo", "PERMANENT", "Tiers", "tier_plan"]
