"""Checkpoints on object stores (``s3://bucket/run/step_5``): the storage seam over a
:class:`~shardpoint_core.store.base.ByteStore`, the Zarr layer (:mod:`.array`) and the
object-store committer (:mod:`shardpoint_core.commit.object_store`, format.md 9.1).

Paths are URLs; the store of a URL is the registered store of its bucket
(:func:`~shardpoint_core.store.registry.open_store` of ``scheme://bucket``), shared by every
checkpoint of that bucket, so one connection pool serves a job. Chunk writes and reads run on a
pool of ``concurrency`` threads (requests in flight per process); each chunk is one object,
written by one PUT from the caller's buffers (no joined copy), and a load reads only the
chunks, and in shards only the inner chunks, that its regions meet (ranged GETs). Nothing
holds more than the chunks in flight.

Example::

    be = ObjectStoreBackend()
    staging = be.staging_path("s3://bucket/run/step_5", token="a1b2c3d4")
    h = be.open_array_for_write(staging, "tensors/w", ArraySpec((4, 4), "float32", (2, 4)))
    be.wait([be.write(h, (0, 0), np.ones((4, 4), np.float32))])
    be.write_manifest(staging, manifest_bytes)
    be.commit(staging, "s3://bucket/run/step_5", overwrite=False)
"""
from __future__ import annotations

import math
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from shardpoint_core.commit.object_store import ObjectStoreCommitter
from shardpoint_core.errors import (CheckpointNotFoundError, CorruptCheckpointError,
                                    IncompleteCheckpointError, InvalidOptionError,
                                    ShardpointError)
from shardpoint_core.storage import MANIFEST_NAME, ArraySpec
from shardpoint_core.store.registry import open_store, split_url
from shardpoint_core.zarr.array import (MAX_ZARR_JSON_BYTES, ArrayLayout, _box, _chunks_of,
                                        chunk_key,
                                        decode_chunk, read_array_meta, read_chunk,
                                        read_region, write_array_meta, write_region)

MAX_MANIFEST_BYTES = 1 << 30


class _Array:
    """An open array: its store, key below the store's root, and layout."""

    __slots__ = ("store", "path", "layout", "key")

    def __init__(self, store, path: str, layout: ArrayLayout, key: str) -> None:
        self.store, self.path, self.layout, self.key = store, path, layout, key


class _OneGet:
    """A view of a store for reading one small object (zarr.json) in one request: ``head``
    is answered by a ranged GET of at most ``cap + 1`` bytes, and reads come from those
    bytes, so a HEAD then a GET (two round trips per array on an object store) become one."""

    def __init__(self, store, cap: int) -> None:
        self._store, self._cap = store, cap
        self._data: Dict[str, bytes] = {}
        self.url = store.url

    def head(self, key: str):
        from shardpoint_core.store.base import ObjectInfo
        try:
            data = self._data[key] = self._store.get_range(key, 0, self._cap + 1)
        except FileNotFoundError:
            return None
        return ObjectInfo(key, len(data), 0.0)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        data = self._data.get(key)
        if data is None:
            return self._store.get_range(key, start, length)
        return data[start:start + length]


def _read_plain(h: _Array, offset: tuple, out: np.ndarray) -> None:
    """A region of an array of plain chunks with one ranged GET per chunk (no HEAD first:
    a request saved per chunk is most of a small chunk's cost on an object store). The GET
    asks for one byte more than a chunk holds, so a wrong size is seen without reading (or
    allocating) more than that ([SP-READ-3]); a missing object is [SP-READ-2]."""
    lay = h.layout
    n = math.prod(lay.chunk) * lay.itemsize + 4
    for cidx, origin, blo, bhi in _chunks_of(lay, offset, out.shape):
        ckey = chunk_key(h.path, cidx)
        try:
            raw = h.store.get_range(ckey, 0, n + 1)
        except FileNotFoundError as e:
            raise CorruptCheckpointError(f"tensor {h.key!r}: {ckey}: stored chunk is missing",
                                         spec_id="SP-READ-2") from e
        full = decode_chunk(np.frombuffer(raw, np.uint8), lay, lay.chunk, h.key, ckey)
        out[_box(offset, out.shape, blo, bhi)] = full[_box(origin, lay.chunk, blo, bhi)]


