"""What shardpoint_jax adds to the core's checkpoint transactions (spec/format.md 3, 7, 9-11).

Saves and loads go through :class:`~shardpoint_core.transactions.writer.CheckpointWriter` and
:class:`~shardpoint_core.transactions.reader.CheckpointReader`, over the core's default backend
of the path (the torch front end's: the packed layout, or the per-array one where a save names
``ZarrBackend()``; every backend reads both): the layouts, the local fast paths
(``pwritev``/``preadv``, one ``syncfs``), the chunk tables and the committers are the core's,
the same for both front ends. What is JAX's own is here:

- :func:`checkpoint_path`: a location from what the JAX API takes, with its errors (a tree
  passed where the path goes: the PyTorch reference takes ``save(state, path)``);
- :func:`open_reader`: the reader, with errors saying what a local directory holds instead of
  a checkpoint (a DCP or Orbax checkpoint, with the command converting it);
- :func:`chunk_pieces`: a region of a JAX shard cut into whole chunks (a backend writes one
  chunk per op, its fast path);
- :class:`StoredArray`: regions of one tensor read into 64-byte aligned buffers that JAX
  adopts without a copy; on object stores the declared size of a per-array tensor is
  backed by stored bytes ([SP-READ-6]) from one listing of the checkpoint
  (:func:`start_listing`, started once the manifest says the layout is per-array) before a
  buffer is allocated; a packed tensor's data objects are checked when it is opened
  ([SP-PACK-7]), with no listing.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator, Optional, Sequence, Tuple

import numpy as np

from shardpoint_core.arrays.array import ArrayLayout
from shardpoint_core.arrays.checks import check_array_objects, check_backed_bytes
from shardpoint_core.format.manifest import Manifest
from shardpoint_core.format.spec import MANIFEST_NAME
from shardpoint_core.format.values import numpy_values
from shardpoint_core.stores.location import locate
from shardpoint_core.stores.registry import check_path, is_local, local_path, split_url
from shardpoint_core.transactions.reader import CheckpointReader
from shardpoint_jax.dtypes import numpy_of
from shardpoint_jax.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidRequestError,
    ShardpointError,
)


# -------------------------------------------------------------------------------- locations
def checkpoint_path(path: Any, call: str) -> str:
    """``path`` as a location: an absolute local path, or the URL of a registered store
    (a scheme nobody registered: UnsupportedStoreError, never a local directory named
    ``s3:``); InvalidRequestError when it is not a path at all (a tree passed where the
    path goes: the PyTorch reference takes ``save(state, path)``)."""
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidRequestError(
            f"{call}: the path is a {type(path).__name__}, not a str or "
            "os.PathLike; arguments swapped? (shardpoint_jax takes the "
            "path first; the PyTorch shardpoint.save takes (state, path))"
        )
    if is_local(path):
        return os.path.abspath(local_path(path, call))
    check_path(path, call)
    scheme, rest = split_url(path)
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise InvalidRequestError(
            f"{call}: {os.fspath(path)!r} names no bucket ({scheme}://BUCKET/PATH)"
        )
    return f"{scheme}://{bucket}/{key.strip('/')}".rstrip("/")


# -------------------------------------------------------------------------------- manifest
def _other_format(path: str) -> str:
    """What a directory without a manifest holds, by its file names, for the error."""
    names = set(os.listdir(path))
    if ".metadata" in names:
        return (
            "it holds a PyTorch DCP checkpoint: `shardpoint convert` makes a shardpoint one of it"
        )
    if names & {"_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt"}:
        return (
            f"it holds an Orbax checkpoint: `shardpoint convert {path} DST` makes a "
            "shardpoint one of it (or restore it with Orbax and save the tree with "
            "shardpoint_jax.save)"
        )
    steps = sorted(
        (int(n), n)
        for n in names
        if n.isdigit() and os.path.isfile(os.path.join(path, n, "_CHECKPOINT_METADATA"))
    )
    if steps:
        return (
            "it is an Orbax CheckpointManager directory: `shardpoint convert "
            f"{os.path.join(path, steps[-1][1])} DST` makes a shardpoint checkpoint of its "
            "newest step"
        )
    return "a save that crashed or is still running"


def _refuse_local(path: str) -> None:
    """On the error path of a local open: what ``path`` holds instead of a checkpoint, as
    this front end has always said it (IncompleteCheckpointError, [SP-COMMIT-3]); returns
    where the core's error says it better (nothing there, or a manifest there)."""
    if not os.path.lexists(path) or os.path.lexists(os.path.join(path, MANIFEST_NAME)):
        return
    if not os.path.isdir(path):
        raise IncompleteCheckpointError(
            f"{path!r} is not a directory: not a checkpoint", spec_id="SP-COMMIT-3"
        )
    raise IncompleteCheckpointError(
        f"{path!r} has no {MANIFEST_NAME}: not a checkpoint ({_other_format(path)})",
        spec_id="SP-COMMIT-3",
    )


