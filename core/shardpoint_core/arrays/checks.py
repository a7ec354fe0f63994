"""Read-side checks of an array's files before TensorStore touches them (spec/format.md
section 7, spec/security.md [SP-SEC-5]).

TensorStore opens any valid Zarr v3 array and follows symlinks; a checkpoint reader must be
stricter: no symlinks or special files (a FIFO would block a read forever), chunk files and
shard indexes of possible sizes, and size-capped metadata. The zarr.json document's own
rules (codec chains, chunk key encodings, fill values) are :mod:`.meta_checks`', whose names
are re-exported here for the callers that import them from this module.
"""

from __future__ import annotations

import math
import os
import stat
from typing import Any, Iterable, Optional

import numpy as np

from shardpoint_core.format.compression import compression_of, stored_bounds
from shardpoint_core.arrays.meta_checks import (
    MAX_ZARR_JSON_BYTES,
    MAX_ZARR_JSON_DEPTH,
    ONE_BYTE,
    _corrupt,
    check_metadata,
    check_zarr_json,
    checked_zarr_json,
    has_crc,
    json_depth,
    metadata_problems,
    parse_zarr_json,
)

__all__ = [
    # this module's own
    "EMPTY_ENTRY",
    "check_array_objects",
    "check_backed_bytes",
    "check_chunk_places",
    "check_chunk_sizes",
    "check_regular_file",
    "check_shard_files",
    "check_shard_index",
    "chunk_file_sizes",
    "read_shard_index",
    "read_zarr_json",
    "scan_array",
    # re-exported from .meta_checks
    "MAX_ZARR_JSON_BYTES",
    "MAX_ZARR_JSON_DEPTH",
    "ONE_BYTE",
    "check_metadata",
    "check_zarr_json",
    "checked_zarr_json",
    "has_crc",
    "json_depth",
    "metadata_problems",
    "parse_zarr_json",
]


def check_regular_file(root: str, rel: str, key: str) -> int:
    """``lstat`` every component of ``root/rel`` below ``root``: real directories and a
    regular file, never a symlink, FIFO, socket or device ([SP-SEC-5]). Returns the size."""
    path = root
    parts = rel.split("/")
    for i, part in enumerate(parts):
        path = os.path.join(path, part)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise  # the caller knows which rule a missing file breaks
        except OSError as e:
            raise _corrupt(key, f"cannot stat {path!r}: {e}", "SP-SEC-5") from e
        want = stat.S_ISREG if i == len(parts) - 1 else stat.S_ISDIR
        if not want(st.st_mode):
            kind = (
                "a symlink"
                if stat.S_ISLNK(st.st_mode)
                else ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a regular file/directory")
            )
            raise _corrupt(
                key,
                f"{path!r} is {kind}; a checkpoint holds only regular files and directories",
                "SP-SEC-5",
            )
    return st.st_size


