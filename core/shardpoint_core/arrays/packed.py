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
  when it reaches the size cap, at most two segments in flight, the last at ``finish``.
  ``finish`` also writes the writer's index part ``packed/<writer>.idx`` (msgpack), which
  the coordinator gathers into the manifest (:func:`gather_parts`) and deletes.
- Reading (:func:`open_packed`): the objects the array's records name are checked first
  (regular files, at least their declared size: [SP-SEC-5], [SP-PACK-7]); chunks are then
  read by range, a region's chunks that lie back to back in an object in one read
  (:meth:`PackedView.primed`), each checked against its record's crc32c ([SP-PACK-6]).
"""
from __future__ import annotations

import os
import secrets
import stat
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import msgpack
import numpy as np

from shardpoint_core.arrays.array import (ArrayLayout, _chunks_of, read_chunk,
                                          read_region)
from shardpoint_core.arrays.direct_write import stored_codecs
from shardpoint_core.arrays.identity import chunk_number
from shardpoint_core.format.errors import CorruptCheckpointError, SaveFailedError
from shardpoint_core.format.layout import BYTES_CRC
from shardpoint_core.format.packed import PackedArray, PackedIndex, records_of
from shardpoint_core.format.spec import ArraySpec
from shardpoint_core.stores.base import ByteStore, ObjectInfo, StoreCapabilities

PACKED_DIR = "packed"
ALIGN = 4096                   # chunks of ALIGN_ABOVE bytes and more start on this boundary
ALIGN_ABOVE = 256 << 10
FILE_CAP = 1 << 40             # files: split only for truly huge writers
OBJECT_CAP = 256 << 20         # object stores: one object per 256 MiB of a writer's chunks
MAX_RUN = 64 << 20             # one ranged read merges adjacent chunks up to this size
_ZEROS = bytes(ALIGN)
MERGE_BELOW = 16 << 20         # chunks this big or bigger are read by the layer's own reads


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


def _cidx(name: str, key: str) -> tuple[int, ...]:
    """The chunk index of chunk key ``key`` of array ``name`` (``name/c/i/j``)."""
    rest = key[len(name) + 2:]
    return tuple(int(p) for p in rest.split("/")[1:]) if rest else ()


def _bad(key: str, where: str, msg: str, sid: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"tensor {key!r}: {where}: {msg}", spec_id=sid)


# ------------------------------------------------------------------------------ writing
class PackedWriter:
    """One process's data objects in one save below ``prefix`` of ``store``; thread-safe.
    ``cap``: bytes after which a new object starts (default by store kind)."""

    def __init__(self, store: ByteStore, prefix: str, *, cap: Optional[int] = None,
                 fsync: bool = True, submit: Optional[Callable[..., Future[Any]]] = None,
                 writer_id: Optional[str] = None) -> None:
        self.store, self.prefix, self.fsync = store, prefix, fsync
        self.local = bool(store.capabilities.local_path)
        self.cap = cap or (FILE_CAP if self.local else OBJECT_CAP)
        self.id = writer_id or secrets.token_hex(8)
        self.submit = submit
        self._lock = threading.Lock()
        self._objects: List[List[Any]] = []        # [relative key, size]
        self._records: Dict[Tuple[str, int], Tuple[int, int, int, bytes]] = {}
        self.inner: Dict[str, Optional[List[int]]] = {}   # array name -> inner chunk shape
        self._fds: List[int] = []
        self._segment = bytearray()
        self._puts: List[Future[Any]] = []
        self._slots = threading.Semaphore(2)
        self._failed: Optional[BaseException] = None

    def _key(self, n: int) -> str:
        return f"{PACKED_DIR}/{self.id}-{n}.bin"

    def _new_object(self) -> None:
        """Start object number ``len(self._objects)`` (lock held)."""
        key = self._key(len(self._objects))
        if self.local:
            path = self.store.path(_join(self.prefix, key))  # type: ignore[attr-defined]
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._fds.append(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                                     | getattr(os, "O_CLOEXEC", 0), 0o644))
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
            if not self.local:
                self._segment += b"\0" * (start - size)
                for v in views:
                    self._segment += v
                return
            fd = self._fds[obj]
        pad = start - size        # written, not left a hole: a sound object is not sparse
        try:
            _pwritev_all(fd, ([memoryview(_ZEROS)[:pad]] if pad else []) + views, size)
        except OSError as e:
            with self._lock:
                self._failed = e
            raise SaveFailedError(f"cannot write {self._key(obj)} below {self.store.url}/"
                                  f"{self.prefix}: {e}") from e

    def _roll(self) -> None:
        """Close the current object (lock held): on object stores its segment's PUT starts."""
        if not self.local:
            self._put_segment()
        self._new_object()

    def _put_segment(self) -> None:
        seg, self._segment = self._segment, bytearray()
        key = _join(self.prefix, self._objects[-1][0])
        self._slots.acquire()         # at most two segments in flight: memory stays bounded

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
                return bytes(self._segment[off + start:off + min(n, start + length)])
        return self.store.get_range(_join(self.prefix, self._objects[obj][0]), off + start,
                                    max(0, min(length, n - start)))

    def has(self, name: str, chunk: int) -> bool:
        with self._lock:
            return (name, chunk) in self._records

    def finish(self) -> None:
        """Every object whole and durable, then this writer's index part written (durable
        too): what the coordinator gathers ([SP-PACK-8])."""
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
        part = msgpack.packb({"objects": objects, "records": records, "inner": inner},
                             use_bin_type=True)
        key = _join(self.prefix, f"{PACKED_DIR}/{self.id}.idx")
        self.store.put(key, part)
        if self.local:
            keys = [key] + [_join(self.prefix, o[0]) for o in objects]
            self.store.make_durable(keys) if self.fsync else None

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
        if not key.endswith("/zarr.json"):       # the packed layout stores no zarr.json
            self.writer.append(self.name, self._chunk(key), data if isinstance(data, list)
                               else [data])
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
        return ObjectInfo(key, 0, 0.0) if self.writer.has(self.name, self._chunk(key)) \
            else None

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


