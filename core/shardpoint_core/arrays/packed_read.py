"""Reading a packed checkpoint (format 1.4, spec/format.md section 13) through the Zarr
layer of :mod:`.array`: :func:`open_packed` checks the objects the array's records name
(regular files, at least their declared size, no unchecked holes: [SP-SEC-5], [SP-SEC-6],
[SP-PACK-7]) and returns a :class:`PackedView`, the store-like object answering the layer's
chunk-key requests from the records' bytes, each checked against its record's crc32c
([SP-PACK-6]); :func:`read_packed` reads a region (adjacent chunks in one ranged read, whole
tensors on local files straight into the destination, :mod:`.packed_direct`).
"""

from __future__ import annotations

import os
import stat
import threading
from collections import OrderedDict
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

import numpy as np

from shardpoint_core.arrays.array import ArrayLayout, _chunks_of, read_chunk, read_region
from shardpoint_core.arrays.direct_write import stored_codecs
from shardpoint_core.arrays.identity import chunk_number
from shardpoint_core.arrays.packed import ALIGN, _bad, _cidx, _join
from shardpoint_core.format.errors import CorruptCheckpointError
from shardpoint_core.format.layout import BYTES_CRC
from shardpoint_core.format.packed import PackedArray
from shardpoint_core.format.spec import ArraySpec
from shardpoint_core.stores.base import ByteStore, ObjectInfo

BLOCK = 8 << 20  # object stores: small chunks are read in aligned blocks this big
BLOCKS_HELD = 16  # blocks kept per backend (128 MiB)
MAX_RUN = 64 << 20  # one ranged read merges adjacent chunks up to this size
MERGE_BELOW = 16 << 20  # chunks this big or bigger are read by the layer's own reads


