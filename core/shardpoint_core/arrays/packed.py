"""The packed layout over a byte store (format 1.4, spec/format.md section 13): each writer
appends the encoded chunks it owns to data objects of its own, and readers find a chunk's
bytes through the manifest's index.

Both directions reuse the Zarr layer of :mod:`.array` unchanged, over a *chunk view*: a
store-like object that answers the layer's requests for an array's chunk keys
(``<name>/c/i/j``) from the packed objects. So the chunk bytes, the codecs, crc32c, shard
indexes, chunk tables and every reader check are the per-array layout's, byte for byte.

- Writing (:class:`PackedWriter`): one writer per process and save. On local files one file
  per writer (``packed/<writer>-<n>.bin``), each chunk a ``pwritev`` at an offset reserved
  under a lock (so encoding and writing run in parallel threads while the file fills front
  to back), made durable by an fsync of the files and their directories. On object stores
  the chunks are copied into a segment that is PUT (multipart above the store's threshold)
  when it reaches the size cap (16 MiB), at most 256 MiB of segments in flight, the last
  at ``finish``.
  ``finish`` also writes the writer's index part ``packed/<writer>.idx`` (msgpack), which
  the coordinator gathers into the manifest (:func:`gather_parts`) and deletes.
- Reading: :mod:`.packed_read`.
"""

from __future__ import annotations

import os
import secrets
import threading
from concurrent.futures import Future
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
)

import msgpack

from shardpoint_core.arrays.array import ArrayLayout
from shardpoint_core.arrays.identity import chunk_number
from shardpoint_core.format.errors import CorruptCheckpointError, SaveFailedError
from shardpoint_core.format.packed import PackedIndex, records_of
from shardpoint_core.stores.base import ByteStore, ObjectInfo, StoreCapabilities

PACKED_DIR = "packed"
ALIGN = 4096  # chunks of ALIGN_ABOVE bytes and more start on this boundary
ALIGN_ABOVE = 256 << 10
FILE_CAP = 1 << 40  # files: split only for truly huge writers
OBJECT_CAP = 16 << 20  # object stores: one object per 16 MiB of a writer's chunks
IN_FLIGHT = 256 << 20  # object stores: segments being PUT at once, in bytes

_ZEROS = bytes(ALIGN)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


def _cidx(name: str, key: str) -> tuple[int, ...]:
    """The chunk index of chunk key ``key`` of array ``name`` (``name/c/i/j``)."""
    rest = key[len(name) + 2 :]
    return tuple(int(p) for p in rest.split("/")[1:]) if rest else ()


def _bad(key: str, where: str, msg: str, sid: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"tensor {key!r}: {where}: {msg}", spec_id=sid)


