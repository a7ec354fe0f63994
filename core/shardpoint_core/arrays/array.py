"""The Zarr v3 array layer over a byte store: zarr.json, chunk keys, whole-chunk encode and
decode with crc32c, shard indexes, and region reads and writes that cut through chunks, all in
our own code over :class:`~shardpoint_core.stores.base.ByteStore` (files, memory, object
stores), so TensorStore is not needed to read or write a checkpoint.

What is handled is exactly what the spec allows (spec/format.md section 7, checked by
:func:`~.checks.check_zarr_json`): the chain ``bytes`` (little-endian) + ``crc32c``, or one
``sharding_indexed`` of such chains with its index (also ending in crc32c) at the end, the
default chunk key encoding ``c/i/j``, fill value zero. Files are byte for byte what TensorStore
writes for the same array (tests/core/test_store_zarr.py pins it, and TensorStore reads ours).
This module holds the region reads and writes; the layout and the chunk and shard codecs
below them are :mod:`.zarr_chunks`', whose names are re-exported here.

Reader rules: a missing chunk or inner chunk is [SP-READ-2]; a checksum mismatch and the
rules of [SP-READ-5] (sizes, index entries, bool bytes other than 0/1) are reported as
[SP-READ-3], as [SP-ERR-2] says; nothing is allocated before the
object's size, from the store, agrees with what zarr.json (checked against the manifest)
says. Chunks have one writer each ([SP-COVER]); a region write covering part of a chunk reads,
changes and rewrites that chunk, so two writers of one chunk must not overlap in time.

Example::

    lay = ArrayLayout.create((4, 6), "float32", (2, 3))
    write_array_meta(store, "tensors/w", lay)
    write_region(store, "tensors/w", lay, (0, 0), np.ones((4, 6), np.float32))
    out = np.empty((3, 4), np.float32)
    read_region(store, "tensors/w", read_array_meta(store, "tensors/w", spec, "w"),
                (1, 1), out, "w")
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from functools import partial
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import crc32c
import numpy as np

from shardpoint_core.format.errors import CorruptCheckpointError
from shardpoint_core.stores.base import ByteStore, SuffixRead
from shardpoint_core.arrays.direct_write import encode_chunk

# encode_zstd re-exported: the conformance vectors swap it for a reproducible encoder
from shardpoint_core.arrays.compression import encode_zstd as encode_zstd
from shardpoint_core.arrays.zarr_chunks import (
    ABSENT,
    MAX_ZARR_JSON_BYTES,
    ArrayLayout,
    _bad,
    _missing,
    _per,
    chunk_key,
    decode_chunk,
    encode_shard,
    inner_stride,
    read_array_meta,
    read_shard_index,
    write_array_meta,
)

__all__ = [
    # this module's own
    "MAX_SPAN_BYTES",
    "PrimedStore",
    "prime_region",
    "read_chunk",
    "read_region",
    "write_chunk",
    "write_region",
    # re-exported
    "ABSENT",
    "MAX_ZARR_JSON_BYTES",
    "ArrayLayout",
    "chunk_key",
    "decode_chunk",
    "encode_shard",
    "encode_zstd",
    "inner_stride",
    "read_array_meta",
    "read_shard_index",
    "write_array_meta",
]

MAX_SPAN_BYTES = 16 << 20  # one ranged read of back-to-back inner chunks at most


# -------------------------------------------------------------------------- regions
def _box(
    offset: Sequence[int], shape: Sequence[int], lo: tuple[int, ...], hi: tuple[int, ...]
) -> tuple[Any, ...]:
    """The index of box [lo, hi) in an array at ``offset`` (a view even for 0-d arrays)."""
    return tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset)) + (Ellipsis,)


def _chunks_of(
    layout: ArrayLayout, offset: Sequence[int], shape: Sequence[int]
) -> Iterator[tuple[Any, ...]]:
    """(chunk index, its origin, the overlap's lo and hi) of every chunk the region meets."""
    if any(s == 0 for s in shape):
        return
    lo = [o // c for o, c in zip(offset, layout.chunk)]
    hi = [-(-(o + s) // c) for o, s, c in zip(offset, shape, layout.chunk)]
    for rel in np.ndindex(*[h - l_ for l_, h in zip(lo, hi)]):
        cidx = tuple(r + l_ for r, l_ in zip(rel, lo))
        origin = tuple(i * c for i, c in zip(cidx, layout.chunk))
        blo = tuple(max(g, o) for g, o in zip(origin, offset))
        bhi = tuple(
            min(g + c, o + s, n)
            for g, c, o, s, n in zip(origin, layout.chunk, offset, shape, layout.shape)
        )
        yield cidx, origin, blo, bhi


def _check_region(layout: ArrayLayout, offset: Sequence[int], shape: Sequence[int]) -> None:
    if (
        len(offset) != len(layout.shape)
        or len(shape) != len(layout.shape)
        or any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offset, shape, layout.shape))
    ):
        raise ValueError(
            f"region at {list(offset)} of shape {list(shape)} is outside the "
            f"array of shape {list(layout.shape)}"
        )


def write_chunk(
    store: ByteStore,
    array_path: str,
    layout: ArrayLayout,
    cidx: tuple[int, ...],
    data: np.ndarray,
    sink: Optional[Callable[..., Any]] = None,
) -> None:
    """Write chunk ``cidx`` whole: ``data`` is its part inside the tensor (one ``put`` of
    the buffers, no joined copy). ``sink(cidx)``: the slots to record its units' crc32c in
    (the chunk table, [SP-MAN-7])."""
    origin = tuple(i * c for i, c in zip(cidx, layout.chunk))
    crcs = sink(cidx) if sink is not None else None
    if layout.inner is None:
        bufs = encode_chunk(data, layout.chunk, layout.itemsize)
        level = layout.zstd_level
        if level is not None:  # (1.5) the element bytes as one zstd frame, then its crc32c
            frame = encode_zstd(b"".join(memoryview(b).cast("B") for b in bufs[:-1]), level)
            bufs = [np.frombuffer(frame, np.uint8)]
            bufs.append(np.frombuffer(crc32c.crc32c(frame).to_bytes(4, "little"), np.uint8))
        if crcs is not None:
            crcs[0:4] = bufs[-1].tobytes()
    else:
        bufs = encode_shard(data, origin, layout, crcs)
    store.put(chunk_key(array_path, cidx), bufs)


def read_chunk(
    store: ByteStore, array_path: str, layout: ArrayLayout, cidx: tuple[int, ...], key: str
) -> np.ndarray:
    """Chunk ``cidx``'s part inside the tensor, checked (a copy the caller owns)."""
    origin = tuple(i * c for i, c in zip(cidx, layout.chunk))
    valid = tuple(min(c, n - o) for c, n, o in zip(layout.chunk, layout.shape, origin))
    out = np.empty(valid, layout.np_dtype)
    read_region(store, array_path, layout, origin, out, key)
    return out


def write_region(
    store: ByteStore,
    array_path: str,
    layout: ArrayLayout,
    offset: Sequence[int],
    data: np.ndarray,
    key: str = "",
    sink: Optional[Callable[..., Any]] = None,
) -> None:
    """Write ``data`` at ``offset``. Whole chunks are encoded straight from ``data``; a chunk
    covered in part is read (zeros where it does not exist yet), changed and rewritten."""
    offset = tuple(int(o) for o in offset)
    _check_region(layout, offset, data.shape)
    for cidx, origin, blo, bhi in _chunks_of(layout, offset, data.shape):
        valid = tuple(min(c, n - o) for c, n, o in zip(layout.chunk, layout.shape, origin))
        part = data[_box(offset, data.shape, blo, bhi)]
        if tuple(part.shape) != valid:
            try:
                whole = read_chunk(store, array_path, layout, cidx, key or array_path)
            except CorruptCheckpointError as e:  # not written yet: zeros
                if e.spec_id != "SP-READ-2" or not _chunk_absent(store, array_path, cidx):
                    raise
                whole = np.zeros(valid, layout.np_dtype)
            whole[_box(origin, valid, blo, bhi)] = part
            part = whole
        write_chunk(store, array_path, layout, cidx, part, sink)


def _chunk_absent(store: ByteStore, array_path: str, cidx: tuple[int, ...]) -> bool:
    return store.head(chunk_key(array_path, cidx)) is None


def read_region(
    store: ByteStore,
    array_path: str,
    layout: ArrayLayout,
    offset: Sequence[int],
    out: np.ndarray,
    key: str,
    submit: Optional[Callable[..., Any]] = None,
) -> list[Any]:
    """Fill ``out`` with the region at ``offset``: plain chunks read whole (one read each,
    no HEAD first: it asks for one byte more than a chunk holds, so a wrong size is seen
    without reading or allocating more than that), shards by their index (read from the
    end) and then only the inner chunks the region meets, contiguous ones in one read.

    ``submit`` (an executor's ``submit``): every chunk but the first, and every run of a
    shard's inner chunks but the first, is a task of its own, all in flight together with
    the first (read here) instead of one after another; their futures are returned (a
    future's result may be a list of further futures), not waited for, and an error of the
    part read here is returned as a failed future too, so that the caller waits for every
    task writing into ``out`` before it raises. Without ``submit`` everything is read here
    (errors raised) and ``[]`` is returned."""
    offset = tuple(int(o) for o in offset)
    _check_region(layout, offset, out.shape)
    parts = [
        partial(
            _read_chunk_box,
            store,
            chunk_key(array_path, cidx),
            layout,
            origin,
            blo,
            bhi,
            out[_box(offset, out.shape, blo, bhi)],
            key,
            submit,
        )
        for cidx, origin, blo, bhi in _chunks_of(layout, offset, out.shape)
    ]
    return _together(parts, submit)


def _together(
    parts: Sequence[Callable[..., Any]], submit: Optional[Callable[..., Any]]
) -> list[Any]:
    """Each of ``parts`` (callables returning lists of futures): all here, one after
    another, without ``submit``; else all but the first submitted, then the first run here,
    its error (if any) returned as a failed future beside the others."""
    if submit is None:
        return [f for p in parts for f in p()]
    tasks = [submit(p) for p in parts[1:]]
    if parts:
        try:
            tasks += parts[0]()
        except Exception as e:  # noqa: BLE001 - raised by the caller's wait, after the rest
            failed: Future[Any] = Future()
            failed.set_exception(e)
            tasks.append(failed)
    return tasks


def _read_chunk_box(
    store: ByteStore,
    ckey: str,
    layout: ArrayLayout,
    origin: tuple[int, ...],
    blo: tuple[int, ...],
    bhi: tuple[int, ...],
    dst: np.ndarray,
    key: str,
    submit: Optional[Callable[..., Any]],
) -> list[Any]:
    """The box [blo, bhi) of chunk ``ckey`` (at ``origin``) into ``dst``."""
    if layout.inner is not None:
        return _read_shard(store, ckey, layout, origin, blo, bhi, dst, key, submit)
    n = layout.stored_most()
    try:
        raw = store.get_range(ckey, 0, n + 1)
    except FileNotFoundError as e:
        raise _missing(key, ckey) from e
    full = decode_chunk(
        np.frombuffer(raw, np.uint8), layout, layout.chunk, key, ckey, layout.unit(origin)
    )
    dst[...] = full[_box(origin, layout.chunk, blo, bhi)]
    return []


class PrimedStore:
    """``store`` holding the answer (bytes, or the error) to one request sent ahead: the
    first request :func:`read_region` makes for a region under a layout predicted before
    the array's zarr.json arrived (:func:`prime_region`). The same request, made by
    ``read_region`` under the confirmed layout, gets that answer once; any other request
    goes to the store, so every check of the layer runs on the bytes as before."""

    def __init__(
        self,
        store: ByteStore,
        request: tuple[Any, ...],
        outcome: tuple[Any, Optional[BaseException]],
    ) -> None:
        self._store = store
        self._request: Optional[tuple[Any, ...]] = request
        self._outcome = outcome
        self._suffix: Optional[SuffixRead] = getattr(store, "get_suffix", None)
        if self._suffix is None:
            # the layer's head + range fallback, as before: the layer asks for the optional
            # method with getattr(store, "get_suffix", None), so the method is hidden here
            self.get_suffix = None  # type: ignore[method-assign, assignment]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def _answer(self, request: tuple[Any, ...]) -> Optional[tuple[Any]]:
        if request != self._request:
            return None
        (data, err), self._request, self._outcome = self._outcome, None, (None, None)
        if err is not None:
            raise err
        return (data,)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        got = self._answer(("range", key, start, length))
        if got is None:
            return self._store.get_range(key, start, length)
        data: bytes = got[0]
        return data

    def get_suffix(self, key: str, length: int) -> Tuple[bytes, int]:
        got = self._answer(("suffix", key, length))
        if got is None:
            assert self._suffix is not None  # hidden above where the store has none
            return self._suffix(key, length)
        answer: Tuple[bytes, int] = got[0]
        return answer


def prime_region(
    store: ByteStore,
    array_path: str,
    layout: ArrayLayout,
    offset: Sequence[int],
    shape: Sequence[int],
) -> Optional[PrimedStore]:
    """Send now the first request :func:`read_region` would make for the region under
    ``layout`` (a plain chunk's read, or a shard index's suffix read) and return the store
    that answers it: an object store's zarr.json and first data request in one round trip.
    Use it only once the array's zarr.json confirmed ``layout``; None when there is nothing
    to send (an empty region, a store without suffix reads for a shard)."""
    first = next(_chunks_of(layout, tuple(int(o) for o in offset), shape), None)
    if first is None:
        return None
    ckey = chunk_key(array_path, first[0])
    request: tuple[Any, ...]
    call: Callable[[], Any]  # bytes, or (bytes, size) for a suffix read
    if layout.inner is None:
        n = layout.stored_most()
        request, call = ("range", ckey, 0, n + 1), lambda: store.get_range(ckey, 0, n + 1)
    else:
        suffix: Optional[SuffixRead] = getattr(store, "get_suffix", None)  # optional
        if suffix is None:
            return None
        n = math.prod(_per(layout)) * 16 + 4
        request, call = ("suffix", ckey, n), lambda: suffix(ckey, n)
    outcome: tuple[Any, Optional[BaseException]]
    try:
        outcome = (call(), None)
    except Exception as e:  # noqa: BLE001 - raised where read_region makes this request
        outcome = (None, e)
    return PrimedStore(store, request, outcome)


def _fill(store: ByteStore, ckey: str, start: int, buf: np.ndarray, key: str) -> None:
    try:
        store.read_into(ckey, start, memoryview(buf))
    except FileNotFoundError as e:
        raise _missing(key, ckey) from e
    except EOFError as e:
        raise _bad(key, ckey, f"truncated: {e}", "SP-READ-3") from e


def _spans(wanted: List[tuple[Any, ...]], stride: int) -> Iterator[List[tuple[Any, ...]]]:
    """Runs of ``(pos, inner index)`` (sorted by pos) that lie back to back in the file,
    each at most :data:`MAX_SPAN_BYTES`: one ranged read each instead of one per inner
    chunk (requests, not bytes, are what an object store charges for)."""
    run: List[tuple[Any, ...]] = []
    for w in wanted:
        if run and (w[0] != run[-1][0] + stride or w[0] + stride - run[0][0] > MAX_SPAN_BYTES):
            yield run
            run = []
        run.append(w)
    if run:
        yield run


def _read_shard(
    store: ByteStore,
    ckey: str,
    layout: ArrayLayout,
    origin: tuple[int, ...],
    blo: tuple[int, ...],
    bhi: tuple[int, ...],
    dst: np.ndarray,
    key: str,
    submit: Optional[Callable[..., Any]] = None,
) -> list[Any]:
    index, _size = read_shard_index(store, ckey, layout, key)
    per = _per(layout)
    nb, gap = inner_stride(layout)
    lo = [(b - o) // i for b, o, i in zip(blo, origin, layout.shard_inner)]
    hi = [-(-(e - o) // i) for e, o, i in zip(bhi, origin, layout.shard_inner)]
    wanted = []
    for rel in np.ndindex(*[h - l_ for l_, h in zip(lo, hi)]):
        ii = tuple(r + l_ for r, l_ in zip(rel, lo))
        pos = int(index[np.ravel_multi_index(ii, per)][0])
        if pos == ABSENT:
            raise _bad(
                key, f"{ckey} inner chunk {list(ii)}", "stored inner chunk is missing", "SP-READ-2"
            )
        wanted.append((pos, ii))
    wanted.sort()
    return _together(
        [
            partial(_read_run, store, ckey, layout, origin, blo, run, dst, key)
            for run in _spans(wanted, nb + gap)
        ],
        submit,
    )


def _read_run(
    store: ByteStore,
    ckey: str,
    layout: ArrayLayout,
    origin: tuple[int, ...],
    blo: tuple[int, ...],
    run: List[tuple[Any, ...]],
    dst: np.ndarray,
    key: str,
) -> list[Any]:
    """Inner chunks ``run`` (back to back in the shard) in one ranged read, checked, into
    their part of ``dst`` (whose first element sits at ``blo``)."""
    nb, _gap = inner_stride(layout)
    bhi = tuple(b + s for b, s in zip(blo, dst.shape))
    start = run[0][0]
    buf = np.empty(run[-1][0] + nb - start, np.uint8)
    _fill(store, ckey, start, buf, key)
    for pos, ii in run:
        where = f"{ckey} inner chunk {list(ii)}"
        ilo = tuple(o + i * k for o, i, k in zip(origin, ii, layout.shard_inner))
        full = decode_chunk(
            buf[pos - start : pos - start + nb],
            layout,
            layout.shard_inner,
            key,
            where,
            layout.unit(ilo),
        )
        sl = tuple(max(a, b) for a, b in zip(ilo, blo))
        sh = tuple(min(a + k, b) for a, k, b in zip(ilo, layout.shard_inner, bhi))
        dst[_box(blo, dst.shape, sl, sh)] = full[_box(ilo, layout.shard_inner, sl, sh)]
    return []
