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
- Incremental saves ([SP-PACK-9], [SP-PACK-10]): with ``hashes`` each chunk's BLAKE3/128 is
  computed in the writing thread; a chunk whose length, crc32c and hash equal the base's
  record for it (its *candidate*, :class:`ChunkWriteView`) is not written: the writer keeps
  a reference to the base's bytes (their owner, object, offset) instead.
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
from shardpoint_core.format.manifest import key_of_array_path
from shardpoint_core.format.packed import (
    HASH_BYTES,
    PackedArray,
    PackedIndex,
    chunk_hash,
    records_of,
)
from shardpoint_core.stores.base import ByteStore, ObjectInfo, StoreCapabilities
from shardpoint_core.stores.files import start_writeback
from shardpoint_core.stores.fsutil import os_error_text

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
        hashes: bool = False,
        base_read: Optional[Callable[[str, str, int, int], bytes]] = None,
    ) -> None:
        self.store, self.prefix, self.fsync = store, prefix, fsync
        self.hashes = hashes
        #: (owner, object path, offset, length) -> bytes of a base's object: a chunk that
        #: refers to a base and is written again in parts reads its bytes there
        self.base_read = base_read
        self._refs: Dict[Tuple[str, int], Tuple[Any, ...]] = {}
        self._hashes: Dict[Tuple[str, int], bytes] = {}
        self.local = bool(store.capabilities.local_path)
        self.cap = cap or (FILE_CAP if self.local else OBJECT_CAP)
        self.id = writer_id or secrets.token_hex(8)
        self.submit = submit
        self._lock = threading.Lock()
        self._objects: List[List[Any]] = []  # [relative key, size]
        self._records: Dict[Tuple[str, int], Tuple[int, int, int, bytes]] = {}
        #: array name -> inner chunk shape (None: the plain chain; 1.5: a dict, the codec
        #: object of the compressed chain)
        self.inner: Dict[str, Any] = {}
        self._fds: List[int] = []
        self._segment = bytearray()  # object stores: the object being filled
        self._seg_len = 0
        self._puts: List[Future[Any]] = []
        self._slots = threading.Semaphore(max(2, IN_FLIGHT // self.cap))
        self._failed: Optional[SaveFailedError] = None  # the first failed write

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

    def append(
        self,
        name: str,
        chunk: int,
        bufs: Sequence[Any],
        candidate: Optional[Tuple[Any, ...]] = None,
    ) -> None:
        """Store the encoded chunk ``chunk`` of array ``name`` (its buffers, in order), or,
        where ``candidate`` (a base's ``(owner, identity, object path, object size, offset,
        length, crc32c bytes, hash)`` for this chunk) holds the same bytes by length, crc32c
        and hash, refer to it instead ([SP-PACK-9])."""
        views = [memoryview(b).cast("B") for b in bufs]
        n = sum(len(v) for v in views)
        crc = bytes(views[-1][-4:]) if n >= 4 else b"\0\0\0\0"
        h = chunk_hash(views) if self.hashes else None  # outside the lock: threads in parallel
        with self._lock:
            if self._failed is not None:  # the first failure again: its tensor, file and fix
                raise SaveFailedError(str(self._failed)) from self._failed.__cause__
            if h is not None:
                self._hashes[(name, chunk)] = h
            if candidate is not None and (candidate[5], candidate[6], candidate[7]) == (n, crc, h):
                self._records.pop((name, chunk), None)
                self._refs[(name, chunk)] = candidate
                return
            self._refs.pop((name, chunk), None)
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
            if self.fsync:  # the disk starts on it now, not all at the final fsync
                start_writeback(fd, size, start + n - size)
        except OSError as e:
            err = self._write_failed(name, chunk, obj, e)
            with self._lock:
                self._failed = self._failed or err
            raise err from err.__cause__

    def _write_failed(self, name: str, chunk: int, obj: int, e: OSError) -> SaveFailedError:
        """A failed write of chunk ``chunk`` of array ``name`` as the documented error: the
        tensor, the data object's file and the cause with its fix, as the per-array layout
        names the chunk file it could not write (its ``__cause__``: ``e`` with that file)."""
        path = self.store.path(_join(self.prefix, self._key(obj)))  # type: ignore[attr-defined]
        cause = OSError(e.errno, e.strerror, path) if e.strerror else e
        key = key_of_array_path(name)
        what = f"tensor {key!r}" if key is not None else f"array {name!r}"
        err = SaveFailedError(
            f"{what}: cannot write chunk {chunk} of array {name!r}: {os_error_text(cause)}"
        )
        err.__cause__ = cause
        return err

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
            ref = self._refs.get((name, chunk))
            if ref is not None:
                assert self.base_read is not None, "a reference without its base"
                n = ref[5]
                return self.base_read(
                    ref[0], ref[2], ref[4] + start, max(0, min(length, n - start))
                )
            obj, off, n, _crc = self._records[(name, chunk)]
            if not self.local and obj == len(self._objects) - 1:
                return bytes(self._segment[off + start : off + min(n, start + length)])
        return self.store.get_range(
            _join(self.prefix, self._objects[obj][0]), off + start, max(0, min(length, n - start))
        )

    def has(self, name: str, chunk: int) -> bool:
        with self._lock:
            return (name, chunk) in self._records or (name, chunk) in self._refs

    def length(self, name: str, chunk: int) -> int:
        """The stored length of a chunk this writer holds (written or referred to)."""
        with self._lock:
            ref = self._refs.get((name, chunk))
            return int(ref[5]) if ref is not None else self._records[(name, chunk)][2]

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
            hashes = self._hashes
            records = [
                [n, c, *r] + ([hashes[(n, c)]] if self.hashes else [])
                for (n, c), r in sorted(self._records.items())
            ]
            refs = [[n, c, *r] for (n, c), r in sorted(self._refs.items())]
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
        body: Dict[str, Any] = {"objects": objects, "records": records, "inner": inner}
        if refs:
            body["refs"] = refs
        part: bytes = msgpack.packb(body, use_bin_type=True)
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

    def __init__(
        self,
        writer: PackedWriter,
        name: str,
        layout: ArrayLayout,
        base: Optional[PackedArray] = None,
        owners: Sequence[Tuple[str, bytes, str, int]] = (),
    ) -> None:
        self.writer, self.name, self.layout = writer, name, layout
        #: (incremental) the base's part for this array and its objects' owners
        self.base, self.owners = base, owners
        with writer._lock:  # (1.5) a compressed chain: its zstd codec object ([SP-PACK-12])
            writer.inner[name] = (
                dict(layout.codecs[1])
                if layout.zstd_level is not None
                else None
                if layout.inner is None
                else list(layout.inner)
            )
        self.url = f"{writer.store.url}#packed:{name}"

    def _chunk(self, key: str) -> int:
        return chunk_number(_cidx(self.name, key), self.layout.shape, self.layout.chunk)

    def put(self, key: str, data: Any, *, if_absent: bool = False) -> Optional[str]:
        if not key.endswith("/zarr.json"):  # the packed layout stores no zarr.json
            c = self._chunk(key)
            self.writer.append(
                self.name, c, data if isinstance(data, list) else [data], self._candidate(c)
            )
        return None

    def _candidate(self, c: int) -> Optional[Tuple[Any, ...]]:
        """The base's record of chunk ``c`` as a reference (owner, identity, object path,
        object size, offset, length, crc32c bytes, hash), None without a base."""
        if self.base is None or self.base.hashes is None:
            return None
        r = self.base.records[c]
        owner, ident, path, size = self.owners[int(r["object"])]
        return (
            owner,
            ident,
            path,
            size,
            int(r["offset"]),
            int(r["length"]),
            int(r["crc32c"]).to_bytes(4, "little"),
            bytes(self.base.hashes[c]),
        )

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
        n = self.writer.length(self.name, c)
        return self.writer.read(self.name, c, max(0, n - length), length), n

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        raw = self.get_range(key, start, len(out))
        if len(raw) != len(out):
            raise EOFError(f"{key}: {len(out)} bytes from {start} asked, {len(raw)} there")
        memoryview(out).cast("B")[:] = raw


def gather_parts(
    store: ByteStore, prefix: str, own: Optional[bytes] = None, others: bool = True
) -> Tuple[List[Tuple[str, int]], List[Any], Dict[str, Any], List[str], List[Any]]:
    """The coordinator's view of every writer's index part below ``prefix``: (the objects,
    each ``(relative path, size)``, sorted; the records ``(array name, chunk, object number,
    offset, length, crc32c[, hash])``; array name -> the inner chunk shape its writers used;
    the keys of the parts, to delete once the manifest holds them; the references to bases,
    ``(array name, chunk, owner, identity, object path, object size, offset, length, crc32c,
    hash)``). ``own``: the coordinator's own part, kept in memory; ``others=False``: no
    other writer (a one-process save), no listing."""
    base = _join(prefix, PACKED_DIR) + "/"
    keys = sorted(i.key for i in store.list(base) if i.key.endswith(".idx")) if others else []
    parts = [msgpack.unpackb(store.get(k), raw=False) for k in keys]
    if own is not None:
        parts.append(msgpack.unpackb(own, raw=False))
    objects: List[Tuple[str, int]] = sorted((o[0], int(o[1])) for p in parts for o in p["objects"])
    number = {o: i for i, (o, _s) in enumerate(objects)}
    rows = []
    refs: List[Any] = []
    inner: Dict[str, Any] = {}
    for p in parts:
        inner.update(p["inner"])
        local = [number[o[0]] for o in p["objects"]]
        rows += [(r[0], r[1], local[r[2]], *r[3:]) for r in p["records"]]
        refs += [tuple(r) for r in p.get("refs", ())]
    return objects, rows, inner, keys, refs


def build_index(
    objects: List[Tuple[str, int]],
    rows: List[Any],
    arrays: Dict[str, Any],
    refs: Sequence[Any] = (),
    hashes: bool = False,
) -> PackedIndex:
    """The index of a save from the gathered records; ``arrays``: array name -> inner chunk
    shape (None: the plain chain; 1.5: a dict, the codec object of the compressed chain,
    [SP-PACK-12]), in the order the index numbers them. ``refs``: records of chunks left in bases
    (:func:`gather_parts`): their owners become the index's bases and their objects follow
    the save's own ([SP-PACK-9]). ``hashes``: every record carries its hash ([SP-PACK-10])."""
    number = {n: i for i, n in enumerate(arrays)}
    unknown = [r[0] for r in list(rows) + list(refs) if r[0] not in number]
    if unknown:
        raise SaveFailedError(
            f"packed save: chunks of array {unknown[0]!r}, which the manifest does not name"
        )
    idents: Dict[str, bytes] = {}
    for r in refs:
        if idents.setdefault(r[2], r[3]) != r[3]:
            raise SaveFailedError(
                f"packed save: base {r[2]!r} seen with two identities (a base replaced while "
                "the save ran); nothing was committed"
            )
    bases = sorted(idents.items())
    bnum = {n: i for i, (n, _i) in enumerate(bases)}
    bobjs = sorted({(r[2], r[4], int(r[5])) for r in refs})
    onum = {(o, p): len(objects) + i for i, (o, p, _s) in enumerate(bobjs)}
    all_objects = list(objects) + [(p, s) for _o, p, s in bobjs]
    owners: Optional[List[Optional[int]]] = None
    if bases:
        owners = [None] * len(objects) + [bnum[o] for o, _p, _s in bobjs]
    own = [(number[r[0]], r[2], r[1], r[3], r[4], r[5]) for r in rows]
    shared = [(number[r[0]], onum[(r[2], r[4])], r[1], r[6], r[7], r[8]) for r in refs]
    rec = records_of(own + shared)
    digests = None
    if hashes:
        got = [r[6] if len(r) > 6 else None for r in rows] + [r[9] for r in refs]
        good = [h for h in got if isinstance(h, bytes) and len(h) == HASH_BYTES]
        if len(good) != len(got):
            raise SaveFailedError("packed save: a chunk without its hash (a writer without hashes)")
        digests = b"".join(good)
    codecs = [dict(i) if isinstance(i, dict) else None for i in arrays.values()]
    listed = [(n, None if isinstance(i, dict) else i) for n, i in arrays.items()]
    return PackedIndex(
        all_objects,
        listed,
        rec,
        bases,
        owners,
        digests,
        codecs if any(c is not None for c in codecs) else None,
    )


if TYPE_CHECKING:
    # static check that the write view is a store the Zarr layer writes to
    def _is_bytestore_chunkwriteview(x: ChunkWriteView) -> ByteStore:
        return x
