"""Where a JAX checkpoint's bytes live, on the core (spec/format.md sections 3, 7, 9, 10).

Everything about the format is the core's: zarr.json is written and checked by the Zarr layer
(:mod:`shardpoint_core.arrays.array`, :mod:`~shardpoint_core.arrays.checks`), chunks are encoded
and decoded there, and checkpoints are published, replaced and removed by the core's
committers. What this module adds is the choice of path for each kind of store:

- a local path (plain or ``file://``): the fast paths of the file-system backend, each chunk
  written by :class:`~shardpoint_core.arrays.direct_write.DirectWriter` (``pwritev`` of the
  array's own memory); one ``syncfs`` makes a save durable; the
  :class:`~shardpoint_core.commit.posix.PosixCommitter` renames it into place;
- any other registered store (``s3://bucket/run/step_5``, ``memory://name/...``): the Zarr
  layer over the bucket's :class:`~shardpoint_core.stores.base.ByteStore`, one object per
  chunk, and the :class:`~shardpoint_core.commit.object_store.ObjectStoreCommitter`
  (the manifest written last is the commit marker, format.md 9.1).

Loads open and read arrays through the core's :class:`~shardpoint_core.transactions.backend.ZarrBackend`
(:data:`READER`), the object the torch front end reads with, into 64-byte aligned buffers
that JAX adopts without a copy: ``preadv`` straight into them on files; on object stores each
array's zarr.json GET with its first data GET beside it, and a region's chunks and shard runs
all in flight at once.

A location is a string either way (a path or a URL), so process 0 can send a staging location
to the others; :func:`locate` turns it into ``(store, key)``.
"""
from __future__ import annotations

import math
import os
from concurrent.futures import Future
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from shardpoint_core.stores.durable import fsync_trees, syncfs
from shardpoint_core.commit.posix import PosixCommitter
from shardpoint_core.format.dtypes import DTYPES
from shardpoint_core.format.manifest import MAX_MANIFEST_BYTES, Manifest, decode_manifest
from shardpoint_core.stores.files import FileStore
from shardpoint_core.stores.registry import (bucket_store, check_path, is_local, local_path,
                                             split_url)
from shardpoint_core.format.values import numpy_values
from shardpoint_core.format.spec import ArraySpec
from shardpoint_core.arrays.array import ArrayLayout, write_array_meta, write_region
from shardpoint_core.transactions.backend import ZarrBackend
from shardpoint_core.arrays.checks import (check_array_objects, check_backed_bytes,
                                         check_regular_file)
from shardpoint_core.commit.routing import PathCommitter, UrlCommitter
from shardpoint_core.arrays.direct_write import DirectWriter, WriteOp, WritePool, write_layout
from shardpoint_core.arrays.groups import start_groups, write_groups
from shardpoint_core.arrays.local import read_manifest_file
from shardpoint_jax.errors import (CheckpointNotFoundError, CorruptCheckpointError,
                                   IncompleteCheckpointError, InvalidRequestError,
                                   ShardpointError)

MANIFEST = "manifest.msgpack"
# Chunks bigger than this become shards of inner chunks of about INNER_TARGET bytes, so a
# load into another sharding reads only the inner chunks it needs (the writer's choice).
SHARD_ABOVE = 1 << 20
INNER_TARGET = 256 << 10
THREADS = 8          # chunk reads and writes in flight per process (files)
OBJECT_THREADS = 32  # ... on object stores, where a request's latency dominates

# Publishes, replaces and removes local checkpoints; holds the locks of this process's saves.
POSIX = PosixCommitter()


