"""The tier policy of :class:`~shardpoint.api.manager.CheckpointManager`: every ``memory_every``
steps to the memory tier (fast, replicated to peer hosts), every ``storage_every`` steps to
storage, the durable copy written from the memory tier in the background by the coordinator
(:func:`shardpoint_core.transactions.copy.copy_checkpoint`: the objects, then the manifest
last; no collective in the background, so it never meets the trainer's own collectives).

A failed copy never stops training: the manager reports it at its next ``save`` or ``wait``
(on every rank, in ``tier_warnings`` and the ``shardpoint`` log) and that step is left to the
next one due to storage. Memory retention keeps the newest ``memory_keep`` memory steps, and
the one being copied; it removes only memory steps of the manager's tier.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from shardpoint_core.format import errors
from shardpoint_core.transactions.copy import copy_checkpoint


@dataclass
class LoadInfo:
    """Where :meth:`CheckpointManager.load` took the state from: the ``step``; the ``tier``
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


def _positive(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise errors.InvalidOptionError(f"{name} must be an int >= 1, got {v!r}")
    return v


class Tiers:
    """The policy and the in-flight durable copy (see the module); the copy's thread runs on
    the coordinator only."""

    def __init__(
        self, memory: Any, memory_every: int, memory_keep: int, storage_every: Optional[int]
    ) -> None:
        if not all(hasattr(memory, a) for a in ("save", "restore", "steps", "url", "remove")):
            raise errors.InvalidOptionError(
                f"memory= must be a shardpoint.MemoryTier, got {type(memory).__name__}"
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
        self._thread: Optional[threading.Thread] = None
        self._step: Optional[int] = None
        self._outcome: Optional[Tuple[int, str, str]] = None  # step, dst, error ("": ok)

    def due(self, step: int) -> Tuple[bool, bool]:
        """(to memory, to storage) for ``step``; a step due to storage goes to memory too
        (the durable copy is made from it)."""
        sto = step % self.storage_every == 0
        return sto or step % self.memory_every == 0, sto

    @property
    def copying(self) -> Optional[int]:
        """The step whose durable copy is in flight (coordinator), or None."""
        return self._step if self._thread is not None else None

    def start_copy(self, step: int, dst: str, backend: Any, overwrite: bool) -> None:
        """Coordinator: copy memory step ``step`` to ``dst`` in a background thread."""
        src = self.memory.url(step)

        def run() -> None:
            err = ""
            try:
                copy_checkpoint(src, dst, backend=backend, overwrite=overwrite)
            except Exception as e:  # noqa: BLE001 - reported at the next save or wait
                err = f"{type(e).__name__}: {e}"
            self._outcome = (step, dst, err)

        self._step, self._outcome = step, None
        self._thread = threading.Thread(target=run, name=f"shardpoint-copy-{step}", daemon=True)
        self._thread.start()

    def settle(self, block: bool) -> List[Tuple[int, str, str]]:
        """Coordinator: the finished copy's outcome ((step, dst, error) in a list; empty while
        it runs and ``block`` is False, or where none was started)."""
        t = self._thread
        if t is None or (t.is_alive() and not block):
            return []
        t.join()
        self._thread, self._step = None, None
        out, self._outcome = self._outcome, None
        return [out] if out is not None else []

    def evict(self) -> List[int]:
        """Coordinator: remove all but the newest ``memory_keep`` memory steps (never the one
        being copied); the steps removed."""
        steps = self.memory.steps()
        gone = [s for s in steps[: -self.memory_keep] if s != self.copying]
        for s in gone:
            self.memory.remove(s)
        return gone
