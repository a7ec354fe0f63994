"""(1.5) Compressed arrays for the independent reader, from spec/format.md [SP-ARRAY-7] and
[SP-READ-9] alone: the chain's form, each chunk file's size bounds, the bytes present, the
crc32c of the stored frame, and a decode that never produces more than the chunk's size.
The frame header is parsed here (RFC 8878 3.1.1); the blocks are decoded by ``zstandard``.
Never imports shardpoint.
"""

from __future__ import annotations

import math

import numpy as np

_MAGIC = b"\x28\xb5\x2f\xfd"


class ZstdVectorError(Exception):
    """A compressed array broke a rule; ``spec_id`` names it."""

    def __init__(self, spec_id: str, msg: str) -> None:
        super().__init__(f"[{spec_id}] {msg}")
        self.spec_id = spec_id


def is_zstd_chain(codecs, plain) -> bool:
    """``[bytes, zstd, crc32c]`` with the zstd configuration 1.5 defines (``plain``: the
    reader's own check of a ``[bytes, crc32c]`` pair); any other zstd form is not."""
    if not (isinstance(codecs, list) and len(codecs) == 3 and isinstance(codecs[1], dict)):
        return False
    z = codecs[1]
    conf = z.get("configuration")
    return (
        z.get("name") == "zstd"
        and set(z) == {"name", "configuration"}
        and isinstance(conf, dict)
        and set(conf) == {"level", "checksum"}
        and type(conf["level"]) is int
        and type(conf["checksum"]) is bool
        and plain([codecs[0], codecs[2]])
    )


def _declared(frame: bytes):
    """The content size a frame header declares (None: none), or raises ValueError."""
    if len(frame) < 6 or frame[:4] != _MAGIC:
        raise ValueError("no zstd magic number")
    fhd = frame[4]
    if fhd & 0x08:
        raise ValueError("reserved bit set")
    single = (fhd >> 5) & 1
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3]
    size = (1 if single else 0, 2, 4, 8)[fhd >> 6]
    if size == 0:
        return None
    if len(frame) < pos + size:
        raise ValueError("frame header cut short")
    v = int.from_bytes(frame[pos : pos + size], "little")
    return v + 256 if size == 2 else v


def _decode(frame: bytes, n: int, what: str) -> bytes:
    import zstandard

    try:
        declared = _declared(frame)
    except ValueError as e:
        raise ZstdVectorError("SP-READ-9", f"{what}: {e}") from None
    if declared is not None and declared != n:
        raise ZstdVectorError("SP-READ-9", f"{what}: header declares {declared}, chunk is {n}")
    try:  # the header checked: the library allocates n at most
        out = zstandard.ZstdDecompressor().decompress(
            frame, max_output_size=n, allow_extra_data=False
        )
    except zstandard.ZstdError as e:
        raise ZstdVectorError("SP-READ-9", f"{what}: {e}") from None
    if len(out) != n:
        raise ZstdVectorError("SP-READ-9", f"{what}: decodes to {len(out)} bytes, not {n}")
    return out


def check_compressed(grid, chunk, shape, size, is_bool, key, regular, read, crc32c, mine):
    """Every chunk file of a compressed array, in the spec's order: present and within its
    size bounds, bytes present ([SP-READ-6] x 32768), then each one's crc32c, chunk table
    entry and a bounded decode. ``regular(name)`` -> size, ``read(name, n)`` -> bytes,
    ``mine(piece, unit, what)``: the chunk table check."""
    n = math.prod(chunk) * size
    least = 10 + 4 * max(1, -(-n // (1 << 17)))
    most = n + n // 128 + 4100
    stored = 0
    names = ["/".join(["c"] + [str(i) for i in idx]) for idx in np.ndindex(*grid)]
    for name in names:
        nbytes = regular(name)
        if not least <= nbytes <= most:
            raise ZstdVectorError("SP-READ-3", f"{key}: chunk {name} has {nbytes} bytes")
        stored += nbytes
    if stored * 32768 < math.prod(shape) * size:
        raise ZstdVectorError("SP-READ-6", f"{key}: declares more than any frame decodes to")
    for unit, name in enumerate(names):
        piece = read(name, most + 1)
        what = f"{key} chunk {name}"
        if crc32c(piece[:-4]) != int.from_bytes(piece[-4:], "little"):
            raise ZstdVectorError("SP-READ-3", f"{what}: crc32c mismatch")
        mine(piece, unit, what)
        data = _decode(piece[:-4], n, what)
        if is_bool and set(data) - {0, 1}:
            raise ZstdVectorError("SP-READ-3", f"{what}: bool byte other than 0/1")