def chunk_file_sizes(meta: dict[str, Any], itemsize: int) -> tuple[Any, ...]:
    """(exact size of a plain-chain chunk file or None, least size of a shard file or, 1.5,
    of a compressed chunk file)."""
    chunk = meta["chunk_grid"]["configuration"]["chunk_shape"]
    codec = meta["codecs"][0]
    if compression_of(meta["codecs"]) is not None:  # (1.5) [SP-READ-9]
        return None, stored_bounds(math.prod(chunk) * itemsize)[0]
    if codec.get("name") != "sharding_indexed":
        return math.prod(chunk) * itemsize + 4, 0
    inner = codec["configuration"]["chunk_shape"]
    return None, 16 * math.prod(c // i for c, i in zip(chunk, inner)) + 4


_O_READ = (
    os.O_RDONLY
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
)


def _kind(e: os.DirEntry[str]) -> str:
    if e.is_symlink():
        return "a symlink"
    mode = e.stat(follow_symlinks=False).st_mode
    return (
        "a FIFO"
        if stat.S_ISFIFO(mode)
        else ("a directory" if stat.S_ISDIR(mode) else "not a regular file")
    )


def scan_array(root: str, array_path: str, key: str) -> tuple[Any, ...]:
    """One pass over a local array's files before anything of it is parsed: ``lstat`` of
    each directory from ``root`` down to the array, then one walk of the array directory in
    which every entry is a real directory or a regular file, told from the listing itself
    (no stat per entry) ([SP-SEC-5]); ``zarr.json`` read through a descriptor that follows
    no link and never blocks, with its cap ([SP-ARRAY-1], [SP-SEC-2]). Returns
    ``(zarr.json bytes, the chunk files' directory entries)`` for :func:`check_chunk_sizes`."""
    parts = array_path.split("/")
    path = os.path.join(root, parts[0])
    try:
        for i, part in enumerate(parts):
            if i:
                path = f"{path}/{part}"
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode):
                kind = (
                    "a symlink"
                    if stat.S_ISLNK(st.st_mode)
                    else ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a regular file/directory")
                )
                raise _corrupt(
                    key,
                    f"{path!r} is {kind}; a checkpoint holds only regular files and directories",
                    "SP-SEC-5",
                )
    except FileNotFoundError as e:
        raise _corrupt(key, f"array {array_path!r} has no zarr.json", "SP-ARRAY-1") from e
    except OSError as e:
        raise _corrupt(key, f"cannot stat {path!r}: {e}", "SP-SEC-5") from e
    zarr_json = None
    chunks = _ChunkEntries()
    # (directory, 0: the array's own, 1: chunks below it, 2: other; levels below c/)
    stack = [(path, 0, 0)]
    while stack:
        d, where, level = stack.pop()
        with os.scandir(d) as it:
            for ent in it:
                top = where == 0
                if top and ent.name == "zarr.json":
                    if not ent.is_file(follow_symlinks=False):
                        raise _corrupt(
                            key,
                            f"{ent.path!r} is {_kind(ent)}; a checkpoint holds "
                            "only regular files and directories",
                            "SP-SEC-5",
                        )
                    zarr_json = ent.path
                elif ent.is_dir(follow_symlinks=False):
                    below = where == 1 or top and ent.name == "c"
                    stack.append((ent.path, 1 if below else 2, level + 1 if below else 0))
                    if below:
                        chunks.dirs.append((ent.path, level))
                elif not ent.is_file(follow_symlinks=False):
                    raise _corrupt(
                        key,
                        f"{ent.path!r} is a symlink or special file; a "
                        "checkpoint holds only regular files and directories",
                        "SP-SEC-5",
                    )
                elif where == 1 or top and ent.name == "c":
                    chunks.append(ent)
                    chunks.levels.append(level)
    if zarr_json is None:
        raise _corrupt(key, f"array {array_path!r} has no zarr.json", "SP-ARRAY-1")
    try:
        fd = os.open(zarr_json, _O_READ)
    except FileNotFoundError as e:  # removed since it was listed
        raise _corrupt(key, f"array {array_path!r} has no zarr.json", "SP-ARRAY-1") from e
    except OSError as e:  # ELOOP: a link put there since
        raise _corrupt(key, f"cannot open {zarr_json!r}: {e}", "SP-SEC-5") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced since it was listed
            raise _corrupt(key, f"{zarr_json!r} is not a regular file", "SP-SEC-5")
        if st.st_size > MAX_ZARR_JSON_BYTES:
            raise _corrupt(
                key,
                f"zarr.json is {st.st_size} bytes, over the {MAX_ZARR_JSON_BYTES}-byte cap",
                "SP-SEC-2",
            )
        raw = _read_capped(fd, st.st_size)
    finally:
        os.close(fd)
    return raw, chunks


class _ChunkEntries(list[Any]):
    """The regular files below an array's ``c`` (``c`` itself for a 0-d array), with how many
    directories below ``c`` each lies (``levels``) and the directories there (``dirs``:
    ``(path, level)``), so that their places can be checked against the grid's rank."""

    def __init__(self) -> None:
        super().__init__()
        self.levels: list[Any] = []
        self.dirs: list[Any] = []


def check_chunk_places(entries: list[Any], ndim: int, key: str) -> None:
    """(1.3) Chunk files lie exactly ``ndim`` levels below ``c`` (``c/i/j``; ``c`` itself for
    a 0-d array) and directories only above them: a regular file where a directory of the
    chunk tree belongs, or a directory where a chunk file belongs, is [SP-SEC-5] (a reader
    opens only regular files, through real directories), never a missing chunk."""
    for e, level in zip(entries, getattr(entries, "levels", ())):
        if level != ndim:  # level: directories from the array's own down to the file
            raise _corrupt(
                key,
                f"{e.path!r} is a regular file where the chunk tree of a "
                f"{ndim}-dimensional array holds a directory",
                "SP-SEC-5",
            )
    for d, level in getattr(entries, "dirs", ()):
        if level >= ndim:
            raise _corrupt(
                key,
                f"{d!r} is a directory where the chunk tree of a "
                f"{ndim}-dimensional array holds a chunk file",
                "SP-SEC-5",
            )