# -------------------------------------------------------------------------------- locations
def checkpoint_path(path: Any, call: str) -> str:
    """``path`` as a location: an absolute local path, or the URL of a registered store
    (a scheme nobody registered: UnsupportedStoreError, never a local directory named
    ``s3:``); InvalidRequestError when it is not a path at all (a tree passed where the
    path goes: the PyTorch reference takes ``save(state, path)``)."""
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidRequestError(f"{call}: the path is a {type(path).__name__}, not a str or "
                                  "os.PathLike; arguments swapped? (shardpoint_jax takes the "
                                  "path first; the PyTorch shardpoint.save takes (state, path))")
    if is_local(path):
        return os.path.abspath(local_path(path, call))
    check_path(path, call)
    scheme, rest = split_url(path)
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise InvalidRequestError(f"{call}: {os.fspath(path)!r} names no bucket "
                                  f"({scheme}://BUCKET/PATH)")
    return f"{scheme}://{bucket}/{key.strip('/')}".rstrip("/")


def locate(location: str) -> Tuple[Any, str]:
    """``(store, key)`` of a location: for a local path a :class:`FileStore` rooted there and
    ``""``; for a URL the store of its bucket (the core's, shared per bucket) and the key."""
    if is_local(location):
        return FileStore(location, fsync=False), ""
    return bucket_store(location, "shardpoint_jax")


def join(*parts: str) -> str:
    """Store keys joined with ``/`` (empty parts left out)."""
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


# Publishes, replaces and removes checkpoints, routed by path as the torch front end's backend
# does: local paths to POSIX (which holds this process's save locks), URLs to the object-store
# committer of their bucket.
COMMITTER = PathCommitter(POSIX, UrlCommitter(locate))


# -------------------------------------------------------------------------------- manifest
def _other_format(path: str) -> str:
    """What a directory without a manifest holds, by its file names, for the error."""
    names = set(os.listdir(path))
    if ".metadata" in names:
        return ("it holds a PyTorch DCP checkpoint: `shardpoint convert` makes a shardpoint "
                "one of it")
    if names & {"_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt"}:
        return (f"it holds an Orbax checkpoint: `shardpoint convert {path} DST` makes a "
                "shardpoint one of it (or restore it with Orbax and save the tree with "
                "shardpoint_jax.save)")
    steps = sorted((int(n), n) for n in names if n.isdigit()
                   and os.path.isfile(os.path.join(path, n, "_CHECKPOINT_METADATA")))
    if steps:
        return ("it is an Orbax CheckpointManager directory: `shardpoint convert "
                f"{os.path.join(path, steps[-1][1])} DST` makes a shardpoint checkpoint of its "
                "newest step")
    return "a save that crashed or is still running"


def _manifest_bytes(path: str) -> bytes:
    """The manifest's bytes, or the error saying what ``path`` holds instead."""
    if not is_local(path):      # one GET, at most the cap + 1 bytes; no HEAD before it
        return READER.read_manifest(path)
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"no checkpoint at {path!r}", spec_id="SP-COMMIT-3")
    if not os.path.isdir(path):
        raise IncompleteCheckpointError(f"{path!r} is not a directory: not a checkpoint",
                                        spec_id="SP-COMMIT-3")
    try:
        size = check_regular_file(path, MANIFEST, "manifest")      # [SP-SEC-5]
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{path!r} has no {MANIFEST}: not a checkpoint ({_other_format(path)})",
            spec_id="SP-COMMIT-3") from None
    if size > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{os.path.join(path, MANIFEST)!r} is {size} bytes, over "
                                     "the 1 GiB limit", spec_id="SP-SEC-2")
    return read_manifest_file(os.path.join(path, MANIFEST), size)     # [SP-MAN-1] first


def read_manifest(path: str) -> Manifest:
    """The checked manifest of the checkpoint at ``path`` (a location) [SP-COMMIT-3]
    [SP-SEC-2]."""
    raw = _manifest_bytes(path)
    with numpy_values():     # a torch front end in this process decodes to torch
        return decode_manifest(raw)


def write_manifest(staging: str, data: bytes) -> None:
    """The manifest of a save, the last thing written into its staging location."""
    if is_local(staging):
        POSIX.write_manifest(staging, data)
    else:
        store, key = locate(staging)
        store.put(join(key, MANIFEST), data)