def gather_parts(store: ByteStore, prefix: str) -> Tuple[List[Tuple[str, int]], List[Any],
                                                          Dict[str, Any], List[str]]:
    """The coordinator's view of every writer's index part below ``prefix``: (the objects,
    each ``(relative path, size)``, sorted; the records ``(array name, chunk, object number,
    offset, length, crc32c)``; array name -> the inner chunk shape its writers used; the keys
    of the parts, to delete once the manifest holds them)."""
    base = _join(prefix, PACKED_DIR) + "/"
    keys = sorted(i.key for i in store.list(base) if i.key.endswith(".idx"))
    parts = [msgpack.unpackb(store.get(k), raw=False) for k in keys]
    objects: List[Tuple[str, int]] = sorted(
        (o[0], int(o[1])) for p in parts for o in p["objects"])
    number = {o: i for i, (o, _s) in enumerate(objects)}
    rows = []
    inner: Dict[str, Any] = {}
    for p in parts:
        inner.update(p["inner"])
        local = [number[o[0]] for o in p["objects"]]
        rows += [(n, c, local[o], off, ln, crc) for n, c, o, off, ln, crc in p["records"]]
    return objects, rows, inner, keys


def build_index(objects: List[Tuple[str, int]], rows: List[Any],
                arrays: Dict[str, Optional[Tuple[int, ...]]]) -> PackedIndex:
    """The index of a save from the gathered records; ``arrays``: array name -> inner chunk
    shape, in the order the index numbers them."""
    number = {n: i for i, n in enumerate(arrays)}
    unknown = [r[0] for r in rows if r[0] not in number]
    if unknown:
        raise SaveFailedError(f"packed save: chunks of array {unknown[0]!r}, which the "
                              "manifest does not name")
    rec = records_of((number[n], o, c, off, ln, crc) for n, c, o, off, ln, crc in rows)
    return PackedIndex(list(objects), list(arrays.items()), rec)


