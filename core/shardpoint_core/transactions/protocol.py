"""The storage seam: what save and load need from a place that holds checkpoints.

The planner decides *what* goes where; a backend decides *how* bytes reach storage. Backends
see numpy arrays and plain paths only (never torch, never a process group), so another
framework can reuse them. The default backend is TensorStore on Zarr v3
(:mod:`shardpoint_core.arrays`).

Call order during ``save`` (C = coordinator rank only, W = every rank that writes chunks):
  C ``staging_path`` -> C ``begin_save`` -> W ``open_array_for_write`` + ``write`` (+ ``wait``)
  -> W ``flush`` (what this rank wrote is durable) -> barrier -> C ``write_manifest`` -> C
  ``commit`` (or C ``abort`` if any rank failed).
During ``load`` (R = every rank that reads): C or R ``read_manifest`` -> R
``open_array_for_read`` + ``read_into`` (+ ``wait``). Optional: ``checkpoint_identity(path)``
(C before ``read_manifest``, R after its last read), a value that changes whenever another
commit replaces ``path``; where a backend has it, a load that overlapped such a replacement
fails instead of returning tensors of two checkpoints. Optional too:
``read_manifest_with_identity(path) -> (bytes, identity)`` (C, in place of both first calls),
the identity of the commit whose manifest was read (on object stores from the same GET).
And ``release(root)`` (R, at the end of a load: ``CheckpointReader.close``): drop what the
backend kept for reads below ``root``, such as the store and key its array opens share.
And ``will_open(root, specs)`` (R, before it opens the arrays it reads: a hint, nothing read
or allocated for a tensor): start what those opens need, all at once (the packed layout's
data-object checks on an object store, [SP-PACK-7]).

Example::

    b = get_backend()
    tmp = b.staging_path("/ckpt/step_10", token="a1b2")
    b.begin_save(tmp)
    h = b.open_array_for_write(tmp, "tensors/w", ArraySpec((4, 4), "float32", (2, 4)))
    b.wait([b.write(h, (0, 0), np.ones((2, 4), np.float32))]); b.flush(tmp)
    b.write_manifest(tmp, manifest_bytes); b.commit(tmp, "/ckpt/step_10", overwrite=False)
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, Union, runtime_checkable

import numpy as np

from shardpoint_core.commit.base import Overwrite
from shardpoint_core.format.manifest import Manifest
from shardpoint_core.format.spec import ArraySpec


@runtime_checkable
class StorageBackend(Protocol):
    """A checkpoint store. Methods raise :mod:`shardpoint_core.format.errors` types, never raw I/O errors."""

    name: str

    def supports_concurrent_writers(self) -> bool:
        """True when several processes may write different chunks of one array at once."""

    def checkpoint_state(self, path: str) -> str:
        """'missing', 'incomplete' (exists without manifest) or 'committed'. Any rank."""

    def check_target(self, path: str, overwrite: Overwrite) -> None:
        """Raise :class:`~.errors.CheckpointExistsError` where a commit to ``path`` would be
        refused (a checkpoint there without ``overwrite``; anything but an empty directory,
        which is not ours to replace). Coordinator, before any write, and again at commit."""

    def staging_path(self, path: str, token: str) -> str:
        """Where a save of ``path`` writes before it commits (hidden, unique per ``token``)."""

    def begin_save(self, staging: str) -> None:
        """Create the staging location. Coordinator only, before any rank writes."""

    def open_array_for_write(self, root: str, array_path: str, spec: ArraySpec) -> Any:
        """Create (or open, if another writer did) the Zarr v3 array. Writer ranks."""

    def write(self, handle: Any, offset: Sequence[int], data: np.ndarray) -> Any:
        """Start writing ``data`` at ``offset``; returns an op for :meth:`wait`. ``data`` must
        stay unchanged until then (it may be written without a copy)."""

    def open_array_for_read(self, root: str, array_path: str, spec: ArraySpec, key: str) -> Any:
        """Open a stored array, checking its zarr.json against ``spec``. Reader ranks; called
        from several threads at once (a load opens its arrays ahead of its reads)."""

    def read_into(self, handle: Any, offset: Sequence[int], out: np.ndarray) -> Any:
        """Start reading the region of ``out.shape`` at ``offset`` into ``out``."""

    def wait(self, ops: Sequence[Any]) -> None:
        """Wait for ops; raises CorruptCheckpointError on checksum or missing-data failures."""

    def flush(self, root: str) -> None:
        """Make every file this process wrote under ``root`` durable (data and directory
        entries). Writer ranks, after ``wait`` and before reporting success: the manifest
        follows only once every rank has flushed ([SP-COMMIT-1])."""

    def write_manifest(self, root: str, data: Union[bytes, Manifest]) -> None:
        """Write the manifest (a :class:`Manifest`, encoded here, once; or a writer's own
        bytes), durably. Coordinator only, after every rank finished."""

    def read_manifest(self, path: str) -> bytes:
        """The manifest bytes of a committed checkpoint, or the documented error."""

    def commit(self, staging: str, path: str, *, overwrite: Overwrite) -> None:
        """Make the staged checkpoint visible at ``path`` atomically. Coordinator only."""

    def abort(self, staging: str) -> None:
        """Remove what a failed save staged. Coordinator only; never touches ``path``."""

    def verify_array(self, root: str, array_path: str, spec: ArraySpec, key: str) -> list[Any]:
        """Read every chunk; return a list of (spec_id, message) problems (empty if fine)."""

    def list_leftovers(self, directory: str) -> list[Any]:
        """The :class:`Leftover` staging/old directories of saves directly in ``directory``."""

    def restore_leftover(self, leftover: str, path: str) -> bool:
        """Move a leftover back to ``path``; fails (CheckpointExistsError) if ``path`` exists;
        False, touching nothing, where a live save holds it."""

    def remove_leftover(self, leftover: str) -> bool:
        """Delete a leftover directory and everything in it; False, touching nothing, where
        a live save holds it."""