class UrlCommitter:
    """The :class:`~shardpoint_core.commit.base.Committer` of an :class:`ObjectStoreBackend`,
    on URLs: each call goes to the :class:`ObjectStoreCommitter` of the URL's bucket."""

    name = "object-store-marker"

    def __init__(self, backend: "ObjectStoreBackend") -> None:
        self._be = backend

    def _at(self, url: str) -> Tuple[ObjectStoreCommitter, str]:
        store, key = self._be.locate(url)
        return ObjectStoreCommitter(store), key

    def state(self, target: str) -> str:
        c, k = self._at(target)
        return c.state(k)

    def check_target(self, target: str, overwrite: Any) -> None:
        c, k = self._at(target)
        c.check_target(k, bool(overwrite))

    def begin(self, target: str, token: str) -> str:
        c, k = self._at(target)
        return self._be._url(target, c.begin(k, token))

    def publish(self, staging: str, target: str, *, overwrite: Any) -> None:
        c, k = self._at(target)
        c.publish(self._be.locate(staging)[1], k, overwrite=bool(overwrite))

    def abort(self, staging: str) -> None:
        c, k = self._at(staging)
        c.abort(k)

    def remove(self, target: str) -> bool:
        c, k = self._at(target)
        return c.remove(k)

    def leftovers(self, directory: str) -> list:
        from dataclasses import replace
        c, k = self._at(directory)
        return [replace(lo, path=self._be._url(directory, lo.path),
                        target=self._be._url(directory, lo.target)) for lo in c.leftovers(k)]

    def restore(self, leftover: str, target: str) -> bool:
        c, k = self._at(leftover)
        return c.restore(k, target)

    def discard(self, leftover: str) -> bool:
        c, k = self._at(leftover)
        return c.discard(k)


