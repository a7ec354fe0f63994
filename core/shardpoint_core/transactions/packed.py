"""The packed backend (format 1.4, spec/format.md section 13): a save writes a few data
objects per writer instead of a directory and a file per chunk.

:class:`PackedBackend` implements the :class:`~.protocol.StorageBackend` protocol by
delegation to a :class:`~.backend.ZarrBackend`: targets, staging, commit, recovery and
every read are the Zarr backend's (which reads both layouts, telling them apart by the
manifest: a tensor entry with a packed index part is read through it). What differs is
writing: each process appends the encoded chunks it writes to its own data objects
(:class:`~shardpoint_core.arrays.packed.PackedWriter`), ``flush`` makes them durable and
writes the process's index part, and the coordinator's ``write_manifest`` gathers the parts
into the manifest's ``packed`` field (``format_version`` ``[1, 4]``), deletes them, and
writes the manifest as the Zarr backend would (on files durably before the rename; on
object stores as the marker, whose commit puts the save prefix in front of every object
path, [SP-COMMIT-11]).

Example::

    sp.save(state, "/ckpt/step_10", backend=PackedBackend())
    sp.load("/ckpt/step_10")                # any backend reads it
"""
from __future__ import annotations

import threading
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from shardpoint_core.arrays.array import ArrayLayout, write_region
from shardpoint_core.arrays.direct_write import WritePool
from shardpoint_core.arrays.identity import CrcSink, chunk_number, units_per_chunk
from shardpoint_core.arrays.packed import ChunkWriteView, PackedWriter, build_index, gather_parts
from shardpoint_core.commit.base import Overwrite
from shardpoint_core.format.errors import SaveFailedError
from shardpoint_core.format.manifest import decode_manifest, encode_manifest
from shardpoint_core.format.packed import FORMAT_VERSION_1_4
from shardpoint_core.format.spec import ArraySpec
from shardpoint_core.stores.registry import is_local
from shardpoint_core.transactions.backend import ZarrBackend


class _Handle:
    """An array being written: its chunk view, layout and chunk-table sink; ``partial``
    serializes writes of parts of a chunk (each reads, changes and rewrites the chunk)."""

    __slots__ = ("view", "name", "layout", "sink", "partial")

    def __init__(self, view: ChunkWriteView, name: str, layout: ArrayLayout, sink: Any) -> None:
        self.view, self.name, self.layout, self.sink = view, name, layout, sink
        self.partial = threading.Lock()

    def write(self, offset: Tuple[int, ...], data: np.ndarray) -> None:
        whole = all(o % c == 0 and (s % c == 0 or o + s == n) for o, s, c, n in
                    zip(offset, data.shape, self.layout.chunk, self.layout.shape))
        if whole:
            write_region(self.view, self.name, self.layout, offset, data,
                         self.name, self.sink)
            return
        with self.partial:
            write_region(self.view, self.name, self.layout, offset, data,
                         self.name, self.sink)


