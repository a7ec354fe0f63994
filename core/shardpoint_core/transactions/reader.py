"""The load transaction: the one way a checkpoint is read, on every store.

A :class:`CheckpointReader` reads a committed checkpoint's manifest once, with the identity
of the commit it belongs to ([SP-COMMIT-14]: on an object store from the same GET), opens the
arrays the manifest names, reads regions of them into caller buffers, and at the end checks
that no other save replaced the checkpoint meanwhile, so a load never returns tensors of two
checkpoints. Ranks that receive the manifest's bytes from a coordinator make their reader with
:meth:`CheckpointReader.from_manifest`, without reading it again.

Example::

    r = CheckpointReader.open("s3://bucket/run/step_5")
    out = np.empty((2, 4), np.float32)
    a = r.array("model.w")
    r.wait([r.read_into(a, (0, 0), out)])
    r.check_unchanged()
    r.close()                    # or ``with CheckpointReader.open(...) as r:``
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from shardpoint_core.format.errors import LoadFailedError, ShardpointError
from shardpoint_core.format.manifest import Manifest, decode_manifest
from shardpoint_core.transactions.protocol import StorageBackend
from shardpoint_core.transactions.resolve import manifest_with_identity, resolve


class CheckpointReader:
    """Reads the checkpoint at ``path`` through ``backend``; see the module docstring.
    ``manifest_bytes``/``identity``: what was read (or received) first."""

    def __init__(
        self,
        path: str,
        backend: StorageBackend,
        manifest_bytes: bytes,
        identity: Optional[list[Any]],
    ) -> None:
        self.path, self.backend = path, backend
        self.manifest_bytes, self.identity = manifest_bytes, identity
        self._manifest: Optional[Manifest] = None
        # a load starts with nothing kept from an earlier one, closed or not (the packed
        # data objects are checked again: one may have been replaced by a FIFO since)
        release = getattr(backend, "release", None)  # optional capability
        if release is not None:
            release(path)

    @classmethod
    def open(
        cls, path: Any, *, backend: Optional[StorageBackend] = None, call: str = "load"
    ) -> "CheckpointReader":
        """Read the manifest of ``path`` and the identity of its commit (one request where
        the store can), or raise the documented error (no checkpoint, an unfinished one...)."""
        p, be = resolve(path, backend, call)
        data, ident = manifest_with_identity(be, p)
        return cls(p, be, data, ident)

    @classmethod
    def from_manifest(
        cls,
        path: Any,
        manifest_bytes: bytes,
        identity: Optional[list[Any]],
        *,
        backend: Optional[StorageBackend] = None,
        call: str = "load",
    ) -> "CheckpointReader":
        """A reader of ``path`` whose manifest another rank read and sent."""
        p, be = resolve(path, backend, call)
        return cls(p, be, manifest_bytes, identity)

    @property
    def manifest(self) -> Manifest:
        """The decoded manifest (decoded on first use, every check of the codec applied)."""
        if self._manifest is None:
            self._manifest = decode_manifest(self.manifest_bytes)
        return self._manifest

    def array(self, key: str) -> Any:
        """A handle to read the stored tensor ``key`` (its zarr.json read and checked against
        the manifest entry). Callable from several threads at once."""
        e = self.manifest.tensors[key]
        try:
            return self.backend.open_array_for_read(self.path, e.array, e.spec, key)
        except ShardpointError as err:
            self.check_unchanged(err)
            raise

    def will_open(self, keys: Iterable[str]) -> None:
        """A hint: the arrays of ``keys`` (those this load reads) are opened next. A backend
        that can starts what their opens need, all at once (the packed layout's data-object
        checks on an object store, [SP-PACK-7]); nothing is read or allocated for a
        tensor. Keys the manifest does not name are left to their opens."""
        hint = getattr(self.backend, "will_open", None)  # optional capability
        if hint is not None:
            tensors = self.manifest.tensors
            hint(self.path, [tensors[k].spec for k in dict.fromkeys(keys) if k in tensors])

    def read_into(self, handle: Any, offset: Sequence[int], out: np.ndarray) -> Any:
        """Start reading the region of ``out.shape`` at ``offset`` into ``out``."""
        return self.backend.read_into(handle, offset, out)

    @property
    def can_prefetch(self) -> bool:
        """Whether :meth:`prefetch` does anything here: a reader that would open its arrays
        early only to hint at their chunks skips that where the backend takes no hints."""
        return getattr(self.backend, "prefetch", None) is not None

    def prefetch(self, handle: Any, offset: Sequence[int], shape: Sequence[int]) -> None:
        """A hint: start fetching what a later read of this box needs (where the backend can)."""
        hint = getattr(self.backend, "prefetch", None)  # optional capability
        if hint is not None:
            hint(handle, offset, shape)

    def start_reads(self) -> None:
        """Start the reads begun so far that the backend holds back to plan them together
        (the packed layout's: :class:`~shardpoint_core.arrays.packed_read.ReadBatch`): a
        caller that does other work before it waits calls this first, so the reads run
        meanwhile. ``wait`` starts them too."""
        start = getattr(self.backend, "start_reads", None)  # optional capability
        if start is not None:
            start()

    def wait(self, ops: Sequence[Any]) -> None:
        """Wait for every read; the first error is raised, as the spec's error naming its
        tensor, once every read finished (LoadFailedError where the checkpoint was replaced
        meanwhile: the bytes of a newer save fail the checks of the manifest read first, and
        the replacement, not damage, is what happened)."""
        try:
            self.backend.wait(ops)
        except ShardpointError as err:
            self.check_unchanged(err)
            raise

    def current_identity(self) -> Optional[list[Any]]:
        """The identity of the commit at ``path`` now (None: none there, or the backend
        cannot tell)."""
        ident = getattr(self.backend, "checkpoint_identity", None)  # optional capability
        return ident(self.path) if ident is not None else None

    def unchanged(self) -> bool:
        """True when the checkpoint read is still the one at ``path`` (or the backend cannot
        tell one commit from another)."""
        return self.identity is None or self.current_identity() == self.identity

    def check_unchanged(self, cause: Optional[BaseException] = None) -> None:
        """Raise :class:`LoadFailedError` (from ``cause``, the error a read met, if any) when
        another save replaced or removed the checkpoint since its manifest was read: what was
        read may mix two checkpoints. With a ``cause``, a failure to tell leaves it to
        stand (raises nothing)."""
        if self.identity is None:
            return
        try:
            now = self.current_identity()
        except Exception:  # noqa: BLE001 - the read's own error stands
            if cause is None:
                raise
            return
        if now == self.identity:
            return
        what = "removed" if now is None else "replaced"
        if cause is not None:  # the replacement is why a read failed: say so
            raise LoadFailedError(
                f"the checkpoint at {self.path!r} was {what} by another job while this load "
                f"read it (retention or an overwrite), so its data went missing mid-read "
                f"({cause}); nothing was returned. Load again (a manager's load() picks the "
                "newest step)",
                spec_id="SP-COMMIT-14",
            ) from cause
        raise LoadFailedError(
            f"the checkpoint at {self.path!r} was replaced (or removed) by another save "
            "while it was read, so what was read may mix two checkpoints; nothing was "
            "returned. Read again, and do not save over a checkpoint (overwrite=True, a "
            "manager's force=True or retention) while another job reads it",
            spec_id="SP-COMMIT-14",
        )

    def close(self) -> None:
        """The end of this load: the backend drops what it kept for reads of ``path`` (the
        location its array opens share); the reader may still be used, at that cost."""
        release = getattr(self.backend, "release", None)  # optional capability
        if release is not None:
            release(self.path)

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(
        self, kind: Optional[type], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self.close()