def _read_capped(fd: int, size: int) -> bytes:
    """The file's bytes, at most :data:`MAX_ZARR_JSON_BYTES` + 1 (one more than the cap, so
    a file grown past it since ``fstat`` is seen). One read of the size ``fstat`` gave: a
    read of the cap itself would allocate a MiB per array."""
    raw = os.read(fd, size + 1)
    if len(raw) == size:
        return raw
    parts = [raw]  # shorter or longer than fstat said: read on up to the cap
    n = len(raw)
    while raw and n <= MAX_ZARR_JSON_BYTES:
        raw = os.read(fd, MAX_ZARR_JSON_BYTES + 1 - n)
        parts.append(raw)
        n += len(raw)
    return b"".join(parts)


def check_chunk_sizes(entries: list[Any], sizes: tuple[Any, ...], key: str) -> tuple[Any, ...]:
    """Every chunk file listed by :func:`scan_array` has a possible size ([SP-READ-5] as
    [SP-READ-3]; ``sizes`` from :func:`chunk_file_sizes`). Returns ``(chunk files, their
    bytes together)`` for :func:`check_backed_bytes`."""
    exact, least = sizes
    total = 0
    for e in entries:
        n = e.stat(follow_symlinks=False).st_size
        if (exact is not None and n != exact) or n < least:
            raise _corrupt(
                key,
                f"chunk file {e.path!r} has {n} bytes, not "
                f"{exact if exact is not None else f'>= {least}'} "
                "(truncated or extra bytes)",
                "SP-READ-3",
            )
        total += n
    return len(entries), total