class PackedBackend:
    """Saves in the packed layout; reads and commits as ``zarr`` (a :class:`ZarrBackend`,
    by default one with the same ``fsync``). ``cap``: bytes after which a writer starts a
    new data object (default: 1 TiB on files, 256 MiB on object stores);
    ``write_threads``: chunks encoded and written at once per process. ``writer_id``: the
    name of this process's objects (``packed/<writer_id>-<n>.bin``; default random), fixed
    only for reproducible one-process saves (the golden vectors): two processes of one save
    must not share it."""

    name = "packed"

    def __init__(self, zarr: Optional[ZarrBackend] = None, *, cap: Optional[int] = None,
                 fsync: bool = True, write_threads: int = 16,
                 writer_id: Optional[str] = None) -> None:
        self.zarr = zarr if zarr is not None else ZarrBackend(fsync=fsync)
        self.cap, self.fsync = cap, fsync if zarr is None else zarr.fsync
        self.writer_id = writer_id
        self._lock = threading.Lock()
        self._writers: Dict[str, PackedWriter] = {}
        self._crcs: Dict[str, CrcSink] = {}
        self._staged: Dict[str, bytes] = {}
        self._pool = WritePool(write_threads, "sp-packed")
        self._puts = WritePool(4, "sp-packed-put")

    def __repr__(self) -> str:
        return f"PackedBackend(zarr={self.zarr!r})"

    def supports_concurrent_writers(self) -> bool:
        return True            # each process writes objects of its own

    # -- targets and staging: the Zarr backend's ----------------------------------------
    def checkpoint_state(self, path: str) -> str:
        return self.zarr.checkpoint_state(path)

    def check_target(self, path: str, overwrite: Overwrite) -> None:
        self.zarr.check_target(path, overwrite)

    def staging_path(self, path: str, token: str) -> str:
        return self.zarr.staging_path(path, token)

    def begin_save(self, staging: str) -> None:
        self.zarr.begin_save(staging)

    # -- writing --------------------------------------------------------------------------
    def _writer(self, root: str) -> PackedWriter:
        with self._lock:
            w = self._writers.get(root)
            if w is None:
                store, prefix = self.zarr.locate(root)
                w = self._writers[root] = PackedWriter(store, prefix, cap=self.cap,
                                                       fsync=self.fsync,
                                                       submit=self._puts.submit,
                                                       writer_id=self.writer_id)
            return w

    def open_array_for_write(self, root: str, array_path: str, spec: ArraySpec) -> Any:
        """A handle whose writes append whole encoded chunks to this process's objects."""
        lay = ArrayLayout.create(spec.shape, spec.dtype, spec.chunk_shape,
                                 shard_above_bytes=self.zarr.shard_above_bytes,
                                 inner_chunk_bytes=self.zarr.inner_chunk_bytes)
        view = ChunkWriteView(self._writer(root), array_path, lay)
        with self._lock:
            sink = self._crcs.setdefault(root, CrcSink())
        units = units_per_chunk(lay.chunk, lay.inner)

        def slots(cidx: Sequence[int]) -> bytearray:
            return sink.chunk(array_path, chunk_number(cidx, lay.shape, lay.chunk), units)
        return _Handle(view, array_path, lay, slots)

    def write(self, handle: Any, offset: Sequence[int], data: np.ndarray) -> Any:
        return self._pool.submit(handle.write, tuple(int(o) for o in offset), data)

    def take_chunk_crc32c(self, root: str) -> dict[str, Any]:
        """The crc32c of the units this process wrote (the manifest's chunk tables)."""
        with self._lock:
            sink = self._crcs.pop(root, None)
        return sink.take() if sink is not None else {}

    def wait(self, ops: Sequence[Any]) -> None:
        self.zarr.wait(ops)

    def flush(self, root: str) -> None:
        """This process's objects whole and durable, then its index part ([SP-PACK-8])."""
        with self._lock:
            w = self._writers.pop(root, None)
        if w is None:
            return
        try:
            w.finish()
        except OSError as e:
            raise SaveFailedError(f"cannot make the data objects under {root} durable: "
                                  f"{e}") from e

    def write_manifest(self, root: str, data: bytes) -> None:
        """Every writer's index part gathered into the manifest's ``packed`` field
        (checked as readers check it), the parts deleted, then the manifest written: on
        files durably (the rename follows), on object stores kept for :meth:`commit`."""
        store, prefix = self.zarr.locate(root)
        objects, rows, inner, parts = gather_parts(store, prefix)
        m = decode_manifest(data)
        arrays: Dict[str, Any] = {}
        for e in m.tensors.values():
            got = inner.get(e.array)
            if got is None and e.array not in inner:      # no chunk: the writer's choice
                got = ArrayLayout.create(e.shape, e.dtype, e.chunk_shape,
                                         shard_above_bytes=self.zarr.shard_above_bytes,
                                         inner_chunk_bytes=self.zarr.inner_chunk_bytes).inner
            arrays[e.array] = None if got is None else tuple(got)
        m.packed = build_index(objects, rows, arrays)
        m.format_version = FORMAT_VERSION_1_4
        new = encode_manifest(m)
        if parts:
            store.delete(parts)
        if is_local(root):
            self.zarr.committer.posix.write_manifest(root, new)
            return
        with self._lock:
            self._staged[root] = new

    def commit(self, staging: str, path: str, *, overwrite: Overwrite) -> None:
        with self._lock:
            data = self._staged.pop(staging, None)
        if data is None or is_local(path):
            self.zarr.committer.publish(staging, path, overwrite=overwrite)
        else:
            self.zarr.committer.urls.publish(staging, path, overwrite=overwrite, manifest=data)

    def abort(self, staging: str) -> None:
        with self._lock:
            w = self._writers.pop(staging, None)
            self._staged.pop(staging, None)
            self._crcs.pop(staging, None)
        if w is not None:
            w.abandon()
        self.zarr.abort(staging)

    # -- reading and recovery: the Zarr backend's (it reads both layouts) ---------------
    def read_manifest(self, path: str) -> bytes:
        return self.zarr.read_manifest(path)

    def read_manifest_with_identity(self, path: str) -> Tuple[bytes, Optional[list[Any]]]:
        return self.zarr.read_manifest_with_identity(path)

    def checkpoint_identity(self, path: str) -> Optional[list[Any]]:
        return self.zarr.checkpoint_identity(path)

    def open_array_for_read(self, root: str, array_path: str, spec: ArraySpec,
                            key: str) -> Any:
        return self.zarr.open_array_for_read(root, array_path, spec, key)

    def read_into(self, handle: Any, offset: Sequence[int], out: np.ndarray) -> Any:
        return self.zarr.read_into(handle, offset, out)

    def prefetch(self, handle: Any, offset: Sequence[int], shape: Sequence[int]) -> None:
        self.zarr.prefetch(handle, offset, shape)

    def verify_array(self, root: str, array_path: str, spec: ArraySpec, key: str) -> list[Any]:
        return self.zarr.verify_array(root, array_path, spec, key)

    def list_leftovers(self, directory: str) -> list[Any]:
        return self.zarr.list_leftovers(directory)

    def restore_leftover(self, leftover: str, path: str) -> bool:
        return self.zarr.restore_leftover(leftover, path)

    def remove_leftover(self, leftover: str) -> bool:
        return self.zarr.remove_leftover(leftover)

    @property
    def committer(self) -> Any:
        """The Zarr backend's committer (recovery and managers look it up on a backend)."""
        return self.zarr.committer


from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:
    from shardpoint_core.transactions.protocol import StorageBackend

    def _is_storagebackend_packedbackend(x: PackedBackend) -> StorageBackend:
        return x
