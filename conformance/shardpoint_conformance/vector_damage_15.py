"""The golden vectors of format 1.5 (spec/CHANGELOG.md): compressed arrays ([SP-ARRAY-7],
[SP-READ-9]). The valid vector's zstd frames are made by :func:`simple_frame` (raw and RLE
blocks, RFC 8878), not by a zstd library, so that its bytes reproduce whatever library
version regenerates it; every zstd decoder reads them. The invalid vectors each replace the
one chunk of tensor ``zeros`` (4 KiB decoded) with a hostile frame, its crc32c and the
manifest's chunk table entry made right, so that only [SP-READ-9] catches it. The packed
ones ([SP-PACK-12]) do the same in ``packed_zstd``: the frame appended to the data object,
the record pointed at it.
"""

from __future__ import annotations

import os
import struct

from shardpoint_conformance.independent_reader import crc32c
from shardpoint_conformance.vector_damage import Damage, rewrite_body

BASE = "compressed_zstd"
_MAGIC = b"\x28\xb5\x2f\xfd"
_BLOCK = 1 << 17


def simple_frame(data: bytes, content_size: bool = True, claim: int = -1) -> bytes:
    """One zstd frame of ``data`` in blocks of at most 128 KiB, each an RLE block where all
    its bytes are equal, else a raw block. ``content_size``: the header declares the size
    (``claim`` instead of the true one when given), single segment; else a 128 KiB window."""
    if content_size:
        size = len(data) if claim < 0 else claim
        head = _MAGIC + bytes([0xE0]) + struct.pack("<Q", size)
    else:
        head = _MAGIC + bytes([0x00, 0x38])
    out = [head]
    for i in range(0, max(len(data), 1), _BLOCK):
        piece = data[i : i + _BLOCK]
        last = i + _BLOCK >= len(data)
        rle = len(set(piece)) == 1
        hdr = (len(piece) << 3) | ((1 if rle else 0) << 1) | (1 if last else 0)
        out.append(hdr.to_bytes(3, "little") + (piece[:1] if rle else piece))
    return b"".join(out)


def rle_bomb(total: int) -> bytes:
    """A frame without a declared size of RLE blocks regenerating ``total`` zero bytes,
    4 bytes per 128 KiB: a decompression bomb."""
    blocks = []
    left = total
    while left > 0:
        n = min(left, _BLOCK)
        left -= n
        blocks.append(((n << 3) | (1 << 1) | (1 if left == 0 else 0)).to_bytes(3, "little") + b"\0")
    return _MAGIC + bytes([0x00, 0x38]) + b"".join(blocks)


def _replace_zeros_chunk(frame: bytes):
    def go(path: str) -> None:
        stored = frame + crc32c(frame).to_bytes(4, "little")
        with open(os.path.join(path, "tensors", "zeros", "c", "0", "0"), "wb") as f:
            f.write(stored)

        def table(b: dict) -> None:
            t = b["tensors"]["zeros"]["chunk_crc32c"]
            t["crc32c"] = stored[-4:]

        rewrite_body(path, table)

    return go


PACKED_BASE = "packed_zstd"
_REC = struct.Struct("<IIQQQI")  # array, object, chunk, offset, length, crc32c


def _replace_packed_zeros_chunk(frame: bytes):
    """packed_zstd: ``frame`` and its crc32c appended to the data object holding tensor
    ``zeros``'s one chunk; its record (offset, length, crc32c), the object's size and the
    chunk table entry made right, so that only the frame's own rules can catch it."""

    def go(path: str) -> None:
        stored = frame + crc32c(frame).to_bytes(4, "little")

        def edit(b: dict) -> None:
            packed = b["packed"]
            a = [x[0] for x in packed["arrays"]].index(b["tensors"]["zeros"]["array"])
            raw = bytearray(packed["index"])
            i = next(j for j in range(len(raw) // 36) if _REC.unpack_from(raw, 36 * j)[0] == a)
            rec = list(_REC.unpack_from(raw, 36 * i))
            obj = packed["objects"][rec[1]]
            with open(os.path.join(path, *obj[0].split("/")), "ab") as f:
                f.write(stored)
            rec[3], rec[4] = obj[1], len(stored)
            rec[5] = int.from_bytes(stored[-4:], "little")
            obj[1] += len(stored)
            _REC.pack_into(raw, 36 * i, *rec)
            packed["index"] = bytes(raw)
            b["tensors"]["zeros"]["chunk_crc32c"]["crc32c"] = stored[-4:]

        rewrite_body(path, edit)

    return go


INVALID_1_5 = {
    "zstd_bomb": Damage(
        BASE,
        "CorruptCheckpointError",
        "SP-READ-9",
        "(1.5) tensors/zeros/c/0/0 (float32 [32, 32], one chunk of 4,096 decoded bytes) "
        "replaced by a zstd frame that declares no content size and whose 2,048 RLE blocks "
        "regenerate 256 MiB (8,198 bytes stored, inside the stored-size bounds), crc32c and "
        "chunk table entry right: a reader stops at 4,097 bytes",
        _replace_zeros_chunk(rle_bomb(256 << 20)),
    ),
    "zstd_declares_other_size": Damage(
        BASE,
        "CorruptCheckpointError",
        "SP-READ-9",
        "(1.5) tensors/zeros/c/0/0 replaced by a zstd frame whose header declares a content "
        "size of 2^40 bytes (one RLE block follows), crc32c and chunk table entry right: "
        "refused on the header, before anything is allocated",
        _replace_zeros_chunk(simple_frame(b"\0" * 1024, claim=1 << 40)),
    ),
    "packed_zstd_bomb": Damage(
        PACKED_BASE,
        "CorruptCheckpointError",
        "SP-READ-9",
        "(1.5 packed) tensor zeros's one chunk (float32 [32, 32], 4,096 decoded bytes) "
        "replaced by zstd_bomb's frame (no content size, 256 MiB of RLE blocks, 8,198 bytes "
        "stored, inside the bounds a record is held to), appended to its data object; the "
        "record's offset, length and crc32c, the object's size and the chunk table entry "
        "made right; envelope re-sealed: a reader stops at 4,097 bytes",
        _replace_packed_zeros_chunk(rle_bomb(256 << 20)),
    ),
    "packed_zstd_declares_other_size": Damage(
        PACKED_BASE,
        "CorruptCheckpointError",
        "SP-READ-9",
        "(1.5 packed) tensor zeros's one chunk replaced as in packed_zstd_bomb by "
        "zstd_declares_other_size's frame (a header declaring 2^40 bytes): refused on the "
        "header, before anything is allocated",
        _replace_packed_zeros_chunk(simple_frame(b"\0" * 1024, claim=1 << 40)),
    ),
    "packed_zstd_record_too_short": Damage(
        PACKED_BASE,
        "CorruptCheckpointError",
        "SP-PACK-4",
        "(1.5 packed) tensor zeros's one chunk replaced as in packed_zstd_bomb by the 4 "
        "bytes of a zstd magic number alone: a record of 8 bytes, below the 14 any frame of "
        "4,096 bytes takes with its crc32c ([SP-READ-9]), refused when the manifest is "
        "decoded ([SP-PACK-12]: no record stands for more than 32768 times its bytes)",
        _replace_packed_zeros_chunk(_MAGIC),
    ),
}