# ------------------------------------------------------------------------------ reading
class PackedView:
    """The Zarr layer's store for one array of a packed checkpoint: chunk key -> the
    record's bytes in ``store`` below ``prefix``, the record's crc32c checked
    ([SP-PACK-6]). ``cache``: bytes already read for some chunks (:meth:`primed`)."""

    def __init__(self, store: ByteStore, prefix: str, part: PackedArray, layout: ArrayLayout,
                 key: str, cache: Optional[Dict[int, memoryview]] = None) -> None:
        self.store, self.prefix, self.part, self.layout, self.key = \
            store, prefix, part, layout, key
        self.capabilities = store.capabilities
        self.url = store.url
        self.cache = cache or {}

    def _rec(self, ckey: str) -> Tuple[int, str, int, int, int]:
        c = chunk_number(_cidx(self.part.name, ckey), self.layout.shape, self.layout.chunk)
        path, off, n, crc = self.part.chunk(c)
        return c, path, off, n, crc

    def _read(self, ckey: str, start: int, length: int) -> bytes:
        c, path, off, n, crc = self._rec(ckey)
        length = max(0, min(length, n - start))
        hit = self.cache.get(c)
        if hit is not None:
            return bytes(hit[start:start + length])
        buf = bytearray(length)          # read in place: no second copy of the bytes
        self._fill(path, c, off + start, memoryview(buf), n, off)
        return buf                       # type: ignore[return-value]  # bytes-like

    def _fill(self, path: str, c: int, at: int, out: memoryview, n: int, off: int) -> None:
        try:
            self.store.read_into(_join(self.prefix, path), at, out)
        except EOFError as e:
            raise _bad(self.key, f"{path} (chunk {c})", f"the object ends before the "
                       f"chunk's {n} bytes at {off} (truncated)", "SP-READ-3") from e

    def _check_crc(self, ckey: str, tail: bytes) -> None:
        c, path, _off, _n, crc = self._rec(ckey)
        if len(tail) >= 4 and int.from_bytes(tail[-4:], "little") != crc:
            raise _bad(self.key, f"{path} (chunk {c})", f"its stored crc32c "
                       f"{int.from_bytes(tail[-4:], 'little'):08x} is not the {crc:08x} its "
                       "record names: the record points at another chunk's bytes",
                       "SP-READ-8")

    def get_range(self, key: str, start: int, length: int) -> bytes:
        raw = self._read(key, start, length)
        if start + len(raw) == self._rec(key)[3]:      # the chunk's end: its crc32c
            self._check_crc(key, raw)
        return raw

    def get_suffix(self, key: str, length: int) -> Tuple[bytes, int]:
        n = self._rec(key)[3]
        raw = self._read(key, max(0, n - length), length)
        self._check_crc(key, raw)
        return raw, n

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        out = memoryview(out).cast("B")
        c, path, off, n, _crc = self._rec(key)
        if start + len(out) > n:
            raise EOFError(f"{key}: {len(out)} bytes from {start} asked, the chunk has {n}")
        hit = self.cache.get(c)
        if hit is not None:
            out[:] = hit[start:start + len(out)]
        else:
            self._fill(path, c, off + start, out, n, off)
        if start + len(out) == n:          # the chunk's end: its crc32c
            self._check_crc(key, bytes(out[-4:]))

    def head(self, key: str) -> Optional[ObjectInfo]:
        return ObjectInfo(key, self._rec(key)[3], 0.0)

    def get(self, key: str) -> bytes:
        return self.get_range(key, 0, self._rec(key)[3])

    def put(self, key: str, data: Any, *, if_absent: bool = False) -> Optional[str]:
        raise PermissionError(f"{key}: a packed checkpoint is read-only")

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return iter(())

    def delete(self, keys: Iterable[str]) -> None:
        raise PermissionError("a packed checkpoint is read-only")

    def make_durable(self, keys: Optional[Iterable[str]] = None) -> None:
        return None

    def primed(self, offset: Sequence[int], shape: Sequence[int]) -> "PackedView":
        """This view with the chunks a read of the box already read: chunks that lie back
        to back in one object (up to :data:`MAX_RUN` bytes) in one ranged read each. A
        chunk of :data:`MERGE_BELOW` bytes or more is left to the layer, which reads a shard
        by its index and runs of inner chunks (no copy of the whole chunk held at once)."""
        lay = self.layout
        chunks = sorted({chunk_number(cidx, lay.shape, lay.chunk)
                         for cidx, *_ in _chunks_of(lay, offset, shape)})
        chunks = [c for c in chunks if int(self.part.records[c]["length"]) < MERGE_BELOW]
        if len(chunks) < 2:
            return self
        recs = self.part.records[chunks]
        order = np.lexsort((recs["offset"], recs["object"]))
        cache: Dict[int, memoryview] = {}
        run: List[int] = []

        def flush() -> None:
            if not run:
                return
            first, last = recs[run[0]], recs[run[-1]]
            lo, hi = int(first["offset"]), int(last["offset"]) + int(last["length"])
            path = self.part.objects[int(first["object"])][0]
            buf = np.empty(hi - lo, np.uint8)
            try:
                self.store.read_into(_join(self.prefix, path), lo, memoryview(buf))
            except EOFError:
                return             # the per-chunk reads report which chunk is cut short
            for j in run:
                r = recs[j]
                a = int(r["offset"]) - lo
                cache[chunks[j]] = memoryview(buf)[a:a + int(r["length"])]
            run.clear()

        for j in order:
            r = recs[j]
            if run:
                prev = recs[run[-1]]
                end = int(prev["offset"]) + int(prev["length"])
                gap = int(r["offset"]) - end
                if r["object"] != prev["object"] or not 0 <= gap < ALIGN or \
                        int(r["offset"]) + int(r["length"]) - int(recs[run[0]]["offset"]) \
                        > MAX_RUN:
                    flush()
            run.append(int(j))
        flush()
        return PackedView(self.store, self.prefix, self.part, self.layout, self.key, cache)