# ------------------------------------------------------------------------------ writing
class PackedWriter:
    """One process's data objects in one save below ``prefix`` of ``store``; thread-safe.
    ``cap``: bytes after which a new object starts (default by store kind)."""

    def __init__(
        self,
        store: ByteStore,
        prefix: str,
        *,
        cap: Optional[int] = None,
        fsync: bool = True,
        submit: Optional[Callable[..., Future[Any]]] = None,
        writer_id: Optional[str] = None,
    ) -> None:
        self.store, self.prefix, self.fsync = store, prefix, fsync
        self.local = bool(store.capabilities.local_path)
        self.cap = cap or (FILE_CAP if self.local else OBJECT_CAP)
        self.id = writer_id or secrets.token_hex(8)
        self.submit = submit
        self._lock = threading.Lock()
        self._objects: List[List[Any]] = []  # [relative key, size]
        self._records: Dict[Tuple[str, int], Tuple[int, int, int, bytes]] = {}
        self.inner: Dict[str, Optional[List[int]]] = {}  # array name -> inner chunk shape
        self._fds: List[int] = []
        self._segment = bytearray()  # object stores: the object being filled
        self._seg_len = 0
        self._puts: List[Future[Any]] = []
        self._slots = threading.Semaphore(max(2, IN_FLIGHT // self.cap))
        self._failed: Optional[BaseException] = None

    def _key(self, n: int) -> str:
        return f"{PACKED_DIR}/{self.id}-{n}.bin"

    def _new_object(self) -> None:
        """Start object number ``len(self._objects)`` (lock held)."""
        key = self._key(len(self._objects))
        if self.local:
            path = self.store.path(_join(self.prefix, key))  # type: ignore[attr-defined]
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._fds.append(
                os.open(
                    path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644
                )
            )
        self._objects.append([key, 0])

    def append(self, name: str, chunk: int, bufs: Sequence[Any]) -> None:
        """Store the encoded chunk ``chunk`` of array ``name`` (its buffers, in order)."""
        views = [memoryview(b).cast("B") for b in bufs]
        n = sum(len(v) for v in views)
        crc = bytes(views[-1][-4:]) if n >= 4 else b"\0\0\0\0"
        with self._lock:
            if self._failed is not None:
                raise SaveFailedError(f"an earlier write of this save failed: {self._failed}")
            if not self._objects:
                self._new_object()
            size = self._objects[-1][1]
            start = size + (-size % ALIGN if n >= ALIGN_ABOVE and self.local else 0)
            if size and start + n > self.cap:
                self._roll()
                size = start = 0
            obj = len(self._objects) - 1
            self._objects[obj][1] = start + n
            self._records[(name, chunk)] = (obj, start, n, crc)
            if not self.local:  # one buffer of the cap's size, filled in place
                need = start + n
                if len(self._segment) < need:
                    grown = bytearray(max(self.cap, need))
                    grown[: self._seg_len] = self._segment[: self._seg_len]
                    self._segment = grown
                pos = start
                for v in views:
                    self._segment[pos : pos + len(v)] = v
                    pos += len(v)
                self._seg_len = need
                return
            fd = self._fds[obj]
        pad = start - size  # written, not left a hole: a sound object is not sparse
        try:
            _pwritev_all(fd, ([memoryview(_ZEROS)[:pad]] if pad else []) + views, size)
        except OSError as e:
            with self._lock:
                self._failed = e
            raise SaveFailedError(
                f"cannot write {self._key(obj)} below {self.store.url}/{self.prefix}: {e}"
            ) from e

    def _roll(self) -> None:
        """Close the current object (lock held): on object stores its segment's PUT starts."""
        if not self.local:
            self._put_segment()
        self._new_object()

    def _put_segment(self) -> None:
        seg = memoryview(self._segment)[: self._seg_len]
        self._segment, self._seg_len = bytearray(), 0
        key = _join(self.prefix, self._objects[-1][0])
        self._slots.acquire()  # at most IN_FLIGHT bytes in flight: memory stays bounded

        def put() -> None:
            try:
                self.store.put(key, [seg])
            finally:
                self._slots.release()

        if self.submit is None:
            put()
            return
        self._puts.append(self.submit(put))

    def read(self, name: str, chunk: int, start: int, length: int) -> bytes:
        """Bytes of a chunk this writer wrote (for a chunk written in parts)."""
        with self._lock:
            obj, off, n, _crc = self._records[(name, chunk)]
            if not self.local and obj == len(self._objects) - 1:
                return bytes(self._segment[off + start : off + min(n, start + length)])
        return self.store.get_range(
            _join(self.prefix, self._objects[obj][0]), off + start, max(0, min(length, n - start))
        )

    def has(self, name: str, chunk: int) -> bool:
        with self._lock:
            return (name, chunk) in self._records

    def finish(self, publish: bool = True) -> bytes:
        """Every object whole and durable, then this writer's index part written (durable
        too): what the coordinator gathers ([SP-PACK-8]); returned too. ``publish=False``
        (the coordinator's own writer, whose part stays in memory): not written."""
        with self._lock:
            if not self.local and self._objects:
                self._put_segment()
            puts, self._puts = self._puts, []
            fds, self._fds = self._fds, []
            objects = [list(o) for o in self._objects]
            records = [[n, c, *r] for (n, c), r in sorted(self._records.items())]
            inner = dict(self.inner)
        try:
            for f in puts:
                f.result()
            for fd in fds:
                if self.fsync:
                    os.fsync(fd)
        finally:
            for fd in fds:
                os.close(fd)
        part: bytes = msgpack.packb(
            {"objects": objects, "records": records, "inner": inner}, use_bin_type=True
        )
        key = _join(self.prefix, f"{PACKED_DIR}/{self.id}.idx")
        if publish:
            self.store.put(key, part)
        if self.local and self.fsync:
            keys = ([key] if publish else []) + [_join(self.prefix, o[0]) for o in objects]
            self.store.make_durable(keys)
        return part

    def abandon(self) -> None:
        """Close what is open (a failed save: the staging location is removed by the abort)."""
        with self._lock:
            fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)


def _pwritev_all(fd: int, views: List[memoryview], at: int) -> None:
    """Write every byte of ``views`` at ``at`` (``pwritev`` may write less than asked)."""
    pos = at
    while views:
        n = os.pwritev(fd, views[:1024], pos)
        pos += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


class ChunkWriteView:
    """What the Zarr layer's ``write_region`` writes to for one array: ``put`` of a chunk
    key appends the chunk to ``writer``; a chunk written in parts is read back from it."""

    capabilities = StoreCapabilities()

    def __init__(self, writer: PackedWriter, name: str, layout: ArrayLayout) -> None:
        self.writer, self.name, self.layout = writer, name, layout
        with writer._lock:
            writer.inner[name] = None if layout.inner is None else list(layout.inner)
        self.url = f"{writer.store.url}#packed:{name}"

    def _chunk(self, key: str) -> int:
        return chunk_number(_cidx(self.name, key), self.layout.shape, self.layout.chunk)

    def put(self, key: str, data: Any, *, if_absent: bool = False) -> Optional[str]:
        if not key.endswith("/zarr.json"):  # the packed layout stores no zarr.json
            self.writer.append(
                self.name, self._chunk(key), data if isinstance(data, list) else [data]
            )
        return None

    def get(self, key: str) -> bytes:
        return self.get_range(key, 0, 1 << 62)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return iter(())

    def delete(self, keys: Iterable[str]) -> None:
        raise PermissionError("chunks of a packed save are not deleted one by one")

    def make_durable(self, keys: Optional[Iterable[str]] = None) -> None:
        return None

    def head(self, key: str) -> Optional[ObjectInfo]:
        return ObjectInfo(key, 0, 0.0) if self.writer.has(self.name, self._chunk(key)) else None

    def get_range(self, key: str, start: int, length: int) -> bytes:
        c = self._chunk(key)
        if not self.writer.has(self.name, c):
            raise FileNotFoundError(2, "not written yet", key)
        return self.writer.read(self.name, c, start, length)

    def get_suffix(self, key: str, length: int) -> Tuple[bytes, int]:
        c = self._chunk(key)
        if not self.writer.has(self.name, c):
            raise FileNotFoundError(2, "not written yet", key)
        n = self.writer._records[(self.name, c)][2]
        return self.writer.read(self.name, c, max(0, n - length), length), n

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        raw = self.get_range(key, start, len(out))
        if len(raw) != len(out):
            raise EOFError(f"{key}: {len(out)} bytes from {start} asked, {len(raw)} there")
        memoryview(out).cast("B")[:] = raw


def gather_parts(
    store: ByteStore, prefix: str, own: Optional[bytes] = None, others: bool = True
) -> Tuple[List[Tuple[str, int]], List[Any], Dict[str, Any], List[str]]:
    """The coordinator's view of every writer's index part below ``prefix``: (the objects,
    each ``(relative path, size)``, sorted; the records ``(array name, chunk, object number,
    offset, length, crc32c)``; array name -> the inner chunk shape its writers used; the keys
    of the parts, to delete once the manifest holds them). ``own``: the coordinator's own
    part, kept in memory; ``others=False``: no other writer (a one-process save), no
    listing."""
    base = _join(prefix, PACKED_DIR) + "/"
    keys = sorted(i.key for i in store.list(base) if i.key.endswith(".idx")) if others else []
    parts = [msgpack.unpackb(store.get(k), raw=False) for k in keys]
    if own is not None:
        parts.append(msgpack.unpackb(own, raw=False))
    objects: List[Tuple[str, int]] = sorted((o[0], int(o[1])) for p in parts for o in p["objects"])
    number = {o: i for i, (o, _s) in enumerate(objects)}
    rows = []
    inner: Dict[str, Any] = {}
    for p in parts:
        inner.update(p["inner"])
        local = [number[o[0]] for o in p["objects"]]
        rows += [(n, c, local[o], off, ln, crc) for n, c, o, off, ln, crc in p["records"]]
    return objects, rows, inner, keys


def build_index(
    objects: List[Tuple[str, int]], rows: List[Any], arrays: Dict[str, Optional[Tuple[int, ...]]]
) -> PackedIndex:
    """The index of a save from the gathered records; ``arrays``: array name -> inner chunk
    shape, in the order the index numbers them."""
    number = {n: i for i, n in enumerate(arrays)}
    unknown = [r[0] for r in rows if r[0] not in number]
    if unknown:
        raise SaveFailedError(
            f"packed save: chunks of array {unknown[0]!r}, which the manifest does not name"
        )
    rec = records_of((number[n], o, c, off, ln, crc) for n, c, o, off, ln, crc in rows)
    return PackedIndex(list(objects), list(arrays.items()), rec)


if TYPE_CHECKING:
    # static check that the write view is a store the Zarr layer writes to
    def _is_bytestore_chunkwriteview(x: ChunkWriteView) -> ByteStore:
        return x