# -------------------------------------------------------------------------------- pool
FILES = WritePool(THREADS, "shardpoint-jax-io")
OBJECTS = WritePool(OBJECT_THREADS, "shardpoint-jax-obj")


def pool_for(location: str) -> WritePool:
    return FILES if is_local(location) else OBJECTS


# -------------------------------------------------------------------------------- writing
def layout_of(shape: Sequence[int], dtype: str, chunk: Sequence[int]) -> ArrayLayout:
    """The Zarr layout this writer gives a tensor [SP-ARRAY-2] [SP-ARRAY-3]."""
    return ArrayLayout.create(shape, dtype, chunk, shard_above_bytes=SHARD_ABOVE,
                              inner_chunk_bytes=INNER_TARGET)


def create_arrays(staging: str, arrays: list) -> None:
    """Write each array's zarr.json (no chunks yet) with the core's Zarr layer; ``arrays``:
    ``(array path, shape, dtype, chunk)``."""
    store, key = locate(staging)
    pool = pool_for(staging)
    futs = [pool.submit(write_array_meta, store, join(key, array), layout_of(shape, dtype, chunk))
            for array, shape, dtype, chunk in arrays]
    for f in futs:
        f.result()


class ArrayWriter:
    """Writes whole chunks of one array of a save: direct ``pwritev`` on files, the Zarr
    layer's ``write_region`` elsewhere; :meth:`write` returns something with ``result()``."""

    def __init__(self, staging: str, array: str, entry: dict) -> None:
        self.layout = layout_of(entry["shape"], entry["dtype"], entry["chunk_shape"])
        self.store, key = locate(staging)
        self.path = join(key, array)
        self.pool = pool_for(staging)
        self.direct: Optional[DirectWriter] = None
        if is_local(staging):
            lay = write_layout(os.path.join(staging, array), self.layout.shape,
                               self.layout.chunk, self.layout.codecs, self.layout.itemsize)
            if lay is not None:
                self.direct = DirectWriter(lay, self.pool.submit)

    def write(self, offset: Sequence[int], data: np.ndarray) -> Any:
        """Start writing ``data`` (whole chunks, one writer each [SP-GRID-1]) at ``offset``."""
        lay = self.layout
        if self.direct is None or data.size == 0:
            return self.pool.submit(write_region, self.store, self.path, lay, tuple(offset),
                                    data, self.path)
        ops = []
        stop = [o + n for o, n in zip(offset, data.shape)]
        for cidx in np.ndindex(*[-(-e // c) - o // c for o, e, c in
                                 zip(offset, stop, lay.chunk)]):
            lo = [(o // c + i) * c for o, c, i in zip(offset, lay.chunk, cidx)]
            hi = [min(a + c, e) for a, c, e in zip(lo, lay.chunk, stop)]
            part = data[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset))
                        + (Ellipsis,)]
            op: Optional[WriteOp | Future[Any]] = self.direct.write(lo, part)
            if op is None:      # not one whole chunk: the Zarr layer writes it
                op = self.pool.submit(write_region, self.store, self.path, lay, tuple(lo),
                                      part, self.path)
            ops.append(op)
        return WriteOp(ops)


def write_group_metadata(staging: str, array_paths: Sequence[str]) -> list:
    """The save's Zarr group metadata ([SP-LAYOUT-5]): on files written here, before
    :func:`make_durable`; on an object store started, the futures returned, to be waited
    for after the staged manifest's PUT (in flight together: no round trip added)."""
    store, key = locate(staging)
    if is_local(staging):
        write_groups(store, key, array_paths, pool_for(staging).submit)
        return []
    return start_groups(store, key, array_paths, pool_for(staging).submit)


def make_durable(staging: str) -> None:
    """Make what this process wrote under ``staging`` durable [SP-COMMIT-1]: one ``syncfs``
    where Linux has it (its own writes, whatever their number), else an fsync of every file
    and directory under it; nothing on an object store (an acknowledged PUT is durable)."""
    if not is_local(staging) or syncfs(staging):
        return
    fsync_trees([staging], os.path.dirname(staging))


# -------------------------------------------------------------------------------- reading
def aligned_empty(shape: tuple, dtype: Any, align: int = 64) -> np.ndarray:
    """``np.empty`` whose data starts on a 64-byte boundary: JAX on the CPU then takes it as
    an array's buffer without copying it (it copies a less aligned one, which took 0.27-0.73
    s for the 1.2 GB benchmark tree here). Nothing else keeps a reference to a read buffer,
    so the array it becomes is the only owner."""
    dt = np.dtype(dtype)
    n = math.prod(shape) * dt.itemsize
    raw = np.empty(n + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + n].view(dt).reshape(shape)


# Opens and reads arrays for every load of this process, as the torch front end's backend
# does for a local path and for a URL; the layouts this writer gives (SHARD_ABOVE,
# INNER_TARGET) so an object-store array's first data request, sent beside its zarr.json GET
# under the layout this writer would have written, is the one zarr.json confirms.
READER = ZarrBackend(shard_above_bytes=SHARD_ABOVE, inner_chunk_bytes=INNER_TARGET,
                     read_threads=THREADS, concurrency=OBJECT_THREADS)


def start_listing(location: str) -> Optional[Future]:
    """On an object store, the listing of a checkpoint's objects started now (one LIST per
    1,000 objects, in flight with the manifest's GET): each array's chunk count and bytes
    for [SP-READ-6] before its buffer is allocated; None for a local path (the core's open
    counts the files)."""
    if is_local(location):
        return None
    store, key = locate(location)
    return OBJECTS.submit(lambda: chunks_by_array(store.list(key + "/")))


def chunks_by_array(infos: Any) -> dict:
    """A listing's chunk objects grouped by the array they belong to (its key without
    ``/c/...``, or ``/c`` for a 0-d array's one chunk): one pass, so each array looks its own
    up instead of scanning the whole checkpoint's listing."""
    out: dict = {}
    for i in infos:
        head, sep, rest = i.key.rpartition("/c/")
        if not (sep and rest and all(p.isdigit() for p in rest.split("/"))):
            if not i.key.endswith("/c"):
                continue
            head = i.key[:-2]
        out.setdefault(head, []).append(i)
    return out


class StoredArray:
    """One tensor's array, opened and read by the core's backend (:data:`READER`: zarr.json
    checked against the manifest [SP-ARRAY-1..3,5,6], missing chunks are errors [SP-READ-2],
    shard indexes checked [SP-READ-7], crc32c on every chunk [SP-READ-3]) into buffers of
    this front end's choosing. The declared size is backed by stored bytes before a buffer
    is allocated [SP-READ-6]: on files by the core's open, on object stores by the
    checkpoint's listing (``listing``, :func:`start_listing`)."""

    def __init__(self, root: str, key: str, entry: dict,
                 listing: Optional[Future] = None) -> None:
        self.root, self.key, self.entry = root, key, entry
        self.shape, self.chunk = list(entry["shape"]), list(entry["chunk_shape"])
        # the manifest's decoder refused a dtype outside the table ([SP-DTYPE-1])
        self.np_dtype = np.dtype(DTYPES[entry["dtype"]].numpy)
        self.itemsize = self.np_dtype.itemsize
        # the chunk table (1.3, [SP-MAN-7]) goes with it: the core's reads check each unit
        spec = ArraySpec(tuple(self.shape), entry["dtype"], tuple(self.chunk),
                         entry.get("chunk_crc32c"), entry.get("packed"))
        self.handle = READER.open_array_for_read(root, entry["array"], spec, key)
        self._unbacked = None if is_local(root) else (listing or start_listing(root))

    @property
    def layout(self) -> ArrayLayout:
        """The checked layout (on an object store zarr.json is read now if no read did)."""
        h = self.handle
        return h.arr.layout if hasattr(h, "arr") else h.layout

    @property
    def inner(self) -> Optional[list]:
        """The inner chunk shape when chunks are shards, else None."""
        return list(self.layout.inner) if self.layout.inner else None

    def _check_backed(self) -> None:
        """[SP-READ-6] on an object store before the first buffer is allocated (until it
        passes: every read of an array that fails it raises)."""
        if self._unbacked is None:
            return
        path = join(locate(self.root)[1], self.entry["array"])
        listed = self._unbacked.result().get(path, [])
        try:
            check_backed_bytes(self.key, self.entry["array"], tuple(self.shape),
                               tuple(self.chunk), self.itemsize,
                               (len(listed), sum(i.size for i in listed)))
        except CorruptCheckpointError:
            # The rule checked before this one, each object's size ([SP-READ-5] as
            # [SP-READ-3]), needs zarr.json: read now, on this failure's path only.
            lay = self.layout
            sizes = (math.prod(lay.chunk) * self.itemsize + 4, 0) if not lay.inner else \
                (None, 16 * math.prod(c // i for c, i in zip(lay.chunk, lay.inner)) + 4)
            check_array_objects(None, path, self.key, sizes, listed)
            raise
        self._unbacked = None

    def read(self, offset: Sequence[int], shape: Sequence[int],
             out: Optional[np.ndarray] = None) -> np.ndarray:
        """The stored elements of a region, checked [SP-READ-1..3] [SP-READ-5]."""
        return self.start_read(offset, shape, out).result()

    def start_read(self, offset: Sequence[int], shape: Sequence[int],
                   out: Optional[np.ndarray] = None) -> "PendingRead":
        """Start reading a region into ``out`` (a new 64-byte aligned array when None); the
        returned read's ``result()`` waits and raises what was found wrong."""
        if len(offset) != len(self.shape) or len(shape) != len(self.shape) or any(
                o < 0 or n < 0 or o + n > d for o, n, d in zip(offset, shape, self.shape)):
            raise InvalidRequestError(f"tensor {self.key!r}: region {list(offset)}+"
                                      f"{list(shape)} is outside {self.shape}",
                                      spec_id="SP-HOLD-1")
        self._check_backed()
        if out is None:
            out = aligned_empty(tuple(shape), self.np_dtype)
        if math.prod(shape) == 0:
            return PendingRead(self, offset, shape, out, [])
        return PendingRead(self, offset, shape, out,
                           [READER.read_into(self.handle, tuple(offset), out)])


class PendingRead:
    """A region being read into its buffer by :meth:`StoredArray.start_read`."""

    def __init__(self, array: StoredArray, offset: Sequence[int], shape: Sequence[int],
                 out: np.ndarray, futs: list) -> None:
        self.array, self.offset, self.shape, self.out = array, offset, shape, out
        self.futs: Optional[list] = futs
        self.nbytes = out.nbytes

    def result(self) -> np.ndarray:
        """The region's elements once read and checked (raises the corruption found; every
        request is waited for first, so none still fills the buffer)."""
        todo, self.futs = self.futs or [], None
        try:
            READER.wait(todo)
        except ShardpointError:
            raise           # the spec's error
        except FileNotFoundError as e:
            raise self._corrupt(e, "is missing", "SP-READ-2") from None
        except OSError:
            raise           # the store's own (unreachable, denied)
        except Exception as e:  # noqa: BLE001 - bytes the layer could not decode
            raise self._corrupt(e, "cannot be read", "SP-READ-3") from None
        return self.out

    def _corrupt(self, e: BaseException, what: str, sid: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"tensor {self.array.key!r}: stored data of region {list(self.offset)}+"
            f"{list(self.shape)} {what}: {str(e)[:300]}", spec_id=sid)
