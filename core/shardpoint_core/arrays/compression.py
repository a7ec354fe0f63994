"""(1.5) Encoding and decoding of compressed chunks ([SP-ARRAY-7], [SP-READ-9]): one zstd
frame per chunk, decoded into at most the chunk's decoded size whatever the frame says.

The library is ``zstandard`` (``pip install shardpoint[zstd]``), imported when a compressed
chunk is first met; Python 3.14's ``compression.zstd`` is used where it exists instead.
Without either, a compressed array is refused as *unsupported* (a reader) or the save is
refused before anything is written (a writer), each naming the package.

A frame's header may declare its decoded size; zstandard then allocates that size whatever
limit it is given, so the header is read first and a size other than the chunk's is refused
before anything is allocated (a decompression bomb: a few KiB declaring gigabytes).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from shardpoint_core.format.errors import (
    CorruptCheckpointError,
    InvalidOptionError,
    UnsupportedFormatError,
)

_INSTALL = "pip install 'shardpoint[zstd]' (the zstandard package)"
_LIB: Optional[Tuple[Callable[..., bytes], Callable[..., bytes]]] = None


def _stdlib() -> Tuple[Callable[..., bytes], Callable[..., bytes]]:
    from compression import zstd  # type: ignore[import-not-found]  # Python >= 3.14

    def enc(data: Any, level: int) -> bytes:
        out: bytes = zstd.compress(data, level=level)
        return out

    def dec(frame: bytes, n: int) -> bytes:
        d = zstd.ZstdDecompressor()
        out: bytes = d.decompress(frame, max_length=n)
        if not d.eof or d.unused_data:  # cut short, more than n bytes, or bytes after it
            raise ValueError("not exactly one whole frame")
        return out

    return enc, dec


def _zstandard() -> Tuple[Callable[..., bytes], Callable[..., bytes]]:
    import zstandard

    def enc(data: Any, level: int) -> bytes:
        return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(data)

    def dec(frame: bytes, n: int) -> bytes:
        out: bytes = zstandard.ZstdDecompressor().decompress(
            frame, max_output_size=n, allow_extra_data=False
        )
        return out

    return enc, dec


def _lib() -> Optional[Tuple[Callable[..., bytes], Callable[..., bytes]]]:
    global _LIB
    if _LIB is None:
        for make in (_stdlib, _zstandard):
            try:
                _LIB = make()
                break
            except ImportError:
                continue
    return _LIB


def require_zstd(what: str) -> None:
    """Raise :class:`InvalidOptionError` naming the package when no zstd library is there
    (a writer asked for ``compression="zstd"``): checked before anything is written."""
    if _lib() is None:
        raise InvalidOptionError(f"{what}: compression='zstd' needs a zstd library: {_INSTALL}")


def encode_zstd(data: Any, level: int) -> bytes:
    """One zstd frame of ``data`` (a C-contiguous buffer), its decoded size in its header."""
    lib = _lib()
    if lib is None:
        raise InvalidOptionError(f"compression='zstd' needs a zstd library: {_INSTALL}")
    return lib[0](data, level)


def frame_content_size(frame: bytes) -> Optional[int]:
    """The decoded size a zstd frame header declares, None when it declares none; raises
    ``ValueError`` when ``frame`` does not start with a zstd frame header (RFC 8878 3.1.1)."""
    if len(frame) < 6 or frame[:4] != b"\x28\xb5\x2f\xfd":
        raise ValueError("no zstd frame magic number")
    fhd = frame[4]
    fcs_flag, single, dict_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    if fhd & 0x08:
        raise ValueError("reserved bit of the frame header descriptor set")
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if size == 0:
        return None
    if len(frame) < pos + size:
        raise ValueError("frame header cut short")
    v = int.from_bytes(frame[pos : pos + size], "little")
    return v + 256 if size == 2 else v


def decode_zstd(frame: bytes, n: int, key: str, where: str) -> bytes:
    """The ``n`` decoded bytes of the zstd frame ``frame`` (its crc32c checked already),
    never allocating more than ``n``: a header declaring another size, a frame decoding to
    more or fewer bytes, bytes after the frame and any decoding error are *corrupt*
    ([SP-READ-9]); no zstd library here is *unsupported*."""
    lib = _lib()
    if lib is None:
        raise UnsupportedFormatError(
            f"tensor {key!r}: {where}: the array is compressed with zstd and this reader "
            f"has no zstd library: {_INSTALL}",
            spec_id="SP-ARRAY-7",
        )
    try:
        declared = frame_content_size(frame)
    except ValueError as e:
        raise _bomb(key, where, f"not a zstd frame: {e}") from e
    if declared is not None and declared != n:
        raise _bomb(
            key,
            where,
            f"the zstd frame declares {declared} decoded bytes, the chunk holds {n} "
            "(refused before decoding)",
        )
    try:
        out = lib[1](frame, n)
    except Exception as e:  # noqa: BLE001 - the library's errors, one spec error
        raise _bomb(key, where, f"zstd frame does not decode to the chunk's {n} bytes: {e}") from e
    if len(out) != n:
        raise _bomb(key, where, f"zstd frame decodes to {len(out)} bytes, the chunk holds {n}")
    return out


def _bomb(key: str, where: str, msg: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"tensor {key!r}: {where}: {msg}", spec_id="SP-READ-9")
