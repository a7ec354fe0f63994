"""Reading a packed checkpoint (format 1.4, spec/format.md section 13) through the Zarr
layer of :mod:`.array`: :func:`open_packed` checks the objects the array's records name
(regular files, at least their declared size, no unchecked holes: [SP-SEC-5], [SP-SEC-6],
[SP-PACK-7]; :mod:`.packed_checks`) and returns a :class:`PackedView`, the store-like object answering the layer's
chunk-key requests from the records' bytes, each checked against its record's crc32c
([SP-PACK-6]); :class:`ReadBatch` plans the reads of many boxes of many tensors together
(the small chunks they need merged into large ranged reads across tensors) and
:func:`read_packed` reads one box (whole tensors of big chunks on local files straight into
the destination, :mod:`.packed_direct`).
"""

from __future__ import annotations

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

import numpy as np

from shardpoint_core.arrays.array import ArrayLayout, read_chunk, read_region
from shardpoint_core.arrays.direct_write import stored_codecs
from shardpoint_core.arrays.identity import chunk_number
from shardpoint_core.arrays.packed import _bad, _cidx, _join
from shardpoint_core.arrays.packed_checks import check_objects
from shardpoint_core.arrays.packed_runs import _Piece, plan_runs
from shardpoint_core.format.errors import CorruptCheckpointError, UnsupportedFormatError
from shardpoint_core.format.layout import BYTES_CRC
from shardpoint_core.format.packed import PackedArray, is_zstd
from shardpoint_core.format.spec import ArraySpec
from shardpoint_core.stores.base import ByteStore, ObjectInfo


class ReadBatch:
    """Reads of packed tensors held until the caller starts them (``start``: a wait, or
    :meth:`~shardpoint_core.transactions.reader.CheckpointReader.start_reads`), then
    planned together ([SP-PACK-6]: adjacent ranges MAY be merged): the small chunks that
    the boxes need, of every tensor, merged into a few large ranged reads per data object
    (:func:`~.packed_runs.plan_runs`: its size limits and gap limit), each one ``preadv``
    on files or ranged GET on object stores; nothing else of the objects is read. A load of
    many small tensors costs requests in proportion to its bytes, not to its tensors, and a
    partial read (one box) reads only its own chunks. Bigger chunks are read by the Zarr
    layer (a shard by its index and runs of inner chunks) or straight into the
    destination."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: List[Tuple[Any, ...]] = []

    def add(
        self, view: "PackedView", offset: Sequence[int], out: np.ndarray, pool: Any
    ) -> "Future[Any]":
        """A read of the box ``offset`` + ``out.shape`` into ``out``, started at
        :meth:`dispatch`; its future's result: more futures, as ``read_packed`` returns."""
        g: Future[Any] = Future()
        with self._lock:
            self._items.append((view, tuple(offset), out, pool, g))
        return g

    def dispatch(self) -> None:
        """Start every read added so far (their runs planned together)."""
        with self._lock:
            items, self._items = self._items, []
        if not items:
            return
        try:
            caches = plan_runs([(v, off, out.shape) for v, off, out, _p, _g in items])
        except Exception:  # noqa: BLE001 - a box the layer refuses: each read says why
            caches = [{} for _ in items]
        for (view, offset, out, pool, g), cache in zip(items, caches):
            v = view.with_cache(cache) if cache else view
            try:
                f = pool.submit(read_packed, v, offset, out, pool.submit)
            except BaseException as e:  # noqa: BLE001 - a pool shut down: that read fails
                g.set_exception(e)
                continue
            f.add_done_callback(lambda f, g=g: _pass_on(f, g))


def _pass_on(f: "Future[Any]", g: "Future[Any]") -> None:
    e = f.exception()
    if e is None:
        g.set_result(f.result())
    else:
        g.set_exception(e)