class ObjectStoreBackend:
    """A :class:`~shardpoint_core.storage.StorageBackend` for URL paths on object stores."""

    name = "object-store"
    open_concurrency = 32    # arrays opened at once ahead of reads (one GET each)

    def __init__(self, concurrency: int = 32) -> None:
        if concurrency < 1:
            raise InvalidOptionError("ObjectStoreBackend: concurrency must be >= 1")
        self.concurrency = concurrency
        self._stores: Dict[str, Any] = {}
        self._lock = threading.Lock()
        self._pool: Optional[ThreadPoolExecutor] = None
        self.committer = UrlCommitter(self)      # publishes, replaces, removes (9.1)
        self._meta: Dict[str, list] = {}         # staging URL -> zarr.json writes in flight

    # -- URLs -----------------------------------------------------------------------------
    def locate(self, url: str) -> Tuple[Any, str]:
        """(the store of ``url``'s bucket, the key of ``url`` below it)."""
        scheme, rest = split_url(url)
        if scheme is None or scheme == "file":
            raise InvalidOptionError(f"{url!r} is a local path; the object-store backend "
                                     "takes scheme://bucket/key URLs")
        bucket, _, key = rest.partition("/")
        root = f"{scheme}://{bucket}"
        with self._lock:
            store = self._stores.get(root)
        if store is None:
            store = open_store(root, "open")
            with self._lock:
                store = self._stores.setdefault(root, store)
        return store, key.strip("/")

    def _committer(self, url: str) -> Tuple[ObjectStoreCommitter, str]:
        store, key = self.locate(url)
        return ObjectStoreCommitter(store), key

    def _url(self, url: str, key: str) -> str:
        scheme, rest = split_url(url)
        return f"{scheme}://{rest.partition('/')[0]}/{key}"

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="sp-obj")
            return self._pool

    # -- save -----------------------------------------------------------------------------
    def supports_concurrent_writers(self) -> bool:
        return True         # one object per chunk, zarr.json by a conditional create

    def checkpoint_state(self, path: str) -> str:
        c, key = self._committer(path)
        return c.state(key)

    def check_target(self, path: str, overwrite: Any) -> None:
        c, key = self._committer(path)
        c.check_target(key, bool(overwrite))

    def staging_path(self, path: str, token: str) -> str:
        c, key = self._committer(path)
        return self._url(path, c.begin(key, token))

    def begin_save(self, staging: str) -> None:
        """Nothing to create: a prefix exists once an object is below it."""

    def open_array_for_write(self, root: str, array_path: str, spec: ArraySpec) -> _Array:
        store, key = self.locate(root)
        lay = ArrayLayout.create(spec.shape, spec.dtype, spec.chunk_shape)
        path = f"{key}/{array_path}"
        # If-None-Match: one writer wins [SP-COMMIT-8]. In flight with the chunks (an object
        # store needs no zarr.json before a chunk object); flush() waits for it.
        fut = self._executor().submit(write_array_meta, store, path, lay)
        with self._lock:
            self._meta.setdefault(root, []).append(fut)
        return _Array(store, path, lay, array_path)

    def write(self, handle: _Array, offset: Sequence[int], data: np.ndarray) -> Future:
        return self._executor().submit(write_region, handle.store, handle.path,
                                       handle.layout, tuple(offset), data, handle.key)

    def wait(self, ops: Sequence[Any]) -> None:
        first: Optional[BaseException] = None
        for op in ops:
            try:
                op.result()
            except BaseException as e:   # noqa: BLE001 - every op finishes before we raise
                first = first or e
        if first is not None:
            if isinstance(first, (ShardpointError, OSError)):
                raise first
            raise OSError(f"object store I/O failed: {first!r}") from first

    def flush(self, root: str) -> None:
        """Wait for this process's zarr.json writes; nothing else: an acknowledged PUT is
        durable ([SP-COMMIT-10])."""
        with self._lock:
            pending = self._meta.pop(root, [])
        self.wait(pending)

    def write_manifest(self, root: str, data: bytes) -> None:
        store, key = self.locate(root)
        store.put(f"{key}/{MANIFEST_NAME}", data)

    def commit(self, staging: str, path: str, *, overwrite: Any) -> None:
        c, key = self._committer(path)
        _, skey = self.locate(staging)
        c.publish(skey, key, overwrite=bool(overwrite))

    def abort(self, staging: str) -> None:
        with self._lock:
            pending = self._meta.pop(staging, [])
        for f in pending:                    # let them land, then delete them too
            f.exception()
        store, key = self.locate(staging)
        ObjectStoreCommitter(store).abort(key)

    # -- load -----------------------------------------------------------------------------
    def read_manifest(self, path: str) -> bytes:
        store, key = self.locate(path)
        mkey = f"{key}/{MANIFEST_NAME}" if key else MANIFEST_NAME
        info = store.head(mkey)
        if info is None:
            if ObjectStoreCommitter(store).state(key) == "incomplete":
                raise IncompleteCheckpointError(
                    f"{path} has objects but no manifest.msgpack: a save that crashed or is "
                    "still running, not a checkpoint", spec_id="SP-COMMIT-3")
            raise CheckpointNotFoundError(f"no checkpoint at {path} (no manifest.msgpack)",
                                          spec_id="SP-COMMIT-3")
        if info.size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"{path}/{MANIFEST_NAME} is {info.size} bytes, over "
                                         "the 1 GiB cap", spec_id="SP-SEC-2")
        try:
            return store.get_range(mkey, 0, MAX_MANIFEST_BYTES + 1)
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"{path}: the manifest vanished while it was read "
                                          "(a concurrent removal)", spec_id="SP-COMMIT-3") from e

    def checkpoint_identity(self, path: str) -> Optional[list]:
        """The marker's ETag: it changes with every commit to ``path``, so a load that
        overlapped a replacement fails instead of mixing ([SP-COMMIT-14])."""
        store, key = self.locate(path)
        info = store.head(f"{key}/{MANIFEST_NAME}" if key else MANIFEST_NAME)
        return None if info is None else [info.version, info.size]

    def open_array_for_read(self, root: str, array_path: str, spec: ArraySpec,
                            key: str) -> _Array:
        store, k = self.locate(root)
        path = f"{k}/{array_path}" if k else array_path
        meta = read_array_meta(_OneGet(store, MAX_ZARR_JSON_BYTES), path, spec, key)
        return _Array(store, path, meta, key)

    def read_into(self, handle: _Array, offset: Sequence[int], out: np.ndarray) -> Future:
        if handle.layout.inner is None:
            return self._executor().submit(_read_plain, handle, tuple(offset), out)
        return self._executor().submit(read_region, handle.store, handle.path, handle.layout,
                                       tuple(offset), out, handle.key)

    def verify_array(self, root: str, array_path: str, spec: ArraySpec, key: str) -> list:
        try:
            h = self.open_array_for_read(root, array_path, spec, key)
        except CorruptCheckpointError as e:
            return [(e.spec_id, str(e))]
        problems = []
        for cidx in np.ndindex(*h.layout.grid()):
            try:
                read_chunk(h.store, h.path, h.layout, cidx, key)
            except CorruptCheckpointError as e:
                problems.append((e.spec_id, str(e)))
        return problems

    # -- recovery -------------------------------------------------------------------------
    def list_leftovers(self, directory: str) -> list:
        return self.committer.leftovers(directory)

    def restore_leftover(self, leftover: str, path: str) -> None:
        self.committer.restore(leftover, path)

    def remove_leftover(self, leftover: str) -> None:
        self.committer.discard(leftover)


_DEFAULT: Optional[ObjectStoreBackend] = None


def backend_for(path: Any, backend: Any = None) -> Any:
    """The backend for ``path``: ``backend`` when given, the object-store backend for a URL
    of a registered store other than files, else the default (local files)."""
    if backend is not None:
        return backend
    scheme, _ = split_url(path)
    if scheme is None or scheme == "file":
        from shardpoint_core.storage import get_backend
        return get_backend()
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = ObjectStoreBackend()
    return _DEFAULT


def resolve(path: Any, backend: Any, call: str) -> Tuple[str, Any]:
    """``(path, backend)`` for an API call: a local path (plain or ``file://``) with the
    default backend, or the URL of a registered store with the object-store backend; a
    scheme nobody registered is refused before any I/O (UnsupportedStoreError)."""
    from shardpoint_core.store.registry import check_path, is_local, local_path
    if not isinstance(path, (str, bytes, os.PathLike)):    # the caller's own check says so
        from shardpoint_core.storage import get_backend
        return path, get_backend(backend)
    if is_local(path) or backend is not None:
        return str(local_path(path, call)) if is_local(path) else str(path), \
            backend_for(path, backend)
    check_path(path, call)
    return str(path), backend_for(path)