class BlockCache:
    """Small reads of packed objects on object stores grouped into aligned blocks of
    :data:`BLOCK` bytes: one ranged GET serves every chunk in its block, so a load of many
    small tensors costs requests in proportion to bytes, not tensors (requests, not bytes,
    are what object stores charge for). Concurrent readers of one block share its GET; at
    most :data:`BLOCKS_HELD` blocks are kept. Keys hold the decoded index they belong to, so
    another checkpoint's objects of the same name never read cached bytes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: "OrderedDict[Any, Tuple[Any, Future[bytes]]]" = OrderedDict()

    def read(
        self, store: ByteStore, key: str, size: int, owner: Any, at: int, out: memoryview
    ) -> None:
        """Fill ``out`` from ``at`` of object ``key`` (declared ``size``); EOFError where the
        object is shorter."""
        end = at + len(out)
        for b in range(at // BLOCK, (end - 1) // BLOCK + 1):
            data = self._block(store, key, size, owner, b)
            lo, hi = max(at, b * BLOCK), min(end, (b + 1) * BLOCK)
            if len(data) < hi - b * BLOCK:
                raise EOFError(
                    f"{key}: {len(out)} bytes from {at} asked, the object ends "
                    f"at {b * BLOCK + len(data)}"
                )
            out[lo - at : hi - at] = data[lo - b * BLOCK : hi - b * BLOCK]

    def _block(self, store: ByteStore, key: str, size: int, owner: Any, b: int) -> bytes:
        k = (id(owner), store.url, key, b)  # the value holds ``owner``: no id reuse
        with self._lock:
            got = self._blocks.get(k)
            mine = got is None
            if got is None:
                f: Future[bytes] = Future()
                self._blocks[k] = (owner, f)
                while len(self._blocks) > BLOCKS_HELD:
                    self._blocks.popitem(last=False)
            else:
                f = got[1]
                self._blocks.move_to_end(k)
        if mine:
            try:
                f.set_result(store.get_range(key, b * BLOCK, max(0, min(BLOCK, size - b * BLOCK))))
            except BaseException as e:
                with self._lock:
                    self._blocks.pop(k, None)
                f.set_exception(e)
        return f.result()


class PackedView:
    """The Zarr layer's store for one array of a packed checkpoint: chunk key -> the
    record's bytes in ``store`` below ``prefix``, the record's crc32c checked
    ([SP-PACK-6]). ``cache``: bytes already read for some chunks (:meth:`primed`)."""

    def __init__(
        self,
        store: ByteStore,
        prefix: str,
        part: PackedArray,
        layout: ArrayLayout,
        key: str,
        cache: Optional[Dict[int, memoryview]] = None,
        blocks: Optional[BlockCache] = None,
    ) -> None:
        self.store, self.prefix, self.part, self.layout, self.key = store, prefix, part, layout, key
        self.blocks = blocks
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
            return bytes(hit[start : start + length])
        buf = bytearray(length)  # read in place: no second copy of the bytes
        self._fill(path, c, off + start, memoryview(buf), n, off)
        return buf  # type: ignore[return-value]  # bytes-like

    def _fill(self, path: str, c: int, at: int, out: memoryview, n: int, off: int) -> None:
        try:
            if self.blocks is not None and len(out) < BLOCK:
                size = dict(self.part.objects)[path]
                self.blocks.read(
                    self.store, _join(self.prefix, path), size, self.part.records.base, at, out
                )
                return
            self.store.read_into(_join(self.prefix, path), at, out)
        except EOFError as e:
            raise _bad(
                self.key,
                f"{path} (chunk {c})",
                f"the object ends before the chunk's {n} bytes at {off} (truncated)",
                "SP-READ-3",
            ) from e

    def _check_crc(self, ckey: str, tail: bytes) -> None:
        c, path, _off, _n, crc = self._rec(ckey)
        if len(tail) >= 4 and int.from_bytes(tail[-4:], "little") != crc:
            raise _bad(
                self.key,
                f"{path} (chunk {c})",
                f"its stored crc32c "
                f"{int.from_bytes(tail[-4:], 'little'):08x} is not the {crc:08x} its "
                "record names: the record points at another chunk's bytes",
                "SP-READ-8",
            )

    def get_range(self, key: str, start: int, length: int) -> bytes:
        raw = self._read(key, start, length)
        if start + len(raw) == self._rec(key)[3]:  # the chunk's end: its crc32c
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
            out[:] = hit[start : start + len(out)]
        else:
            self._fill(path, c, off + start, out, n, off)
        if start + len(out) == n:  # the chunk's end: its crc32c
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
        chunks = sorted(
            {
                chunk_number(cidx, lay.shape, lay.chunk)
                for cidx, *_ in _chunks_of(lay, offset, shape)
            }
        )
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
                return  # the per-chunk reads report which chunk is cut short
            for j in run:
                r = recs[j]
                a = int(r["offset"]) - lo
                cache[chunks[j]] = memoryview(buf)[a : a + int(r["length"])]
            run.clear()

        for j in order:
            r = recs[j]
            if run:
                prev = recs[run[-1]]
                end = int(prev["offset"]) + int(prev["length"])
                gap = int(r["offset"]) - end
                if (
                    r["object"] != prev["object"]
                    or not 0 <= gap < ALIGN
                    or int(r["offset"]) + int(r["length"]) - int(recs[run[0]]["offset"]) > MAX_RUN
                ):
                    flush()
            run.append(int(j))
        flush()
        return PackedView(
            self.store, self.prefix, self.part, self.layout, self.key, cache, self.blocks
        )


def check_objects(
    store: ByteStore,
    prefix: str,
    part: PackedArray,
    key: str,
    checked: Dict[str, Any],
    chunk: Sequence[int] = (),
    itemsize: int = 1,
) -> None:
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
            raise _bad(
                key,
                path,
                f"the data object holds {info.size} bytes, the manifest "
                f"declares {size} ([SP-PACK-7])",
                "SP-READ-3",
            )
        sparse = False
        if store.capabilities.local_path:  # [SP-SEC-6]: holes checked before allocating
            from shardpoint_core.arrays.packed_sparse import check_sparse_object

            sparse = check_sparse_object(
                store.path(full),  # type: ignore[attr-defined]
                part,
                o,
                key,
                chunk,
                itemsize,
            )
        checked[seen] = not sparse  # a sparse object: each tensor's records


def _lstat_walk(store: ByteStore, full: str, key: str, path: str) -> None:
    """[SP-SEC-5]: each directory on the way a real one, the object a regular file."""
    root = store.root  # type: ignore[attr-defined]
    p = root
    parts = full.split("/")
    for i, comp in enumerate(parts):
        p = os.path.join(p, comp)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return  # missing: head reports it as SP-READ-2
        last = i == len(parts) - 1
        if (last and not stat.S_ISREG(st.st_mode)) or (not last and not stat.S_ISDIR(st.st_mode)):
            raise _bad(
                key,
                path,
                f"{p} is not a regular {'file' if last else 'directory'} (a link or special file)",
                "SP-SEC-5",
            )


def layout_of(spec: ArraySpec, part: PackedArray, key: str) -> ArrayLayout:
    """The array's layout as its packed entry implies it ([SP-PACK-3]), with the chunk
    table of the manifest ([SP-MAN-7])."""
    lay = ArrayLayout.create(
        spec.shape, spec.dtype, spec.chunk_shape, shard_above_bytes=1 << 62
    )  # the plain chain
    if part.inner is not None:
        codecs = [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": list(part.inner),
                    "codecs": BYTES_CRC,
                    "index_codecs": BYTES_CRC,
                    "index_location": "end",
                },
            }
        ]
        lay = ArrayLayout(
            lay.shape, lay.dtype, lay.chunk, part.inner, stored_codecs(codecs, lay.itemsize)
        )
    return lay.with_table(spec.chunk_crc32c, key, part.name)


def open_packed(
    store: ByteStore, prefix: str, spec: ArraySpec, key: str, checked: Dict[str, Any]
) -> Tuple[PackedView, str, ArrayLayout]:
    """(the chunk view, the array's name, its layout) of a tensor of a packed checkpoint
    below ``prefix`` of ``store``, its objects checked first (:func:`check_objects`)."""
    part = spec.packed
    assert isinstance(part, PackedArray), "not a packed array"
    lay = layout_of(spec, part, key)
    check_objects(store, prefix, part, key, checked, lay.chunk, lay.itemsize)
    blocks = None
    if not store.capabilities.local_path:  # one per backend, kept in its ``checked`` map
        blocks = checked.get("\0blocks")
        if blocks is None:
            blocks = checked["\0blocks"] = BlockCache()
    return PackedView(store, prefix, part, lay, key, blocks=blocks), part.name, lay


def read_packed(
    view: PackedView,
    offset: Sequence[int],
    out: np.ndarray,
    submit: Optional[Callable[..., Any]] = None,
) -> list[Any]:
    """Fill ``out`` with the region at ``offset``: adjacent chunks in one read each
    (:meth:`PackedView.primed`), then the Zarr layer's reads and checks; with ``submit``,
    chunks and runs of inner chunks in parallel (their futures returned, as
    :func:`~.array.read_region` does)."""
    from shardpoint_core.arrays import packed_direct

    if packed_direct.applies(view, offset, out):  # straight into ``out`` (local files)
        return packed_direct.read_whole(view, out, submit)
    try:
        primed = view.primed(tuple(offset), out.shape)
        return _locating(
            view, read_region(primed, view.part.name, view.layout, offset, out, view.key, submit)
        )
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
                g.set_exception(located(view, e) if isinstance(e, CorruptCheckpointError) else e)

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
    tail = msg[at + len(view.part.name) + 2 :].split(" ", 1)[0].rstrip(":")
    try:
        cidx = tuple(int(p) for p in tail.split("/")[1:]) if tail else ()
        c = chunk_number(cidx, view.layout.shape, view.layout.chunk)
        path, off, n, _crc = view.part.chunk(c)
    except (ValueError, IndexError):
        return e
    text = msg.split("] ", 1)[1] if e.spec_id and msg.startswith(f"[{e.spec_id}]") else msg
    return type(e)(
        f"{text} (chunk {c}: bytes {off}..{off + n} of data object {path})", spec_id=e.spec_id
    )


def verify_packed(view: PackedView) -> list[Any]:
    """Every chunk of the array read and checked: one ``(spec ID, message)`` per problem."""
    problems = []
    lay = view.layout
    for cidx in np.ndindex(*lay.grid()) if lay.shape else [()]:
        try:
            read_chunk(view, view.part.name, lay, cidx, view.key)
        except CorruptCheckpointError as e:
            problems.append((e.spec_id or "SP-READ-3", f"chunk {list(cidx)}: {located(view, e)}"))
    return problems


if TYPE_CHECKING:
    # static check that the view is a store the Zarr layer reads
    def _is_bytestore_packedview(x: PackedView) -> ByteStore:
        return x
