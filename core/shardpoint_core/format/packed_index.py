"""The packed layout's index as data (format 1.4, spec/format.md section 13): its constants
(the 36-byte record, the chunk hash, the limits), :class:`PackedIndex` and the per-array view
:class:`PackedArray` that readers and writers share. Pure: values in, values out, no I/O; the
field's encoder is in :mod:`~shardpoint_core.format.packed`, its reader checks in
:mod:`~shardpoint_core.format.packed_decode`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Protocol, Sequence, Tuple

import blake3
import numpy as np

from shardpoint_core.format.compression import zstd_config_ok

FIELD = "packed"  # the manifest's top-level field (1.4)
FORMAT_VERSION_1_4 = (1, 4)  # what a writer of the packed layout writes ([SP-VER-1])
RECORD = np.dtype(
    [
        ("array", "<u4"),
        ("object", "<u4"),
        ("chunk", "<u8"),
        ("offset", "<u8"),
        ("length", "<u8"),
        ("crc32c", "<u4"),
    ]
)
RECORD_BYTES = 36
MAX_OBJECTS = 2**32 - 1
MAX_SIZE = 2**63  # object sizes lie below it
HASH_NAME = "blake3/128"  # the chunk hash of [SP-PACK-10]: BLAKE3's first 16 bytes
HASH_BYTES = 16
IDENTITY_BYTES = 32  # a base's identity: the sha256 of its manifest body ([SP-PACK-9])
BASE_PREFIX = "../"  # how a reader's view names a base's object: ../<base>/<path>
assert RECORD.itemsize == RECORD_BYTES


class ArrayInfo(Protocol):
    """What the codec needs of a tensor entry: its key, shape, dtype and chunk shape."""

    key: str
    shape: Tuple[int, ...]
    dtype: str
    chunk_shape: Tuple[int, ...]


def is_zstd(codec: Any) -> bool:
    """(1.5) A codec object of the index that is the ``zstd`` codec of [SP-ARRAY-7]'s form
    (another map is a codec this reader does not know: the array is unsupported)."""
    return isinstance(codec, dict) and codec.get("name") == "zstd" and zstd_config_ok(codec)


def records_of(rows: Iterable[Tuple[int, int, int, int, int, bytes]]) -> np.ndarray:
    """Records from ``(array, object, chunk, offset, length, crc32c bytes)`` rows."""
    rows = list(rows)
    out = np.zeros(len(rows), RECORD)
    for i, (a, o, c, off, n, crc) in enumerate(rows):
        out[i] = (a, o, c, off, n, int.from_bytes(crc, "little"))
    return out


def chunk_hash(bufs: Iterable[Any]) -> bytes:
    """The [SP-PACK-10] hash of a chunk's stored bytes (its buffers in order): their BLAKE3
    digest of 16 bytes (the binding releases the GIL on large buffers, so the write pool's
    threads hash in parallel)."""
    h = blake3.blake3()
    for b in bufs:
        h.update(b)
    return h.digest(HASH_BYTES)


def chunk_count(shape: Sequence[int], chunk: Sequence[int]) -> int:
    """Chunks of the regular grid (one for a 0-d array, none with a zero dimension)."""
    return math.prod(-(-n // c) for n, c in zip(shape, chunk))


@dataclass(frozen=True)
class PackedArray:
    """One array's part of the index: its name, inner chunk shape (None: the plain chain),
    its records in chunk order (record ``c`` is chunk ``c``) and the checkpoint's objects."""

    name: str
    inner: Optional[Tuple[int, ...]]
    records: np.ndarray
    objects: Tuple[Tuple[str, int], ...]
    #: (incremental, [SP-PACK-9]) the checkpoint's bases ``(name, identity)``; an object of
    #: base ``name`` appears in ``objects`` as ``../<name>/<path>`` (:data:`BASE_PREFIX`)
    bases: Tuple[Tuple[str, bytes], ...] = ()
    #: ([SP-PACK-10]) the records' chunk hashes, ``(n, 16)`` uint8, or None
    hashes: Optional[np.ndarray] = None
    #: (1.5, [SP-PACK-12]) the codec object of a compressed chain (as the index holds it,
    #: checked when the array is opened), None for the chains of ``inner``
    codec: Optional[dict[str, Any]] = None

    def chunk(self, number: int) -> Tuple[str, int, int, int]:
        """(object path, offset, length, crc32c) of chunk ``number``."""
        r = self.records[number]
        return (
            self.objects[int(r["object"])][0],
            int(r["offset"]),
            int(r["length"]),
            int(r["crc32c"]),
        )

    def object_numbers(self) -> list[int]:
        """The objects this array's chunks lie in (each once)."""
        return [int(o) for o in np.unique(self.records["object"])]

    def hash(self, number: int) -> Optional[bytes]:
        """The [SP-PACK-10] hash of chunk ``number``, None where the index holds none."""
        return None if self.hashes is None else bytes(self.hashes[number])


