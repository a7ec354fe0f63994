"""(1.5) Compressed chunks: the Zarr v3 ``zstd`` codec between ``bytes`` and ``crc32c``
(spec/format.md section 7, [SP-ARRAY-7]), the constants a writer writes and the bounds a
reader holds every compressed chunk to, so that a hostile one costs no more memory than the
chunk's decoded size.

The chain of a compressed array is ``bytes`` (little-endian), ``zstd``, ``crc32c``: the
crc32c covers the stored (compressed) bytes, so a damaged chunk is refused before any
decompression, and the chunk table ([SP-MAN-7]) records it as for any chunk. Compressed
arrays are never sharded (one frame per chunk). zarr-python and TensorStore read them.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

#: The version a checkpoint holding a compressed array says ([SP-VER-1]).
FORMAT_VERSION_1_5 = (1, 5)
#: The names ``compression=`` takes (``None``: the plain chain).
COMPRESSIONS = ("zstd",)
#: zstd's own default level, what a writer uses unless told otherwise.
ZSTD_DEFAULT_LEVEL = 3
#: The levels a writer accepts (zstd's fast levels below 1 included); readers ignore it.
ZSTD_LEVELS = range(-7, 23)
#: The most one zstd block regenerates (Block_Maximum_Size, RFC 8878 3.1.1.2.3) and the
#: least it is stored in (a 3-byte header and one byte of an RLE block): no zstd frame
#: decodes to more than ``MAX_RATIO`` times its size.
ZSTD_BLOCK_BYTES = 1 << 17
ZSTD_MIN_BLOCK = 4
MAX_RATIO = ZSTD_BLOCK_BYTES // ZSTD_MIN_BLOCK
_FRAME_MIN = 6  # magic number (4) and the smallest frame header (2)
_SLACK = 4096


def zstd_codec(level: int = ZSTD_DEFAULT_LEVEL) -> dict[str, Any]:
    """The ``zstd`` codec object a writer puts in ``zarr.json`` (as zarr-python writes it)."""
    return {"name": "zstd", "configuration": {"level": int(level), "checksum": False}}


def zstd_chain(level: int = ZSTD_DEFAULT_LEVEL) -> list[Any]:
    """The codec chain of a compressed array: ``bytes``, ``zstd``, ``crc32c``."""
    return [
        {"name": "bytes", "configuration": {"endian": "little"}},
        zstd_codec(level),
        {"name": "crc32c"},
    ]


def zstd_config_ok(codec: Any) -> bool:
    """A ``zstd`` codec object of the form 1.5 defines: exactly ``name`` and a
    ``configuration`` of exactly an integer ``level`` and a boolean ``checksum``."""
    if not (isinstance(codec, dict) and set(codec) == {"name", "configuration"}):
        return False
    conf = codec["configuration"]
    return (
        isinstance(conf, dict)
        and set(conf) == {"level", "checksum"}
        and type(conf["level"]) is int
        and type(conf["checksum"]) is bool
    )


def compression_of(codecs: Any) -> Optional[str]:
    """``"zstd"`` for a (checked) compressed chain, else None."""
    if isinstance(codecs, list) and len(codecs) == 3 and isinstance(codecs[1], dict):
        name = codecs[1].get("name")
        return name if name in COMPRESSIONS else None
    return None


def stored_bounds(decoded: int) -> Tuple[int, int]:
    """(least, most) bytes a compressed chunk file of ``decoded`` bytes may hold, its 4
    crc32c bytes included ([SP-READ-9]). The least is what any zstd frame of that size
    takes (every block of at most 128 KiB costs at least 4 bytes); the most lies above
    what zstd's encoder ever writes (its ``ZSTD_compressBound`` is under
    ``decoded + decoded // 256 + 64``)."""
    least = _FRAME_MIN + ZSTD_MIN_BLOCK * max(1, math.ceil(decoded / ZSTD_BLOCK_BYTES)) + 4
    return least, decoded + decoded // 128 + _SLACK + 4


def check_compression(name: Optional[str], level: Optional[int]) -> Optional[dict[str, Any]]:
    """The codec object for ``compression=name`` at ``level``, None for no compression;
    ``ValueError`` for a name or level the writer does not know."""
    if name is None:
        if level is not None:
            raise ValueError("compression_level without compression")
        return None
    if name not in COMPRESSIONS:
        raise ValueError(f"compression {name!r} is not one of {list(COMPRESSIONS)} (or None)")
    lv = ZSTD_DEFAULT_LEVEL if level is None else level
    if type(lv) is not int or lv not in ZSTD_LEVELS:
        raise ValueError(f"zstd compression level {level!r} is not an integer from -7 to 22")
    return zstd_codec(lv)