def open_reader(path: str, call: str = "load(path, target)") -> CheckpointReader:
    """The core's reader of the checkpoint at ``path`` (a location): its manifest read with
    the identity of its commit [SP-COMMIT-3] [SP-SEC-2] [SP-COMMIT-14]."""
    try:
        return CheckpointReader.open(path, call=call)
    except (CheckpointNotFoundError, IncompleteCheckpointError):
        if is_local(path):
            _refuse_local(path)
        raise


def manifest_of(reader: CheckpointReader) -> Manifest:
    """The reader's decoded manifest, its values as numpy (a torch front end in this process
    would have them decoded to torch)."""
    with numpy_values():
        return reader.manifest


def read_manifest(path: str, call: str = "read_metadata(path)") -> Manifest:
    """The checked manifest of the checkpoint at ``path`` (a location)."""
    return manifest_of(open_reader(checkpoint_path(path, call), call))


# -------------------------------------------------------------------------------- writing
def chunk_pieces(
    offset: Sequence[int], data: np.ndarray, chunk: Sequence[int]
) -> Iterator[Tuple[list, np.ndarray]]:
    """``(chunk origin, view)`` of each whole chunk of the region ``data`` at ``offset`` (a
    JAX shard: the chunk grid is chosen so that each chunk lies inside one, [SP-GRID-1])."""
    stop = [o + n for o, n in zip(offset, data.shape)]
    for cidx in np.ndindex(*[-(-e // c) - o // c for o, e, c in zip(offset, stop, chunk)]):
        lo = [(o // c + i) * c for o, c, i in zip(offset, chunk, cidx)]
        hi = [min(a + c, e) for a, c, e in zip(lo, chunk, stop)]
        yield lo, data[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset)) + (Ellipsis,)]


# -------------------------------------------------------------------------------- reading
def aligned_empty(shape: tuple, dtype: Any, align: int = 64) -> np.ndarray:
    """``np.empty`` whose data starts on a 64-byte boundary: JAX on the CPU then takes it as
    an array's buffer without copying it (it copies a less aligned one). Nothing else keeps
    a reference to a read buffer, so the array it becomes is the only owner."""
    dt = np.dtype(dtype)
    n = math.prod(shape) * dt.itemsize
    raw = np.empty(n + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off : off + n].view(dt).reshape(shape)


_LISTS: Optional[ThreadPoolExecutor] = None


def start_listing(location: str) -> Optional[Future]:
    """On an object store, the listing of a per-array checkpoint's objects started now (one
    LIST per 1,000 objects, in flight with the first reads): each array's chunk count and
    bytes for [SP-READ-6] before its buffer is allocated; None for a local path (the core's
    open counts the files)."""
    global _LISTS
    if is_local(location):
        return None
    if _LISTS is None:
        _LISTS = ThreadPoolExecutor(4, "shardpoint-jax-list")
    store, key = locate(location).pair()
    return _LISTS.submit(lambda: chunks_by_array(store.list(key + "/")))


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
    """One tensor of a checkpoint, opened by the core's reader (zarr.json checked against
    the manifest [SP-ARRAY-1..3,5,6], missing chunks are errors [SP-READ-2], shard indexes
    checked [SP-READ-7], crc32c and the chunk table on every unit [SP-READ-3] [SP-READ-8])
    and read into buffers of this front end's choosing. The declared size is backed by
    stored bytes before a buffer is allocated [SP-READ-6]: on files by the core's open, on
    object stores by the checkpoint's listing (``listing``, :func:`start_listing`)."""

    def __init__(
        self, reader: CheckpointReader, key: str, listing: Optional[Future] = None
    ) -> None:
        entry = manifest_of(reader).tensors[key]
        self.reader, self.key, self.array_path = reader, key, entry.array
        self.shape, self.chunk = list(entry.shape), list(entry.chunk_shape)
        # the manifest's decoder refused a dtype outside the table ([SP-DTYPE-1])
        self.np_dtype = numpy_of(entry.dtype, key)
        self.itemsize = self.np_dtype.itemsize
        self.handle = reader.array(key)
        # [SP-READ-6] by the listing on object stores; a packed tensor's objects were checked
        # when it was opened ([SP-PACK-7]), and it has no chunk objects to list
        self._unbacked = (
            None
            if is_local(reader.path) or entry.packed is not None
            else (listing or start_listing(reader.path))
        )

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
        path = "/".join(p for p in (locate(self.reader.path).pair()[1], self.array_path) if p)
        listed = self._unbacked.result().get(path, [])
        try:
            check_backed_bytes(
                self.key,
                self.array_path,
                tuple(self.shape),
                tuple(self.chunk),
                self.itemsize,
                (len(listed), sum(i.size for i in listed)),
            )
        except CorruptCheckpointError:
            # The rule checked before this one, each object's size ([SP-READ-5] as
            # [SP-READ-3]), needs zarr.json: read now, on this failure's path only.
            lay = self.layout
            if lay.zstd_level is not None:  # (1.5) compressed: up to MAX_RATIO x stored
                from shardpoint_core.format.compression import MAX_RATIO, stored_bounds

                least = stored_bounds(math.prod(lay.chunk) * self.itemsize)[0]
                check_array_objects(None, path, self.key, (None, least), listed)
                check_backed_bytes(
                    self.key,
                    self.array_path,
                    tuple(self.shape),
                    tuple(self.chunk),
                    self.itemsize,
                    (len(listed), sum(i.size for i in listed)),
                    MAX_RATIO,
                )
                self._unbacked = None
                return
            sizes = (
                (math.prod(lay.chunk) * self.itemsize + 4, 0)
                if not lay.inner
                else (None, 16 * math.prod(c // i for c, i in zip(lay.chunk, lay.inner)) + 4)
            )
            check_array_objects(None, path, self.key, sizes, listed)
            raise
        self._unbacked = None

    def read(
        self, offset: Sequence[int], shape: Sequence[int], out: Optional[np.ndarray] = None
    ) -> np.ndarray:
        """The stored elements of a region, checked [SP-READ-1..3] [SP-READ-5]."""
        return self.start_read(offset, shape, out).result()

    def start_read(
        self, offset: Sequence[int], shape: Sequence[int], out: Optional[np.ndarray] = None
    ) -> "PendingRead":
        """Start reading a region into ``out`` (a new 64-byte aligned array when None); the
        returned read's ``result()`` waits and raises what was found wrong."""
        if (
            len(offset) != len(self.shape)
            or len(shape) != len(self.shape)
            or any(o < 0 or n < 0 or o + n > d for o, n, d in zip(offset, shape, self.shape))
        ):
            raise InvalidRequestError(
                f"tensor {self.key!r}: region {list(offset)}+{list(shape)} is outside {self.shape}",
                spec_id="SP-HOLD-1",
            )
        self._check_backed()
        if out is None:
            out = aligned_empty(tuple(shape), self.np_dtype)
        if math.prod(shape) == 0:
            return PendingRead(self, offset, shape, out, [])
        return PendingRead(
            self, offset, shape, out, [self.reader.read_into(self.handle, tuple(offset), out)]
        )


class PendingRead:
    """A region being read into its buffer by :meth:`StoredArray.start_read`."""

    def __init__(
        self,
        array: StoredArray,
        offset: Sequence[int],
        shape: Sequence[int],
        out: np.ndarray,
        futs: list,
    ) -> None:
        self.array, self.offset, self.shape, self.out = array, offset, shape, out
        self.futs: Optional[list] = futs
        self.nbytes = out.nbytes

    def result(self) -> np.ndarray:
        """The region's elements once read and checked (raises the corruption found; every
        request is waited for first, so none still fills the buffer)."""
        todo, self.futs = self.futs or [], None
        try:
            self.array.reader.wait(todo)
        except ShardpointError:
            raise  # the spec's error
        except FileNotFoundError as e:
            raise self._corrupt(e, "is missing", "SP-READ-2") from None
        except OSError:
            raise  # the store's own (unreachable, denied)
        except Exception as e:  # noqa: BLE001 - bytes the layer could not decode
            raise self._corrupt(e, "cannot be read", "SP-READ-3") from None
        return self.out

    def _corrupt(self, e: BaseException, what: str, sid: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"tensor {self.array.key!r}: stored data of region {list(self.offset)}+"
            f"{list(self.shape)} {what}: {str(e)[:300]}",
            spec_id=sid,
        )
