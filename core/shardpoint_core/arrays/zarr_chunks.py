"""The ground floor of the Zarr v3 array layer (:mod:`.array`): an array's layout
(:class:`ArrayLayout`, chunk keys, zarr.json written, and read and checked against the
manifest), one chunk's or shard's bytes encoded and decoded with crc32c, and a shard's index
read and checked. Kept apart from the region reads and writes of :mod:`.array`, which cut
regions into these chunks and re-export these names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, List, Optional, Sequence, Tuple

import crc32c
import numpy as np

from shardpoint_core.format.dtypes import DTYPES
from shardpoint_core.format.errors import CorruptCheckpointError
from shardpoint_core.format.spec import ArraySpec
from shardpoint_core.stores.base import ByteStore, SuffixRead
from shardpoint_core.arrays.checks import check_shard_index, checked_zarr_json
from shardpoint_core.arrays.direct_write import (
    INNER_ALIGN,
    encode_chunk,
    stored_codecs,
    zarr_json_bytes,
)
from shardpoint_core.arrays.identity import check_unit, table_of, unit_of
from shardpoint_core.arrays.compression import decode_zstd
from shardpoint_core.format.compression import compression_of, stored_bounds
from shardpoint_core.format.layout import (
    INNER_CHUNK_BYTES,
    SHARD_ABOVE_BYTES,
    codecs_for,
    fill_value,
)

__all__ = [
    "ABSENT",
    "MAX_ZARR_JSON_BYTES",
    "ArrayLayout",
    "chunk_key",
    "decode_chunk",
    "encode_shard",
    "inner_stride",
    "read_array_meta",
    "read_shard_index",
    "write_array_meta",
]

MAX_ZARR_JSON_BYTES = 1 << 20
ABSENT = 2**64 - 1
_ZEROS = np.zeros(INNER_ALIGN, np.uint8)


@dataclass(frozen=True)
class ArrayLayout:
    """Shape, dtype, chunk grid and (when chunks are shards) inner chunk shape of an array:
    all the layer needs to place bytes. ``codecs`` is the chain as zarr.json stores it."""

    shape: tuple[int, ...]
    dtype: str
    chunk: tuple[int, ...]
    inner: Optional[tuple[int, ...]]
    codecs: list[Any]
    #: (1.3) the manifest's crc32c of every stored unit, checked by every read ([SP-READ-8])
    crcs: Optional[np.ndarray] = field(default=None, compare=False, repr=False)

    def with_table(self, raw: Optional[bytes], key: str, where: str) -> "ArrayLayout":
        """This layout holding the manifest's chunk table ([SP-MAN-7]), its length checked."""
        if raw is None:
            return self
        return replace(self, crcs=table_of(raw, self.shape, self.chunk, self.inner, key, where))

    @property
    def shard_inner(self) -> tuple[int, ...]:
        """The inner chunk shape of a sharded layout: for the code paths that run on shards
        only (a plain layout there is a bug, not bad input)."""
        assert self.inner is not None, "not a sharded layout"
        return self.inner

    def unit(self, origin: Sequence[int]) -> int:
        """The unit number of the (inner) chunk starting at global ``origin``."""
        return unit_of(origin, self.shape, self.chunk, self.inner)

    @property
    def zstd_level(self) -> Optional[int]:
        """(1.5) The zstd level of a compressed chain ([SP-ARRAY-7]), None for the others."""
        if compression_of(self.codecs) is None:
            return None
        return int(self.codecs[1]["configuration"]["level"])

    def stored_most(self) -> int:
        """The most bytes a (plain-chain) chunk file of this layout may hold: its exact size
        uncompressed, the bound of [SP-READ-9] compressed."""
        n = math.prod(self.chunk) * self.itemsize
        return n + 4 if self.zstd_level is None else stored_bounds(n)[1]

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(DTYPES[self.dtype].numpy)

    @property
    def itemsize(self) -> int:
        return self.np_dtype.itemsize

    @classmethod
    def create(
        cls,
        shape: Sequence[int],
        dtype: str,
        chunk: Sequence[int],
        *,
        shard_above_bytes: int = SHARD_ABOVE_BYTES,
        inner_chunk_bytes: int = INNER_CHUNK_BYTES,
        compression: Optional[dict[str, Any]] = None,
    ) -> "ArrayLayout":
        """The layout a writer chooses (the backend's codec chain, :func:`codecs_for`)."""
        spec = ArraySpec(tuple(shape), dtype, tuple(chunk), compression=compression)
        itemsize = DTYPES[dtype].itemsize
        codecs = codecs_for(spec, itemsize, shard_above_bytes, inner_chunk_bytes)
        return cls.from_meta(
            {
                "shape": list(shape),
                "data_type": dtype,
                "codecs": stored_codecs(codecs, itemsize),
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
            }
        )

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> "ArrayLayout":
        """The layout of a zarr.json already checked by :func:`check_zarr_json`."""
        codecs = meta["codecs"]
        inner = None
        if codecs[0].get("name") == "sharding_indexed":
            inner = tuple(codecs[0]["configuration"]["chunk_shape"])
        return cls(
            tuple(meta["shape"]),
            meta["data_type"],
            tuple(meta["chunk_grid"]["configuration"]["chunk_shape"]),
            inner,
            codecs,
        )

    def zarr_json(self) -> bytes:
        """zarr.json as TensorStore writes it (compact, keys sorted)."""
        return zarr_json_bytes(
            {
                "shape": list(self.shape),
                "data_type": self.dtype,
                "chunk_grid": {
                    "name": "regular",
                    "configuration": {"chunk_shape": list(self.chunk)},
                },
                "chunk_key_encoding": {"name": "default"},
                "fill_value": fill_value(self.dtype),
                "codecs": self.codecs,
            }
        )

    def grid(self) -> tuple[Any, ...]:
        """Chunks per dimension."""
        return tuple(-(-n // c) for n, c in zip(self.shape, self.chunk))


def chunk_key(array_path: str, cidx: Sequence[int]) -> str:
    """The store key of chunk ``cidx`` (default encoding, '/' separator; ``c`` for 0-d)."""
    return "/".join([array_path, "c", *map(str, cidx)])


def _bad(key: str, where: str, msg: str, sid: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"tensor {key!r}: {where}: {msg}", spec_id=sid)


# -------------------------------------------------------------------------- zarr.json
def write_array_meta(store: ByteStore, array_path: str, layout: ArrayLayout) -> None:
    """Write ``array_path/zarr.json`` unless one is there (another writer of the same array
    wrote the same bytes: both derive them from the manifest's layout)."""
    try:
        store.put(f"{array_path}/zarr.json", layout.zarr_json(), if_absent=True)
    except FileExistsError:
        pass


def read_array_meta(store: ByteStore, array_path: str, spec: ArraySpec, key: str) -> ArrayLayout:
    """Read and check ``array_path/zarr.json`` against the manifest's ``spec`` and the spec's
    rules ([SP-ARRAY-1/2/3/5], the size cap of [SP-SEC-2])."""
    jkey = f"{array_path}/zarr.json"
    try:  # one request: at most one byte over the cap, so a bigger one is seen
        raw = store.get_range(jkey, 0, MAX_ZARR_JSON_BYTES + 1)
    except FileNotFoundError as e:
        raise _bad(key, store.url, f"array {array_path!r} has no zarr.json", "SP-ARRAY-1") from e
    if len(raw) > MAX_ZARR_JSON_BYTES:
        raise _bad(key, jkey, f"zarr.json is over the {MAX_ZARR_JSON_BYTES}-byte cap", "SP-SEC-2")
    # The parsing rules of [SP-ARRAY-6] (a repeated name, depth, ``-0``) as on files.
    return ArrayLayout.from_meta(
        checked_zarr_json(
            bytes(raw), tuple(spec.shape), spec.dtype, tuple(spec.chunk_shape), key, jkey
        )
    ).with_table(spec.chunk_crc32c, key, array_path)


# -------------------------------------------------------------------------- encoding
def decode_chunk(
    buf: np.ndarray,
    layout: ArrayLayout,
    cshape: tuple[int, ...],
    key: str,
    where: str,
    unit: Optional[int] = None,
) -> np.ndarray:
    """The array of shape ``cshape`` stored in ``buf`` (data + 4 CRC bytes), checked; with
    ``unit``, also against the manifest's chunk table ([SP-READ-8]). (1.5) A compressed
    chunk's stored bytes (a zstd frame + 4 CRC bytes) are checked, then decoded into at most
    the chunk's size ([SP-READ-9])."""
    n = math.prod(cshape) * layout.itemsize
    if layout.zstd_level is not None:
        least, most = stored_bounds(n)
        if not least <= buf.nbytes <= most:
            raise _bad(
                key,
                where,
                f"{buf.nbytes} bytes stored, a compressed chunk of {list(cshape)} "
                f"{layout.dtype} holds {least} to {most} with its checksum ([SP-READ-9])",
                "SP-READ-3",
            )
        stored = int.from_bytes(buf[-4:].tobytes(), "little")
        if crc32c.crc32c(buf[:-4]) != stored:
            raise _bad(key, where, "crc32c mismatch", "SP-READ-3")
        if unit is not None:
            check_unit(layout.crcs, unit, stored, key, where)
        raw = np.frombuffer(decode_zstd(buf[:-4].tobytes(), n, key, where), np.uint8)
        if layout.dtype == "bool" and n and int(raw.max()) > 1:
            raise _bad(key, where, "a bool byte other than 0 or 1 ([SP-READ-5])", "SP-READ-3")
        return raw.view(layout.np_dtype).reshape(cshape)
    if buf.nbytes != n + 4:
        raise _bad(
            key,
            where,
            f"{buf.nbytes} bytes stored, a chunk of {list(cshape)} "
            f"{layout.dtype} is {n + 4} with its checksum",
            "SP-READ-3",
        )
    stored = int.from_bytes(buf[n:].tobytes(), "little")
    if crc32c.crc32c(buf[:n]) != stored:
        raise _bad(key, where, "crc32c mismatch", "SP-READ-3")
    if layout.dtype == "bool" and n and int(buf[:n].max()) > 1:
        raise _bad(key, where, "a bool byte other than 0 or 1 ([SP-READ-5])", "SP-READ-3")
    if unit is not None:
        check_unit(layout.crcs, unit, stored, key, where)
    return buf[:n].view(layout.np_dtype).reshape(cshape)


def _per(layout: ArrayLayout) -> tuple[Any, ...]:
    return tuple(c // i for c, i in zip(layout.chunk, layout.shard_inner))


def inner_stride(layout: ArrayLayout) -> Tuple[int, int]:
    """(bytes of one stored inner chunk with its CRC, padding after it): inner chunks of
    256 KiB and more start on 4 KiB boundaries (the spec allows gaps), so their bytes keep a
    destination's page alignment."""
    nb = math.prod(layout.shard_inner) * layout.itemsize + 4
    return nb, (-nb % INNER_ALIGN if nb >= 64 * INNER_ALIGN else 0)


def encode_shard(
    data: np.ndarray, origin: tuple[int, ...], layout: ArrayLayout, crcs: Optional[bytearray] = None
) -> List[np.ndarray]:
    """The buffers of one whole shard file whose part inside the tensor is ``data``: inner
    chunks in C order (those wholly outside the tensor absent, as TensorStore leaves them),
    each padded as :func:`inner_stride` says, then the index and its CRC."""
    per = _per(layout)
    nb, gap = inner_stride(layout)
    index = np.full((math.prod(per), 2), ABSENT, dtype="<u8")
    bufs: list[Any] = []
    pos = 0
    for n, ii in enumerate(np.ndindex(*per)):
        lo = tuple(i * k for i, k in zip(ii, layout.shard_inner))
        if any(o + x >= s for o, x, s in zip(origin, lo, layout.shape)):
            continue
        index[n] = (pos, nb)
        bufs += encode_chunk(
            data[tuple(slice(x, x + k) for x, k in zip(lo, layout.shard_inner))],
            layout.shard_inner,
            layout.itemsize,
        )
        if crcs is not None:  # the unit's crc32c for the chunk table ([SP-MAN-7])
            crcs[4 * n : 4 * n + 4] = bufs[-1].tobytes()
        if gap:
            bufs.append(_ZEROS[:gap])
        pos += nb + gap
    ib = index.reshape(-1).view(np.uint8)
    return bufs + [ib, np.frombuffer(crc32c.crc32c(ib).to_bytes(4, "little"), np.uint8)]


def _tail(store: ByteStore, ckey: str, n: int) -> Tuple[bytes, int]:
    """(the last ``n`` bytes of ``ckey``, its size): one request where the store has
    ``get_suffix`` (S3: a suffix range), else a ``head`` and a ranged read."""
    suffix: Optional[SuffixRead] = getattr(store, "get_suffix", None)  # optional method
    if suffix is not None:
        return suffix(ckey, n)
    info = store.head(ckey)
    if info is None:
        raise FileNotFoundError(2, "no such object", ckey)
    return store.get_range(ckey, max(0, info.size - n), n), info.size


def read_shard_index(
    store: ByteStore, ckey: str, layout: ArrayLayout, key: str
) -> Tuple[np.ndarray, int]:
    """(the (offset, nbytes) rows of shard ``ckey``, the shard's size), checked: its CRC,
    and every present inner chunk inside the file with the inner chunk's exact size
    ([SP-READ-3]). One request on a store with ``get_suffix`` (no HEAD first)."""
    n = math.prod(_per(layout))
    isz = n * 16
    try:
        tail, size = _tail(store, ckey, isz + 4)
    except FileNotFoundError as e:
        raise _missing(key, ckey) from e
    if size < isz + 4:
        raise _bad(
            key,
            ckey,
            f"shard of {size} bytes is shorter than its index ({isz + 4} bytes)",
            "SP-READ-3",
        )
    raw = np.frombuffer(tail, np.uint8)
    if raw.nbytes != isz + 4 or crc32c.crc32c(raw[:isz]) != int.from_bytes(
        raw[isz:].tobytes(), "little"
    ):
        raise _bad(key, ckey, "shard index crc32c mismatch", "SP-READ-3")
    index = raw[:isz].view("<u8").reshape(n, 2)
    nb, _gap = inner_stride(layout)
    absent = (index[:, 0] == ABSENT) & (index[:, 1] == ABSENT)
    if np.any((index[:, 0] == ABSENT) != (index[:, 1] == ABSENT)):
        raise _bad(
            key, ckey, "shard index entry with exactly one half 2^64-1 ([SP-READ-5])", "SP-READ-3"
        )
    present = ~absent
    last = size - isz - 4 - nb  # the last offset a whole inner chunk can start at
    beyond = present if last < 0 else index[:, 0] > np.uint64(last)
    if np.any(present & ((index[:, 1] != nb) | beyond)):
        raise _bad(
            key,
            ckey,
            "shard index points past the index or at an inner chunk of "
            "the wrong size ([SP-READ-5])",
            "SP-READ-3",
        )
    check_shard_index(index, size - isz - 4, key, ckey)  # overlaps, aliases [SP-READ-7]
    return index, size


def _missing(key: str, ckey: str) -> CorruptCheckpointError:
    return _bad(key, ckey, "stored chunk is missing", "SP-READ-2")