def check_backed_bytes(
    key: str,
    array_path: str,
    shape: tuple[int, ...],
    chunk: tuple[int, ...],
    itemsize: int,
    found: tuple[Any, ...],
    ratio: int = 1,
) -> None:
    """A tensor may not declare more data than its chunk files hold ([SP-READ-6]): every
    element is stored once, in a whole chunk, so a valid array's chunk files hold at least
    ``prod(shape) * itemsize`` bytes. Checked before a reader allocates for the tensor, so a
    small checkpoint cannot make it allocate gigabytes. ``found`` is what
    :func:`check_chunk_sizes` returns; with fewer chunk files than the grid has, the missing
    ones fail the reads that need them instead ([SP-READ-2]). (1.5) ``ratio``: for a
    compressed array :data:`~shardpoint_core.format.compression.MAX_RATIO` (no zstd frame
    decodes to more than that many times its size, [SP-READ-9])."""
    files, stored = found
    declared = math.prod(shape) * itemsize
    expected = math.prod(-(-n // c) for n, c in zip(shape, chunk))
    if files < expected:
        # Missing chunks fail the read that needs them ([SP-READ-2], [SP-ERR-3]: a partial
        # read of present chunks may succeed); what is present is bounded per shard by
        # [SP-READ-7] and per plain chunk by its exact size.
        return
    if declared > stored * ratio:
        raise _corrupt(
            key,
            f"declares {declared} bytes of data but the chunk files of "
            f"{array_path!r} hold {stored} bytes in all"
            + (f" (at most {ratio}x that compressed)" if ratio > 1 else "")
            + "; data cannot back it "
            "(truncated, or a hostile checkpoint)",
            "SP-READ-6",
        )


EMPTY_ENTRY = 2**64 - 1


def check_shard_index(index: Any, data_end: int, key: str, where: str) -> None:
    """A shard index (``n x 2`` little-endian uint64: offset, nbytes): every present entry
    lies inside the shard's data (``offset + nbytes <= data_end``, the file size less the
    index, [SP-READ-5] as [SP-READ-3]) and no two present entries overlap or alias
    ([SP-READ-7]), so each stored byte backs at most one inner chunk. Absent entries are both ``2^64-1``; a half-absent one is
    damage ([SP-READ-3]). One sort, no per-entry Python loop."""
    idx = np.asarray(index, dtype=np.uint64).reshape(-1, 2)
    off, nb = idx[:, 0], idx[:, 1]
    absent = (off == EMPTY_ENTRY) & (nb == EMPTY_ENTRY)
    half = (off == EMPTY_ENTRY) ^ (nb == EMPTY_ENTRY)
    if half.any():
        i = int(np.flatnonzero(half)[0])
        raise _corrupt(
            key,
            f"{where}: shard index entry {i} is half absent ({int(off[i])}, {int(nb[i])})",
            "SP-READ-3",
        )
    off, nb = off[~absent], nb[~absent]
    if not off.size:
        return
    limit = np.uint64(data_end)
    bad = (off > limit) | (nb > limit) | (off > limit - np.minimum(nb, limit))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise _corrupt(
            key,
            f"{where}: shard index entry (offset {int(off[i])}, nbytes "
            f"{int(nb[i])}) reaches past the shard's data ({data_end} bytes)",
            "SP-READ-3",
        )
    order = np.argsort(off, kind="stable")
    o, n = off[order], nb[order]
    clash = o[1:] < o[:-1] + n[:-1]
    if clash.any():
        i = int(np.flatnonzero(clash)[0])
        raise _corrupt(
            key,
            f"{where}: shard index entries overlap or alias (offset "
            f"{int(o[i])} + {int(n[i])} bytes reaches {int(o[i + 1])}, where "
            "another inner chunk starts); each stored byte backs one inner chunk",
            "SP-READ-7",
        )


def read_shard_index(path: str, n_inner: int, key: str) -> np.ndarray:
    """The checked index of the shard file at ``path`` (crc32c, then
    :func:`check_shard_index`); raises the documented error for a damaged one."""
    import crc32c

    isz = 16 * n_inner
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < isz + 4:
            raise _corrupt(
                key,
                f"shard {path!r} has {size} bytes, too few for its {n_inner}-entry index",
                "SP-READ-3",
            )
        f.seek(size - isz - 4)
        raw = f.read(isz + 4)
    if len(raw) != isz + 4 or crc32c.crc32c(raw[:isz]) != int.from_bytes(raw[isz:], "little"):
        raise _corrupt(key, f"shard {path!r}: index checksum mismatch", "SP-READ-3")
    index = np.frombuffer(raw[:isz], "<u8").reshape(n_inner, 2)
    check_shard_index(index, size - isz - 4, key, f"shard {path!r}")
    return index


def check_shard_files(root: str, array_path: str, meta: dict[str, Any], key: str) -> int:
    """:func:`read_shard_index` on every shard file of a sharded array (nothing for a plain
    chain); returns how many were checked. Reads 16 bytes per inner chunk per shard."""
    codec = meta["codecs"][0]
    if codec.get("name") != "sharding_indexed":
        return 0
    chunk = meta["chunk_grid"]["configuration"]["chunk_shape"]
    inner = codec["configuration"]["chunk_shape"]
    n_inner = math.prod(c // i for c, i in zip(chunk, inner))
    base = os.path.join(root, array_path, "c")
    count = 0
    if os.path.isfile(base):
        read_shard_index(base, n_inner, key)
        return 1
    for dirpath, _dirs, files in os.walk(base):
        for f in sorted(files):
            read_shard_index(os.path.join(dirpath, f), n_inner, key)
            count += 1
    return count


def read_zarr_json(root: str, array_path: str, key: str) -> dict[str, Any]:
    """Load ``zarr.json`` with the size cap and the file checks ([SP-ARRAY-1], [SP-SEC-2])."""
    try:
        size = check_regular_file(root, array_path + "/zarr.json", key)
    except FileNotFoundError as e:
        raise _corrupt(key, f"array {array_path!r} has no zarr.json", "SP-ARRAY-1") from e
    if size > MAX_ZARR_JSON_BYTES:
        raise _corrupt(
            key, f"zarr.json is {size} bytes, over the {MAX_ZARR_JSON_BYTES}-byte cap", "SP-SEC-2"
        )
    with open(os.path.join(root, array_path, "zarr.json"), "rb") as f:
        raw = f.read(size + 1)  # not the cap: that would allocate a MiB
    meta = parse_zarr_json(raw, key, f"{array_path}/zarr.json")
    if not (
        isinstance(meta, dict) and meta.get("zarr_format") == 3 and meta.get("node_type") == "array"
    ):
        raise _corrupt(key, "zarr.json is not a Zarr v3 array", "SP-ARRAY-1")
    return meta


def check_array_objects(
    store: Any,
    array_path: str,
    key: str,
    sizes: tuple[Any, ...] = (None, 0),
    listed: Optional[Iterable[Any]] = None,
) -> tuple[Any, ...]:
    """:func:`scan_array` and :func:`check_chunk_sizes` for a store without files (object
    stores, memory): one listing of the array's chunk objects (``listed``: one made already,
    of these or more objects), each of a possible size ([SP-READ-5] as [SP-READ-3]). Returns
    ``(chunk objects, their bytes together)`` for :func:`check_backed_bytes` ([SP-READ-6])."""
    exact, least = sizes
    total = count = 0
    base = f"{array_path}/c"
    for info in store.list(base) if listed is None else listed:
        if info.key != base and not info.key.startswith(base + "/"):
            continue
        if (exact is not None and info.size != exact) or info.size < least:
            raise _corrupt(
                key,
                f"chunk object {info.key!r} has {info.size} bytes, not "
                f"{exact if exact is not None else f'>= {least}'} (truncated or "
                "extra bytes)",
                "SP-READ-3",
            )
        total += info.size
        count += 1
    return count, total
