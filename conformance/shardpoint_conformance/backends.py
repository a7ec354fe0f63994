"""The storage backends the fault cases save through: :class:`KillingBackend` (a rank
SIGKILLs itself at a named point of the save, set by ``SHARDPOINT_CONFORMANCE_KILL``) and
:class:`FailingWrites` (a full disk on one rank). Separate from the cases
(:mod:`.faults`) so that the runner, which saves through them, imports no case."""

from __future__ import annotations

import os
import shutil
import signal
from typing import Any, Optional

KILL_ENV = "SHARDPOINT_CONFORMANCE_KILL"
KILL_POINTS = ("write", "before-manifest", "after-manifest", "mid-commit", "after-commit")


class FailingWrites:
    """The real storage backend, except that ``write`` raises ``OSError(ENOSPC)`` in the
    process of rank ``rank`` (a full disk: a real exception in a real process)."""

    def __init__(self, rank: int) -> None:
        from shardpoint_core.transactions.resolve import get_backend

        self.inner, self.rank = get_backend(), rank

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def write(self, handle: Any, offset: Any, data: Any) -> Any:
        import torch.distributed as dist

        if dist.get_rank() == self.rank:
            raise OSError(28, "No space left on device (simulated on this rank)")
        return self.inner.write(handle, offset, data)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillingBackend:
    """A storage backend that kills its own process at a chosen point (see module doc)."""

    def __init__(self, inner: Any = None, spec: Optional[str] = None) -> None:
        from shardpoint_core.transactions.resolve import get_backend

        self.inner = get_backend(inner)
        self.name = self.inner.name
        spec = spec if spec is not None else os.environ.get(KILL_ENV, "")
        parts = spec.split(":") if spec else []
        self.rank = int(parts[0]) if parts else -1
        self.point = parts[1] if len(parts) > 1 else ""
        self.n = int(parts[2]) if len(parts) > 2 else 1
        self.writes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _armed(self, point: str) -> bool:
        if self.point != point:
            return False
        import torch.distributed as dist

        r = dist.get_rank() if dist.is_initialized() else 0
        return r == self.rank

    def write(self, handle: Any, offset, data) -> Any:
        op = self.inner.write(handle, offset, data)
        self.writes += 1
        if self._armed("write") and self.writes >= self.n:
            op.result()  # this chunk is on disk; the rank dies with others pending
            _die()
        return op

    def write_manifest(self, root: str, data: bytes) -> None:
        if self._armed("before-manifest"):
            _die()
        self.inner.write_manifest(root, data)
        if self._armed("after-manifest"):
            _die()

    def commit(self, staging: str, path: str, *, overwrite: bool) -> None:
        if self._armed("mid-commit"):
            # Die inside the commit, after it published something: at the second rename of a
            # two-rename overwrite, or at the clean-up after an atomic exchange.
            real_rename, real_rmtree = os.rename, shutil.rmtree
            calls: list[tuple[str, str]] = []

            def rename(a: str, b: str) -> None:
                if calls:
                    _die()
                calls.append((a, b))
                real_rename(a, b)

            def rmtree(*a: Any, **k: Any) -> None:
                _die()

            # stand-ins for this one commit, narrower than the functions they replace
            os.rename, shutil.rmtree = rename, rmtree  # type: ignore[assignment]
            try:
                self.inner.commit(staging, path, overwrite=overwrite)
            finally:
                os.rename, shutil.rmtree = real_rename, real_rmtree
        else:
            self.inner.commit(staging, path, overwrite=overwrite)
        if self._armed("after-commit"):
            _die()