class PackedView:
    """The Zarr layer's store for one array of a packed checkpoint: chunk key -> the
    record's bytes in ``store`` below ``prefix``, the record's crc32c checked
    ([SP-PACK-6]). ``cache``: chunk number -> where a planned run holds its bytes
    (:func:`~.packed_runs.plan_runs`)."""

    def __init__(
        self,
        store: ByteStore,
        prefix: str,
        part: PackedArray,
        layout: ArrayLayout,
        key: str,
        cache: Optional[Dict[int, _Piece]] = None,
    ) -> None:
        self.store, self.prefix, self.part, self.layout, self.key = store, prefix, part, layout, key
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
        hit = self._cached(c)
        if hit is not None:
            return bytes(hit[start : start + length])
        buf = bytearray(length)  # read in place: no second copy of the bytes
        self._fill(path, c, off + start, memoryview(buf), n, off)
        return buf  # type: ignore[return-value]  # bytes-like

    def object_key(self, path: str) -> str:
        """The store key of the data object at ``path`` (the index's path)."""
        return _join(self.prefix, path)

    def _cached(self, c: int) -> Optional[memoryview]:
        """Chunk ``c``'s bytes from its planned run (None: not planned, or the run came
        back short: the chunk's own read then names what is cut short)."""
        piece = self.cache.get(c)
        if piece is None:
            return None
        try:
            got = piece.take()
        except (EOFError, OSError):  # the chunk's own read reports it, naming the chunk
            return None
        if self.part.inner is None:  # a plain chunk is read once: its run may go sooner
            self.cache.pop(c, None)
        return got

    def _fill(self, path: str, c: int, at: int, out: memoryview, n: int, off: int) -> None:
        try:
            self.store.read_into(self.object_key(path), at, out)
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
        hit = self._cached(c)
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

    def with_cache(self, cache: Dict[int, _Piece]) -> "PackedView":
        """This view with the chunks of ``cache`` read from their planned runs."""
        return PackedView(self.store, self.prefix, self.part, self.layout, self.key, cache)


def layout_of(spec: ArraySpec, part: PackedArray, key: str) -> ArrayLayout:
    """The array's layout as its packed entry implies it ([SP-PACK-3]; 1.5: the compressed
    chain of [SP-PACK-12], a codec object of another form *unsupported*), with the chunk
    table of the manifest ([SP-MAN-7])."""
    codec = part.codec
    if codec is not None and not is_zstd(codec):
        raise UnsupportedFormatError(
            f"tensor {key!r}: array {part.name!r}: zstd codec {codec!r} of the packed index "
            'is not of the form format 1.5 defines ({"name": "zstd", "configuration": '
            '{"level": <int>, "checksum": <bool>}})',
            spec_id="SP-ARRAY-1",
        )
    lay = ArrayLayout.create(
        spec.shape, spec.dtype, spec.chunk_shape, shard_above_bytes=1 << 62, compression=codec
    )  # the plain chain, or (1.5) the compressed one
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
    store: ByteStore,
    prefix: str,
    spec: ArraySpec,
    key: str,
    checked: Dict[str, Any],
    submit: Optional[Callable[..., Any]] = None,
) -> Tuple[PackedView, str, ArrayLayout]:
    """(the chunk view, the array's name, its layout) of a tensor of a packed checkpoint
    below ``prefix`` of ``store``, its objects checked first (:func:`check_objects`;
    ``submit``: its HEADs at once on object stores)."""
    part = spec.packed
    assert isinstance(part, PackedArray), "not a packed array"
    lay = layout_of(spec, part, key)
    check_objects(store, prefix, part, key, checked, lay.chunk, lay.itemsize, submit)
    return PackedView(store, prefix, part, lay, key), part.name, lay


def read_packed(
    view: PackedView,
    offset: Sequence[int],
    out: np.ndarray,
    submit: Optional[Callable[..., Any]] = None,
) -> list[Any]:
    """Fill ``out`` with the region at ``offset``: the chunks ``view.cache`` holds from
    their planned runs (:class:`ReadBatch`), the others by the Zarr layer's reads, every
    check applied; with ``submit``, chunks and runs of inner chunks in parallel (their
    futures returned, as :func:`~.array.read_region` does)."""
    from shardpoint_core.arrays import packed_direct

    if not view.cache and packed_direct.applies(view, offset, out):  # straight into ``out``
        return packed_direct.read_whole(view, out, submit)
    try:
        futures = read_region(view, view.part.name, view.layout, offset, out, view.key, submit)
        # the callbacks keep a view without the runs: a run's bytes go once its reads are done
        return _locating(view.with_cache({}) if view.cache else view, futures)
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
