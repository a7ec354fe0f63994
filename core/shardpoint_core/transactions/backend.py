"""The storage backend: the Zarr v3 format layer over a byte store, for every kind of store.

A checkpoint path picks its store (:meth:`ZarrBackend.locate`): a local path is a
:class:`~shardpoint_core.stores.files.FileStore` rooted at it, ``s3://bucket/...`` (any
registered scheme) the shared store of its bucket. Arrays are read and written by the Zarr
layer (:mod:`.array`: zarr.json, chunk keys, crc32c, shard indexes, the spec's reader checks)
over that store, and the committer of the path's kind publishes ([SP-COMMIT-*]).
Which writer or reader serves an array is :mod:`.backend_handles`'s, the manifest's
requests are :mod:`.backend_manifest`'s.

What a store can do beyond bytes decides the fast paths, never the format: where keys are
local files (``capabilities.local_path``), whole chunks are written and read by the
vectored ``pwritev``/``preadv`` paths of :mod:`.direct_write`/:mod:`.direct_read` (byte for
byte what the layer writes) and made durable by one ``syncfs`` (the store's
``make_durable_below``); everything else (part of a chunk, a chunk the direct reader could not
prove intact, bool arrays, verification) is the layer's. On object stores, chunk requests run
``concurrency`` at a time, zarr.json PUTs in flight with the chunks, and a load reads only the
chunks and inner-chunk ranges its regions meet, in as few round trips in sequence as the
checks allow: an array's first data request goes beside its zarr.json GET (used only once
zarr.json confirmed the layout it was sent for), a region's other chunks and shard runs all
at once, and the manifest's GET gives the commit identity (no HEAD before it).

TensorStore is a cross-check only (:mod:`~shardpoint_core.arrays.ts_check`:
``direct_reads=False`` / ``direct_writes=False`` on local files, and big-endian hosts), imported
only then; the byte store over TensorStore's kvstores is
:class:`~shardpoint_core.stores.tensorstore.TensorStoreStore` (``tensorstore+file://`` ...).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Dict, Iterable, Optional, Sequence, Tuple, Union

import numpy as np

from shardpoint_core.stores.durable import will_need
from shardpoint_core.commit.posix import PosixCommitter
from shardpoint_core.format.errors import InvalidOptionError, SaveFailedError
from shardpoint_core.format.manifest import Manifest
from shardpoint_core.format.spec import MANIFEST_NAME, ArraySpec
from shardpoint_core.stores.files import FileStore
from shardpoint_core.stores import location
from shardpoint_core.stores.registry import is_local, url_of
from shardpoint_core.arrays import local
from shardpoint_core.arrays.array import ArrayLayout, write_array_meta, write_region
from shardpoint_core.commit.routing import PathCommitter, UrlCommitter
from shardpoint_core.arrays.direct_read import whole_chunk_files
from shardpoint_core.arrays.direct_write import WritePool
from shardpoint_core.arrays.identity import CrcSink, chunk_number, units_per_chunk
from shardpoint_core.format.layout import INNER_CHUNK_BYTES, SHARD_ABOVE_BYTES
from shardpoint_core.arrays.object_read import ObjectArray
from shardpoint_core.arrays.packed_base import based_store
from shardpoint_core.arrays.packed_checks import start_checks
from shardpoint_core.arrays.packed_read import ReadBatch, open_packed
from shardpoint_core.arrays.ts_check import TensorStoreCheck
from shardpoint_core.transactions.backend_handles import (
    _Array,
    _DirectHandle,
    _KeyedRead,
    _WriteHandle,
    array_metas,
    open_local_for_read,
    open_local_for_write,
    start_read,
    verify_array,
    wait_reads,
)
from shardpoint_core.transactions.backend_manifest import (
    MAX_MANIFEST_BYTES,
    read_remote_manifest,
    write_manifest_groups,
)

# ZarrBackend's own names, and those of its handles and their helpers
# (:mod:`.backend_handles`), importable from here as before the split
__all__ = [
    "MAX_MANIFEST_BYTES",
    "ZarrBackend",
    "_Array",
    "_DirectHandle",
    "_KeyedRead",
    "_WriteHandle",
]


class ZarrBackend:
    """The :class:`~shardpoint_core.transactions.protocol.StorageBackend` of this project: Zarr v3 arrays
    over a byte store (local files, ``s3://``, ``memory://``...), see the module docstring.

    Local files: ``write_threads`` threads write whole chunks with ``pwritev`` (each file's
    writeback started as soon as it is written), ``read_threads`` read them with ``preadv``.
    ``flush`` makes what a rank wrote durable before the rank reports success (the manifest
    follows durable chunks, [SP-COMMIT-1]): ``sync_method='auto'`` is one ``syncfs(2)`` where
    Linux has it, else ``'fsync'`` of every file and directory written, from 16 threads
    (``syncfs`` also flushes other dirty data of the file system: on a busy shared one,
    prefer ``'fsync'``); ``fsync=False`` skips syncing (tests, scratch data; not crash-safe).
    ``direct_reads=False`` / ``direct_writes=False``: through TensorStore (``context``: its
    context spec), the cross-check.

    Object stores: ``concurrency`` requests in flight per process; an acknowledged PUT is
    durable, so ``flush`` only waits for zarr.json writes.
    """

    name = "zarr3"
    #: (1.5) writes compressed arrays (``ArraySpec.compression``, [SP-ARRAY-7])
    supports_compression = True

    def __init__(
        self,
        *,
        context: Optional[dict[str, Any]] = None,
        shard_above_bytes: int = SHARD_ABOVE_BYTES,
        inner_chunk_bytes: int = INNER_CHUNK_BYTES,
        fsync: bool = True,
        sync_method: str = "auto",
        read_threads: int = 8,
        direct_reads: bool = True,
        direct_writes: bool = True,
        write_threads: int = 16,
        concurrency: int = 32,
    ) -> None:
        if sync_method not in ("auto", "syncfs", "fsync"):
            raise ValueError(
                f"sync_method must be 'auto', 'syncfs' or 'fsync', not {sync_method!r}"
            )
        if concurrency < 1:
            raise InvalidOptionError("ZarrBackend: concurrency must be >= 1")
        self.shard_above_bytes = shard_above_bytes
        self.inner_chunk_bytes = inner_chunk_bytes
        self.fsync, self.sync_method = fsync, sync_method
        self.read_threads, self.direct_reads, self.direct_writes = (
            read_threads,
            direct_reads,
            direct_writes,
        )
        self.concurrency = concurrency
        self.ts = TensorStoreCheck(context)
        self._lock = threading.Lock()
        self._written: Dict[str, Tuple[FileStore, set[Any]]] = {}  # local root -> arrays written
        self._meta: Dict[str, list[Any]] = {}  # object-store root -> zarr.json PUTs
        self._reads = WritePool(read_threads, "shardpoint-read")
        self._write_pool = WritePool(write_threads, "shardpoint-write")
        self._remote = WritePool(concurrency, "sp-obj")
        # zarr.json reads of object-store arrays: never wait on anything, so a read task on
        # ``_remote`` may wait for one without a deadlock
        self._meta_reads = WritePool(concurrency, "sp-meta")
        # (1.4) the HEADs of packed data objects ([SP-PACK-7]): tasks that wait on nothing,
        # so an open may wait for them from any thread
        self._checks = WritePool(concurrency, "sp-check")
        self._crcs: Dict[str, CrcSink] = {}  # staging -> units' crc32c written ([SP-MAN-7])
        # (1.4) root -> the data objects found sound by this load of it ([SP-PACK-7]: checked
        # once per object and load): dropped at release and when a reader of it opens
        self._packed_ok: Dict[str, Dict[str, Any]] = {}
        self._packed_reads = ReadBatch()  # (1.4) reads gathered until a wait() plans them
        self.committer = PathCommitter(PosixCommitter(fsync=fsync), UrlCommitter(self.locate))
        # root -> its Location, for the array opens of one save or load (a path becomes a
        # store and a key once per root, not once per array); dropped at flush, abort,
        # commit and release, and never more than _LOCATIONS_KEPT (memory stays flat)
        self._locations: Dict[str, location.Location] = {}
        self._loc_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ZarrBackend(context={self.ts.context_spec})"

    @property
    def context(self) -> Any:
        """The ``ts.Context`` of the TensorStore cross-check (made on first use)."""
        return self.ts.context

    def supports_concurrent_writers(self) -> bool:
        return True  # chunks have one writer each, zarr.json is created if absent

    # -- paths and stores -----------------------------------------------------------------
    def locate(self, path: str) -> Tuple[Any, str]:
        """(the byte store holding ``path``, the key of ``path`` below it): a local path is a
        FileStore rooted at it (key ``""``), a URL the shared store of its bucket."""
        return location.locate(path, fsync=self.fsync, sync_method=self.sync_method).pair()

    _LOCATIONS_KEPT = 64

    def _location(self, root: str) -> Tuple[Any, str]:
        """:meth:`locate` of ``root``, made once and kept for the next array opened below it
        (held under a lock: the arrays of a save or load are opened from several threads)."""
        with self._loc_lock:
            loc = self._locations.get(root)
            if loc is None:
                loc = location.locate(root, fsync=self.fsync, sync_method=self.sync_method)
                if len(self._locations) >= self._LOCATIONS_KEPT:  # one never released
                    self._locations.pop(next(iter(self._locations)))
                self._locations[root] = loc
            return loc.pair()

    def _checked(self, root: str) -> Dict[str, Any]:
        """The data objects of ``root`` this load found sound (kept as its location is)."""
        with self._loc_lock:
            got = self._packed_ok.get(root)
            if got is None:
                if len(self._packed_ok) >= self._LOCATIONS_KEPT:  # one never released
                    self._packed_ok.pop(next(iter(self._packed_ok)))
                got = self._packed_ok[root] = {}
            return got

    def release(self, root: str) -> None:
        """Drop what this backend keeps for the arrays opened below ``root`` (its location,
        the data objects found sound): the end of a load (:meth:`CheckpointReader.close`)
        and the start of the next, so each load checks the objects again ([SP-PACK-7]); a
        save's ``flush``, ``abort`` and ``commit`` drop theirs."""
        with self._loc_lock:
            self._locations.pop(root, None)
            self._packed_ok.pop(root, None)

    def _url(self, url: str, key: str) -> str:
        return url_of(url, key)

    # -- save: checkpoint directories are the committer's ---------------------------------
    def checkpoint_state(self, path: str) -> str:
        return self.committer.state(path)

    def check_target(self, path: str, overwrite: Any) -> None:
        self.committer.check_target(path, overwrite)

    def staging_path(self, path: str, token: str) -> str:
        if is_local(path):
            return self.committer.posix.staging_for(path, token)
        return self.committer.urls.begin(path, token)

    def begin_save(self, staging: str) -> None:
        """A staging directory on files; nothing on object stores (a prefix exists once an
        object is below it)."""
        if is_local(staging):
            self.committer.posix.create_staging(staging)

    def _metas(self, spec: ArraySpec) -> Tuple[dict[str, Any], dict[str, Any], list[Any], int]:
        """(zarr.json this backend writes for ``spec`` as TensorStore takes it, the same as
        stored, the codec chain, the itemsize)."""
        return array_metas(spec, self.shard_above_bytes, self.inner_chunk_bytes)

    def _guess(self, spec: ArraySpec) -> Optional[ArrayLayout]:
        """The layout this backend would write for ``spec`` (None where it cannot say)."""
        try:
            return ArrayLayout.from_meta(self._metas(spec)[1])
        except Exception:  # noqa: BLE001 - no guess; zarr.json decides, as always
            return None

    def open_array_for_write(self, root: str, array_path: str, spec: ArraySpec) -> Any:
        """A handle to write whole chunks of a new array. zarr.json is created unless another
        writer of the array did (the same bytes: both derive them from the manifest)."""
        meta, stored, codecs, itemsize = self._metas(spec)
        lay = ArrayLayout.from_meta(stored)
        store, prefix = self._location(root)
        path = f"{prefix}/{array_path}" if prefix else array_path
        sink = self._sink(root, array_path, lay)
        if not store.capabilities.local_path:
            arr = _Array(store, path, lay, array_path, root, sink)
            if 0 in lay.shape:  # no chunk, so no writer of chunk 0: every opener
                self._write_meta(arr)
            return arr
        apath = store.path(path)
        with self._lock:
            self._written.setdefault(store.root, (store, set()))[1].add(path)
        return open_local_for_write(
            root,
            array_path,
            spec,
            path,
            apath,
            (meta, stored, codecs, itemsize),
            lay,
            sink,
            self.ts,
            self.direct_writes,
            self.fsync,
            self._write_pool.submit,
        )

    def _sink(self, root: str, array_path: str, lay: ArrayLayout) -> Any:
        """``cidx -> slots`` recording the crc32c of the units this process writes into the
        array, for the chunk table ([SP-MAN-7]); :meth:`take_chunk_crc32c` hands them over."""
        with self._lock:
            sink = self._crcs.setdefault(root, CrcSink())
        units = units_per_chunk(lay.chunk, lay.inner)
        return lambda cidx: sink.chunk(array_path, chunk_number(cidx, lay.shape, lay.chunk), units)

    def take_chunk_crc32c(self, root: str) -> dict[str, Any]:
        """What this process's writes under ``root`` recorded: array path -> chunk number ->
        its units' crc32c bytes (writes through TensorStore record nothing)."""
        with self._lock:
            sink = self._crcs.pop(root, None)
        return sink.take() if sink is not None else {}

    def write(self, handle: Any, offset: Sequence[int], data: np.ndarray) -> Any:
        if isinstance(handle, _WriteHandle):
            op = handle.writer.write(offset, data)
            if op is not None:
                return op
            return self._write_pool.submit(handle.write_part, tuple(offset), data)
        if isinstance(handle, _Array):
            if handle.root is not None and not any(offset):
                self._write_meta(handle)
            return self._remote.submit(
                write_region,
                handle.store,
                handle.path,
                handle.layout,
                tuple(offset),
                data,
                handle.key,
                handle.sink,
            )
        return self.ts.write(handle, offset, data)

    def _write_meta(self, arr: _Array) -> None:
        """zarr.json of an array on an object store, by the writer of its chunk 0 alone (the
        region at the origin: each chunk has one writer, [SP-COVER]), so N ranks writing
        one array send one PUT, not N. If-None-Match all the same: one writer wins
        [SP-COMMIT-8]. In flight with the chunks (an object store needs no zarr.json before
        a chunk object); ``flush`` waits for it."""
        with self._lock:
            root, arr.root = arr.root, None
            if root is None:
                return
            self._meta.setdefault(root, []).append(
                self._remote.submit(write_array_meta, arr.store, arr.path, arr.layout)
            )

    def flush(self, root: str) -> None:
        """What this process wrote under ``root`` survives a crash once this returns: the
        store's ``make_durable_below`` of the arrays on local files (one ``syncfs``, see the
        class docstring); on object stores the zarr.json writes are waited for (an
        acknowledged PUT is durable, [SP-COMMIT-10])."""
        with self._lock:
            pending = self._meta.pop(root, [])
            written = self._written.pop(os.path.abspath(root), None) if is_local(root) else None
        self.release(root)
        self.wait(pending)
        if written is None:
            return
        store, paths = written
        try:
            store.make_durable_below(paths)
        except OSError as e:
            raise SaveFailedError(f"cannot make the chunks under {root} durable: {e}") from e

    def write_manifest(self, root: str, data: Union[bytes, Manifest]) -> None:
        """The Zarr group metadata of the save ([SP-LAYOUT-5]), then the manifest, handed to
        the committer: on files the groups are durable first and the manifest is written; on
        an object store the group PUTs land first and the committer keeps the manifest for
        :meth:`commit`, which PUTs it as the marker. A :class:`Manifest` is encoded once (on
        object stores straight into the marker's bytes); bytes are a writer's own encoding."""
        store, key = self.locate(root)
        write_manifest_groups(store, key, root, data, self._write_pool.submit, self._remote.submit)
        self.committer.write_manifest(root, data)

    def commit(self, staging: str, path: str, *, overwrite: Any) -> None:
        self.release(staging)
        self.committer.publish(staging, path, overwrite=overwrite)

    def abort(self, staging: str) -> None:
        with self._lock:
            self._crcs.pop(staging, None)
            pending = self._meta.pop(staging, [])
            if is_local(staging):
                self._written.pop(os.path.abspath(staging), None)
        self.release(staging)
        for f in pending:  # let them land, then delete them too
            f.exception()
        self.committer.abort(staging)

    # -- load -----------------------------------------------------------------------------
    def read_manifest(self, path: str) -> bytes:
        if is_local(path):
            return local.read_manifest(path, self.checkpoint_state(path))
        return self._read_remote_manifest(path, False)[0]

    def read_manifest_with_identity(self, path: str) -> Tuple[bytes, Optional[list[Any]]]:
        """(the manifest's bytes, the :meth:`checkpoint_identity` of the commit they belong
        to). On an object store both come from the manifest's one GET (its ETag and size:
        no HEAD before it, and the identity is the one of the bytes read); on files the
        identity is taken first (each commit renames a new manifest file into place)."""
        if is_local(path):
            ident = self.checkpoint_identity(path)
            return self.read_manifest(path), ident
        return self._read_remote_manifest(path, True)

    def _read_remote_manifest(self, path: str, identity: bool) -> Tuple[bytes, Optional[list[Any]]]:
        store, key = self.locate(path)
        return read_remote_manifest(
            store,
            key,
            path,
            identity,
            self.checkpoint_identity,
            lambda p: self.committer.urls.state(p),
        )

    def checkpoint_identity(self, path: str) -> Optional[list[Any]]:
        """Which commit of ``path`` is there now; None when there is none. ``load`` compares
        it before and after its reads ([SP-COMMIT-14]). Files: the manifest's inode, time and
        size (each commit renames a new directory into place); object stores: the
        manifest's ETag (each commit writes it anew)."""
        if is_local(path):
            return local.checkpoint_identity(path)
        store, key = self.locate(path)
        info = store.head(f"{key}/{MANIFEST_NAME}" if key else MANIFEST_NAME)
        return None if info is None else [info.version, info.size]

    def open_array_for_read(self, root: str, array_path: str, spec: ArraySpec, key: str) -> Any:
        """zarr.json read and checked here; on files in one pass over the array's directory
        with the file kinds, size caps, chunk sizes and bytes present ([SP-READ-6]) as well
        (:func:`~shardpoint_core.arrays.opening.open_local_array`). Chunks are read by ``read_into``."""
        store, prefix = self._location(root)
        if spec.packed is not None:  # (1.4) a packed checkpoint: chunks by its index
            checked = self._checked(root)
            if spec.packed.bases:  # incremental: its bases' objects too ([SP-PACK-9])
                store = based_store(store, prefix, root, spec.packed, key, checked)
                # one object after another: the first of a base reads its identity
                return _Array(*open_packed(store, prefix, spec, key, checked), key)
            # on object stores the objects not checked yet (by ``will_open``) at once
            submit = None if store.capabilities.local_path else self._checks.submit
            return _Array(*open_packed(store, prefix, spec, key, checked, submit), key)
        path = f"{prefix}/{array_path}" if prefix else array_path
        if not store.capabilities.local_path:
            return ObjectArray(store, path, spec, key, self._guess(spec))
        return open_local_for_read(
            store, root, array_path, path, spec, key, self.direct_reads, self.ts
        )

    def will_open(self, root: str, specs: Iterable[ArraySpec]) -> None:
        """A hint before the arrays of ``specs`` below ``root`` are opened (a load's, or a
        rank's share of it): on an object store, the [SP-PACK-7] check of every data object
        their packed records name starts now, one HEAD per object not checked yet, all in
        flight together (:func:`~shardpoint_core.arrays.packed_checks.start_checks`); each
        open then waits for its objects' checks instead of sending its own, one open after
        another. Nothing is allocated for a tensor; nothing on files, for arrays of the
        per-array layout or for those built on a base (their opens check as before)."""
        parts = [s.packed for s in specs if s.packed is not None and not s.packed.bases]
        if not parts:
            return
        store, prefix = self._location(root)
        if not store.capabilities.local_path:
            start_checks(store, prefix, parts, self._checked(root), self._checks.submit)

    def prefetch(self, handle: Any, offset: Sequence[int], shape: Sequence[int]) -> None:
        """A hint, nothing read here: start reading the chunk files a later ``read_into`` of
        this box will read whole (``posix_fadvise(WILLNEED)``), so reads issued in rounds
        find them in the page cache instead of leaving the disk idle between rounds."""
        if not isinstance(handle, _DirectHandle) or not hasattr(os, "posix_fadvise"):
            return
        # fadvise can block while it queues the reads: one pool task, the caller goes on.
        self._reads.submit(will_need, whole_chunk_files(handle.layout, offset, shape))

    def read_into(self, handle: Any, offset: Sequence[int], out: np.ndarray) -> Any:
        return start_read(
            handle,
            offset,
            out,
            self._reads,
            self._remote,
            self._meta_reads,
            self._packed_reads,
            self.ts,
        )

    def start_reads(self) -> None:
        """Start the packed reads added so far (planned together, :class:`ReadBatch`)."""
        self._packed_reads.dispatch()

    def wait(self, ops: Sequence[Any]) -> None:
        """Wait for every op (each finishes before an error is raised); the first error is
        raised, a TensorStore one as the spec's error naming the tensor."""
        self._packed_reads.dispatch()  # packed reads added so far start now, planned together
        wait_reads(ops)

    def verify_array(self, root: str, array_path: str, spec: ArraySpec, key: str) -> list[Any]:
        """Every chunk read and checked; one ``(spec ID, message)`` per problem."""
        return verify_array(self.open_array_for_read, self.ts, root, array_path, spec, key)

    # -- leftovers of crashed saves ([SP-COMMIT-6]): the committer's ---------------------
    def list_leftovers(self, directory: str) -> list[Any]:
        return self.committer.leftovers(directory)

    def restore_leftover(self, leftover: str, path: str) -> bool:
        return self.committer.restore(leftover, path)

    def remove_leftover(self, leftover: str) -> bool:
        return self.committer.discard(leftover)


if TYPE_CHECKING:
    # static checks that the class satisfies the protocol it claims (runtime_checkable
    # compares method names only); mypy fails here on a regression
    from shardpoint_core.transactions.protocol import StorageBackend

    def _is_storagebackend_zarrbackend(x: ZarrBackend) -> StorageBackend:
        return x