def check_objects(store: ByteStore, prefix: str, part: PackedArray, key: str,
                  checked: Dict[str, Any], chunk: Sequence[int] = (),
                  itemsize: int = 1) -> None:
    """Every object the array's records name exists, is a regular file below real
    directories on local files, and holds at least its declared size, before anything is
    allocated for the tensor ([SP-SEC-5], [SP-PACK-7]; missing: [SP-READ-2]). ``checked``:
    objects found sound already (path -> True), so a load checks each once."""
    if len(checked) > 4096:
        checked.clear()
    for o in part.object_numbers():
        path, size = part.objects[o]
        full = _join(prefix, path)
        seen = f"{store.url}/{full}:{size}"
        if checked.get(seen):
            continue
        if store.capabilities.local_path:
            _lstat_walk(store, full, key, path)
        info = store.head(full)
        if info is None:
            raise _bad(key, path, "the data object is missing", "SP-READ-2")
        if info.size < size:
            raise _bad(key, path, f"the data object holds {info.size} bytes, the manifest "
                       f"declares {size} ([SP-PACK-7])", "SP-READ-3")
        sparse = False
        if store.capabilities.local_path:     # [SP-SEC-6]: holes checked before allocating
            from shardpoint_core.arrays.packed_sparse import check_sparse_object
            sparse = check_sparse_object(store.path(full), part, o, key,  # type: ignore[attr-defined]
                                         chunk, itemsize)
        checked[seen] = not sparse            # a sparse object: each tensor's records


def _lstat_walk(store: ByteStore, full: str, key: str, path: str) -> None:
    """[SP-SEC-5]: each directory on the way a real one, the object a regular file."""
    root = store.root                   # type: ignore[attr-defined]
    p = root
    parts = full.split("/")
    for i, comp in enumerate(parts):
        p = os.path.join(p, comp)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return                       # missing: head reports it as SP-READ-2
        last = i == len(parts) - 1
        if (last and not stat.S_ISREG(st.st_mode)) or (not last and not stat.S_ISDIR(st.st_mode)):
            raise _bad(key, path, f"{p} is not a regular {'file' if last else 'directory'} "
                       "(a link or special file)", "SP-SEC-5")


def layout_of(spec: ArraySpec, part: PackedArray, key: str) -> ArrayLayout:
    """The array's layout as its packed entry implies it ([SP-PACK-3]), with the chunk
    table of the manifest ([SP-MAN-7])."""
    lay = ArrayLayout.create(spec.shape, spec.dtype, spec.chunk_shape,
                             shard_above_bytes=1 << 62)       # the plain chain
    if part.inner is not None:
        codecs = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": list(part.inner), "codecs": BYTES_CRC, "index_codecs": BYTES_CRC,
            "index_location": "end"}}]
        lay = ArrayLayout(lay.shape, lay.dtype, lay.chunk, part.inner,
                          stored_codecs(codecs, lay.itemsize))
    return lay.with_table(spec.chunk_crc32c, key, part.name)


