"""A thin checkpoint manager for training loops: numbered steps, retention, resume.

It is a layer over :func:`shardpoint.save` / :func:`shardpoint.load` and nothing more: one
directory per step (``<root>/step_00000042``), only committed checkpoints count, retention
deletes old steps only after a newer one committed, and stale staging directories left by a
crashed save are cleaned. Collective like ``save``: every rank of the group calls it; only the
coordinator touches directories.

    mgr = CheckpointManager("/ckpt", keep_last=3)
    start = mgr.latest_step() or 0
    if start:
        mgr.load(start, like=state)
    for step in range(start + 1, steps + 1):
        ...
        if step % 100 == 0:
            mgr.save(step, state)
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Any, Optional

from . import api
from .exchange import Comm
from .storage import StorageBackend, get_backend

_STEP = re.compile(r"step_(\d+)\Z")
_STALE = re.compile(r"\.step_\d+\.shardpoint-(tmp|old)-[0-9a-f]+\Z")


class CheckpointManager:
    """Numbered checkpoints under ``root``; keeps the ``keep_last`` newest and, if given,
    every step divisible by ``keep_every`` (e.g. for evaluation)."""

    def __init__(self, root: str, *, keep_last: Optional[int] = 3,
                 keep_every: Optional[int] = None, group: Any = None,
                 backend: Optional[StorageBackend] = None) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be >= 1 (or None to keep everything)")
        self.root = str(root)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.group, self.backend = group, get_backend(backend)

    def path(self, step: int) -> str:
        return os.path.join(self.root, f"step_{step:08d}")

    def steps(self) -> list:
        """Committed steps, oldest first (directories without a manifest are ignored)."""
        if not os.path.isdir(self.root):
            return []
        out = []
        for name in os.listdir(self.root):
            m = _STEP.match(name)
            if m and self.backend.checkpoint_state(os.path.join(self.root, name)) == "committed":
                out.append(int(m.group(1)))
        return sorted(out)

    def latest_step(self) -> Optional[int]:
        s = self.steps()
        return s[-1] if s else None

    def save(self, step: int, state: Any, **kwargs: Any) -> api.SaveResult:
        """Save ``state`` as ``step`` (collective), then apply retention."""
        comm = Comm(self.group)
        if comm.is_coordinator:
            os.makedirs(self.root, exist_ok=True)
            self._clean_stale()
        result = api.save(state, self.path(step), group=self.group, backend=self.backend,
                          **kwargs)
        if comm.is_coordinator:
            self._retain()
        return result

    def load(self, step: Optional[int] = None, like: Any = None, **kwargs: Any) -> Any:
        """Load ``step`` (default: the latest committed one). Collective."""
        if step is None:
            step = self.latest_step()
            if step is None:
                from .errors import CheckpointNotFoundError
                raise CheckpointNotFoundError(f"no committed checkpoint under {self.root!r}")
        return api.load(self.path(step), like=like, group=self.group, backend=self.backend,
                        **kwargs)

    def _retain(self) -> None:
        steps = self.steps()
        keep = set(steps[-self.keep_last:]) if self.keep_last else set(steps)
        if self.keep_every:
            keep |= {s for s in steps if s % self.keep_every == 0}
        for s in steps:
            if s not in keep:
                shutil.rmtree(self.path(s), ignore_errors=True)

    def _clean_stale(self) -> None:
        for name in os.listdir(self.root):
            if _STALE.match(name):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
