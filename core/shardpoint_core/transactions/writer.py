"""The save transaction: the one way a checkpoint is written, on every store.

A :class:`CheckpointWriter` is one process's part in one save. The coordinator
:meth:`~CheckpointWriter.begin`\\ s it (the target is checked, a staging location made), the
other ranks :meth:`~CheckpointWriter.join` it with the staging path the coordinator sent them;
every rank opens the arrays it writes, writes regions, waits, and :meth:`~CheckpointWriter.
flush`\\ es (what it wrote is durable, [SP-COMMIT-1]); once every rank has flushed, the
coordinator :meth:`~CheckpointWriter.commit`\\ s the manifest (the Zarr group metadata, the
manifest, then the rename or the marker: [SP-COMMIT-*]) or :meth:`~CheckpointWriter.abort`\\ s.
Used as a context manager, an exception before the commit aborts (coordinator only: the other
ranks' writes are the coordinator's to remove).

Example (one process)::

    with CheckpointWriter.begin("/ckpt/step_10") as w:
        a = w.open_array("tensors/w", ArraySpec((4, 4), "float32", (2, 4)))
        w.wait([w.write(a, (0, 0), np.ones((2, 4), np.float32)),
                w.write(a, (2, 0), np.zeros((2, 4), np.float32))])
        w.flush()
        w.commit(manifest)
"""

from __future__ import annotations

import secrets
from types import TracebackType
from typing import Any, Optional, Sequence, Union

import numpy as np

from shardpoint_core.commit.base import Overwrite, check_overwrite
from shardpoint_core.format.errors import InvalidOptionError
from shardpoint_core.format.manifest import Manifest
from shardpoint_core.format.spec import ArraySpec
from shardpoint_core.transactions.protocol import StorageBackend
from shardpoint_core.transactions.resolve import resolve


def _announce(be: Any, staging: str, path: str) -> None:
    """Tell a backend that wants it (``save_target``) which target a staging location is
    for: an incremental packed save finds its base beside the target, before any write."""
    hook = getattr(be, "save_target", None)
    if hook is not None:
        hook(staging, path)


class CheckpointWriter:
    """One process's part in one save of the checkpoint at ``path``; see the module docstring.
    ``staging``: where this save writes until it commits (send it to the other ranks)."""

    def __init__(
        self,
        path: str,
        staging: str,
        backend: StorageBackend,
        *,
        overwrite: Overwrite = False,
        coordinator: bool = True,
    ) -> None:
        self.path, self.staging, self.backend = path, staging, backend
        self.overwrite, self.coordinator = overwrite, coordinator
        self.state = "open"  # open -> committed | aborted

    @classmethod
    def begin(
        cls,
        path: Any,
        *,
        backend: Optional[StorageBackend] = None,
        overwrite: Any = False,
        token: Optional[str] = None,
        call: str = "save",
    ) -> "CheckpointWriter":
        """Coordinator: refuse a target the commit would refuse (before anything is written),
        then make the staging location. ``token``: the save's unique name (random when None)."""
        ow = check_overwrite(overwrite)
        p, be = resolve(path, backend, call)
        be.check_target(p, ow)
        staging = be.staging_path(p, token or secrets.token_hex(6))
        _announce(be, staging, p)
        be.begin_save(staging)
        return cls(p, staging, be, overwrite=ow)

    @classmethod
    def join(
        cls,
        path: Any,
        staging: str,
        *,
        backend: Optional[StorageBackend] = None,
        call: str = "save",
    ) -> "CheckpointWriter":
        """Another rank of the save the coordinator began: it writes into ``staging``."""
        p, be = resolve(path, backend, call)
        _announce(be, staging, p)
        return cls(p, staging, be, coordinator=False)

    # -- writing (every rank) -------------------------------------------------------------
    def open_array(self, array_path: str, spec: ArraySpec) -> Any:
        """Create (or open, where another rank did) the array at ``array_path``."""
        return self.backend.open_array_for_write(self.staging, array_path, spec)

    def write(self, handle: Any, offset: Sequence[int], data: np.ndarray) -> Any:
        """Start writing ``data`` at ``offset``; ``data`` stays unchanged until :meth:`wait`."""
        return self.backend.write(handle, offset, data)

    def wait(self, ops: Sequence[Any]) -> None:
        """Wait for every op; the first error is raised (each op finished first)."""
        self.backend.wait(ops)

    def flush(self) -> dict[str, Any]:
        """Make what this process wrote durable; returns the crc32c of the units it wrote
        (array path -> chunk number -> bytes), for the manifest's chunk tables ([SP-MAN-7])."""
        self.backend.flush(self.staging)
        return self.take_chunk_crc32c()

    def take_chunk_crc32c(self) -> dict[str, Any]:
        """The crc32c the backend recorded for this process's writes (empty where it records
        none); taken once, so nothing of the save stays in the backend."""
        take = getattr(self.backend, "take_chunk_crc32c", None)  # optional capability
        got: dict[str, Any] = take(self.staging) if take is not None else {}
        return got

    # -- the end (coordinator) ------------------------------------------------------------
    def commit(self, manifest: Union[Manifest, bytes]) -> None:
        """Every rank flushed: the manifest last, then the checkpoint becomes visible at
        ``path`` at once. Any failure aborts (nothing of this save stays) and is raised."""
        self._coordinator("commit")
        try:
            # a Manifest goes down as it is: the backend encodes it once (on an object store
            # straight into the commit marker's bytes, [SP-COMMIT-11])
            self.backend.write_manifest(self.staging, manifest)
            self.backend.commit(self.staging, self.path, overwrite=self.overwrite)
        except BaseException:
            self.abort()
            raise
        self.state = "committed"

    def abort(self) -> None:
        """Remove what this save staged (never ``path``); idempotent."""
        self._coordinator("abort")
        if self.state == "open":
            self.state = "aborted"
            self.take_chunk_crc32c()
            self.backend.abort(self.staging)

    def _coordinator(self, what: str) -> None:
        if not self.coordinator:
            raise InvalidOptionError(
                f"{what}: only the coordinator of a save, which began it, commits or aborts it"
            )

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(
        self, kind: Optional[type], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        if self.coordinator and self.state == "open":
            self.abort()  # an exception, or a block that never committed