def open_packed(store: ByteStore, prefix: str, spec: ArraySpec, key: str,
                checked: Dict[str, Any]) -> Tuple[PackedView, str, ArrayLayout]:
    """(the chunk view, the array's name, its layout) of a tensor of a packed checkpoint
    below ``prefix`` of ``store``, its objects checked first (:func:`check_objects`)."""
    part = spec.packed
    assert isinstance(part, PackedArray), "not a packed array"
    lay = layout_of(spec, part, key)
    check_objects(store, prefix, part, key, checked, lay.chunk, lay.itemsize)
    return PackedView(store, prefix, part, lay, key), part.name, lay


def read_packed(view: PackedView, offset: Sequence[int], out: np.ndarray,
                submit: Optional[Callable[..., Any]] = None) -> list[Any]:
    """Fill ``out`` with the region at ``offset``: adjacent chunks in one read each
    (:meth:`PackedView.primed`), then the Zarr layer's reads and checks; with ``submit``,
    chunks and runs of inner chunks in parallel (their futures returned, as
    :func:`~.array.read_region` does)."""
    from shardpoint_core.arrays import packed_direct
    if packed_direct.applies(view, offset, out):    # straight into ``out`` (local files)
        return packed_direct.read_whole(view, out, submit)
    try:
        primed = view.primed(tuple(offset), out.shape)
        return _locating(view, read_region(primed, view.part.name, view.layout, offset, out,
                                           view.key, submit))
    except CorruptCheckpointError as e:
        raise located(view, e) from e


def _locating(view: PackedView, futures: list[Any]) -> list[Any]:
    """``futures`` (results possibly lists of more) whose errors name the data object."""
    out = []
    for f in futures:
        g: Future[Any] = Future()

        def done(f: Future[Any], g: Future[Any] = g) -> None:
            e = f.exception()
            if e is None:
                r = f.result()
                g.set_result(_locating(view, r) if isinstance(r, list) else r)
            else:
                g.set_exception(located(view, e) if isinstance(e, CorruptCheckpointError)
                                else e)
        f.add_done_callback(done)
        out.append(g)
    return out


def located(view: PackedView, e: CorruptCheckpointError) -> CorruptCheckpointError:
    """``e`` (the Zarr layer's error, naming a chunk key) also naming the data object and
    the bytes of the chunk: the file a person opens to look at the damage."""
    msg = str(e)
    at = msg.find(view.part.name + "/c")
    if at < 0 or "packed/" in msg:
        return e
    tail = msg[at + len(view.part.name) + 2:].split(" ", 1)[0].rstrip(":")
    try:
        cidx = tuple(int(p) for p in tail.split("/")[1:]) if tail else ()
        c = chunk_number(cidx, view.layout.shape, view.layout.chunk)
        path, off, n, _crc = view.part.chunk(c)
    except (ValueError, IndexError):
        return e
    text = msg.split("] ", 1)[1] if e.spec_id and msg.startswith(f"[{e.spec_id}]") else msg
    return type(e)(f"{text} (chunk {c}: bytes {off}..{off + n} of data object {path})",
                   spec_id=e.spec_id)


def verify_packed(view: PackedView) -> list[Any]:
    """Every chunk of the array read and checked: one ``(spec ID, message)`` per problem."""
    problems = []
    lay = view.layout
    for cidx in np.ndindex(*lay.grid()) if lay.shape else [()]:
        try:
            read_chunk(view, view.part.name, lay, cidx, view.key)
        except CorruptCheckpointError as e:
            problems.append((e.spec_id or "SP-READ-3",
                             f"chunk {list(cidx)}: {located(view, e)}"))
    return problems


if TYPE_CHECKING:
    # static checks that the views are the stores the Zarr layer reads and writes
    def _is_bytestore_packedview(x: PackedView) -> ByteStore:
        return x

    def _is_bytestore_chunkwriteview(x: ChunkWriteView) -> ByteStore:
        return x