@dataclass
class PackedIndex:
    """The decoded field: ``objects`` ``[(path, size)]``, ``arrays`` ``[(name, inner)]``,
    ``records`` (structured :data:`RECORD` array in ``(array, chunk)`` order)."""

    objects: list[Tuple[str, int]]
    arrays: list[Tuple[str, Optional[Tuple[int, ...]]]]
    records: np.ndarray
    #: ([SP-PACK-9]) the bases ``(name, identity)`` and, per object, its base's number
    #: (None: an object of this checkpoint); ``object_bases`` None: every object its own
    bases: list[Tuple[str, bytes]] = field(default_factory=list)
    object_bases: Optional[list[Optional[int]]] = None
    #: ([SP-PACK-10]) one 16-byte hash per record, in the order of ``records``; None: none
    hashes: Optional[bytes] = None
    #: (1.5, [SP-PACK-12]) per array (in the order of ``arrays``) the codec object of its
    #: compressed chain, None for the others; None: no array compressed
    codecs: Optional[list[Optional[dict[str, Any]]]] = None

    def codec_of(self, number: int) -> Optional[dict[str, Any]]:
        """The compressed chain's codec object of array ``number`` (None: not compressed)."""
        return None if self.codecs is None else self.codecs[number]

    def base_of(self, number: int) -> Optional[int]:
        """The base whose object ``number`` is (None: this checkpoint's own)."""
        return None if self.object_bases is None else self.object_bases[number]

    def read_path(self, number: int) -> str:
        """Object ``number``'s path as readers name it: its own path, or for an object of a
        base ``../<base>/<path>`` (resolved against the checkpoint's parent location)."""
        b = self.base_of(number)
        p = self.objects[number][0]
        return p if b is None else f"{BASE_PREFIX}{self.bases[b][0]}/{p}"

    def sharing(self) -> dict[str, Any]:
        """What this checkpoint stores itself and what it shares with its bases
        ([SP-PACK-9]): ``{"own": {"chunks", "bytes"}, "bases": {name: {"chunks", "bytes",
        "identity"}}, "hashes": bool}`` (bytes: the records' stored lengths)."""
        owner = self.records["object"]
        n = self.records["length"]
        ob = np.array(
            [-1 if self.base_of(i) is None else self.base_of(i) for i in range(len(self.objects))]
            or [-1],
            np.int64,
        )
        who = ob[owner] if len(owner) else np.zeros(0, np.int64)
        own = who == -1
        out: dict[str, Any] = {
            "own": {"chunks": int(own.sum()), "bytes": int(n[own].sum())},
            "bases": {},
            "hashes": self.hashes is not None,
        }
        for b, (name, ident) in enumerate(self.bases):
            sel = who == b
            out["bases"][name] = {
                "chunks": int(sel.sum()),
                "bytes": int(n[sel].sum()),
                "identity": ident.hex(),
            }
        return out

    def array(self, name: str) -> PackedArray:
        """The part of the index of the array named ``name`` (KeyError where none)."""
        starts = getattr(self, "_starts", None)
        if starts is None:
            a = self.records["array"]
            starts = {}
            for i, (n, inner) in enumerate(self.arrays):
                lo, hi = np.searchsorted(a, i, "left"), np.searchsorted(a, i, "right")
                starts[n] = (inner, int(lo), int(hi), self.codec_of(i))
            self._starts = starts
        inner, lo, hi, codec = starts[name]
        objs = getattr(self, "_read_objects", None)
        if objs is None:
            objs = self._read_objects = tuple(
                (self.read_path(i), s) for i, (_p, s) in enumerate(self.objects)
            )
        hashes = None
        if self.hashes is not None:
            hashes = np.frombuffer(self.hashes, np.uint8).reshape(-1, HASH_BYTES)[lo:hi]
        return PackedArray(name, inner, self.records[lo:hi], objs, tuple(self.bases), hashes, codec)
