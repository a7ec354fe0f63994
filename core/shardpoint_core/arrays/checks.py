"""Read-side checks of an array's files before TensorStore touches them (spec/format.md
section 7, spec/security.md [SP-SEC-5]).

TensorStore opens any valid Zarr v3 array and follows symlinks; a checkpoint reader must be
stricter: only the codec chains, chunk key encodings and fill values of the spec, no
symlinks or special files (a FIFO would block a read forever), and size-capped metadata.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from shardpoint_core.format.errors import CorruptCheckpointError, UnsupportedFormatError
from shardpoint_core.format.compression import (
    compression_of,
    stored_bounds,
    zstd_config_ok,
)
from shardpoint_core.format.spec import ArraySpec

MAX_ZARR_JSON_BYTES = 1 << 20
# Deepest nesting of JSON objects and arrays in a zarr.json, the document itself being level 1
# ([SP-ARRAY-6]); the spec's own documents need 7 levels.
MAX_ZARR_JSON_DEPTH = 32
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_BRACKET = re.compile(rb"[\[\]{}]")
ONE_BYTE = {"bool", "int8", "uint8", "float8_e4m3fn", "float8_e5m2"}
_KNOWN = {
    "zarr_format",
    "node_type",
    "shape",
    "data_type",
    "chunk_grid",
    "chunk_key_encoding",
    "fill_value",
    "codecs",
    "attributes",
    "dimension_names",
    "storage_transformers",
}


def _corrupt(key: str, msg: str, sid: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"tensor {key!r}: {msg}", spec_id=sid)


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
_CACHED_DOC_BYTES = 4096  # zarr.json documents remembered once checked: ours are ~400 B
_CACHED_DOCS = 256
# (zarr.json bytes, shape, dtype, chunk) -> checked meta
_CHECKED: dict[tuple[bytes, tuple[int, ...], str, tuple[int, ...]], dict[str, Any]] = {}


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


def checked_zarr_json(
    raw: bytes,
    shape: tuple[int, ...],
    dtype: str,
    chunk: tuple[int, ...],
    key: str,
    where: str = "zarr.json",
) -> dict[str, Any]:
    """``zarr.json`` bytes parsed by [SP-ARRAY-6] and checked by :func:`check_zarr_json`
    against the manifest's ``shape``, ``dtype`` and ``chunk``. The outcome depends on these
    alone, so a small document that passed is remembered and the next array with the same
    bytes and entry (the layers of a model) skips both; the dict returned is shared and
    must not be changed."""
    ck = (raw, shape, dtype, chunk)
    meta = _CHECKED.get(ck)
    if meta is not None:
        return meta
    meta = parse_zarr_json(raw, key, where)
    if not (
        isinstance(meta, dict) and meta.get("zarr_format") == 3 and meta.get("node_type") == "array"
    ):
        raise _corrupt(key, "zarr.json is not a Zarr v3 array", "SP-ARRAY-1")
    check_zarr_json(meta, shape, dtype, chunk, key)
    if len(raw) <= _CACHED_DOC_BYTES:
        if len(_CHECKED) >= _CACHED_DOCS:
            _CHECKED.clear()
        _CHECKED[ck] = meta
    checked: dict[str, Any] = meta
    return checked


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


def json_depth(raw: bytes) -> int:
    """Deepest nesting of objects and arrays in JSON text (the document is level 1), found
    without parsing or recursion: strings are blanked, then brackets counted."""
    bare = _JSON_STRING.sub(b'""', raw)
    if len(bare) <= 1 << 14:  # a usual zarr.json: a dozen brackets, no numpy overhead
        depth = deepest = 0
        for m in _BRACKET.finditer(bare):
            depth += 1 if m.group() in (b"[", b"{") else -1
            deepest = max(deepest, depth)
        return deepest
    b = np.frombuffer(bare, np.uint8)
    step = np.isin(b, (0x5B, 0x7B)).astype(np.int64) - np.isin(b, (0x5D, 0x7D)).astype(np.int64)
    return int(np.cumsum(step).max(initial=0))


def _json_int(token: str) -> Any:
    """JSON integers as ints, except ``-0``: read as negative zero (a float), which no
    fill value accepts ([SP-ARRAY-3]: parsers disagree on what ``-0`` is)."""
    v = int(token)
    return -0.0 if v == 0 and token.startswith("-") else v


def _json_float(token: str) -> Any:
    """JSON fractions and exponents as floats, except a non-zero number that binary64 rounds
    to zero (``1e-400``): kept as its text, which no fill value accepts ([SP-ARRAY-3]: the
    number's value counts, 1.3)."""
    v = float(token)
    if v == 0 and any(c in "123456789" for c in token.lower().split("e")[0]):
        return token
    return v


def _no_constant(token: str) -> Any:
    """``NaN``, ``Infinity`` and ``-Infinity`` are not JSON (RFC 8259): [SP-ARRAY-1], 1.3."""
    raise ValueError(f"{token} is not a JSON number (RFC 8259)")


class _RepeatedName(ValueError):
    pass


def _note(seen: set[Any], k: Any) -> bool:
    """Add ``k`` to ``seen``; False (so a ``k in seen or _note(seen, k)`` test goes on)."""
    seen.add(k)
    return False


def _unique_pairs(pairs: list[Any]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[Any] = set()
        dup = next(k for k, _ in pairs if k in seen or _note(seen, k))
        raise _RepeatedName(f"an object repeats the name {dup!r}")
    return d


def parse_zarr_json(raw: bytes, key: str, where: str = "zarr.json") -> Any:
    """Parse zarr.json bytes by the reader rules of [SP-ARRAY-6]: UTF-8 JSON, no object
    repeating a name, at most :data:`MAX_ZARR_JSON_DEPTH` levels (checked before the
    recursive C parser runs, so a deep document is an error, never a RecursionError)."""
    if len(raw) > MAX_ZARR_JSON_BYTES:
        raise _corrupt(
            key, f"{where} is {len(raw)} bytes, over the {MAX_ZARR_JSON_BYTES}-byte cap", "SP-SEC-2"
        )
    # Fewer brackets than the limit cannot nest past it (brackets in strings only add to the
    # count): the usual zarr.json skips the exact count, a C-speed scan instead of a regex.
    deep = raw.count(b"[") + raw.count(b"{") > MAX_ZARR_JSON_DEPTH
    depth = json_depth(raw) if deep else 0
    if depth > MAX_ZARR_JSON_DEPTH:
        raise _corrupt(
            key,
            f"{where} nests {depth} levels of objects/arrays, over the "
            f"{MAX_ZARR_JSON_DEPTH}-level limit",
            "SP-ARRAY-6",
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _corrupt(key, f"{where} is not UTF-8: {e}", "SP-ARRAY-6") from e
    try:
        return json.loads(
            text,
            object_pairs_hook=_unique_pairs,
            parse_int=_json_int,
            parse_float=_json_float,
            parse_constant=_no_constant,
        )
    except _RepeatedName as e:
        raise _corrupt(key, f"{where}: {e}", "SP-ARRAY-6") from e
    except (ValueError, RecursionError) as e:
        raise _corrupt(key, f"{where} is not JSON: {e}", "SP-ARRAY-1") from e


def _plain_chain(codecs: Any, dtype: str, index: bool = False) -> bool:
    if not (
        isinstance(codecs, list) and len(codecs) == 2 and all(isinstance(c, dict) for c in codecs)
    ):
        return False
    b, c = codecs
    crc_ok = (
        c.get("name") == "crc32c"
        and set(c) <= {"name", "configuration"}
        and c.get("configuration", {}) == {}
    )
    if b.get("name") != "bytes" or not set(b) <= {"name", "configuration"}:
        return False
    conf = b.get("configuration")
    endian_ok = conf == {"endian": "little"} or (
        not index and dtype in ONE_BYTE and (conf is None or conf == {})
    )
    return crc_ok and endian_ok


def _zstd_chain(codecs: Any, dtype: str, key: str) -> bool:
    """(1.5) ``codecs`` is ``[bytes, zstd, crc32c]`` ([SP-ARRAY-7]); a zstd codec whose
    configuration is not the one 1.5 defines (a later option) is *unsupported*."""
    if not (
        isinstance(codecs, list)
        and len(codecs) == 3
        and isinstance(codecs[1], dict)
        and codecs[1].get("name") == "zstd"
    ):
        return False
    if not _plain_chain([codecs[0], codecs[2]], dtype):
        return False
    if not zstd_config_ok(codecs[1]):
        raise UnsupportedFormatError(
            f"tensor {key!r}: zstd codec {codecs[1]!r} is not of the form format 1.5 defines "
            '({"name": "zstd", "configuration": {"level": <int>, "checksum": <bool>}})',
            spec_id="SP-ARRAY-1",
        )
    return True


def _is_zero(v: Any) -> bool:
    return type(v) in (int, float) and v == 0 and math.copysign(1.0, v) > 0


def _same_ints(got: Any, want: Sequence[int]) -> bool:
    """``got`` is the list of JSON integers ``want``: a float such as ``5.0`` or the ``-0``
    that :func:`_json_int` reads as ``-0.0`` compares equal in Python, yet is not one (1.3,
    [SP-ARRAY-2])."""
    return (
        isinstance(got, list)
        and len(got) == len(want)
        and all(type(g) is int and g == w for g, w in zip(got, want))
    )


def check_zarr_json(
    meta: dict[str, Any], shape: tuple[int, ...], dtype: str, chunk: tuple[int, ...], key: str
) -> None:
    """``zarr.json`` against the manifest entry and the spec ([SP-ARRAY-2/3/5])."""
    for k, v in meta.items():
        if k in _KNOWN:
            continue
        if isinstance(v, dict) and v.get("must_understand") is False:
            continue
        cls = UnsupportedFormatError if isinstance(v, dict) else CorruptCheckpointError
        raise cls(
            f"tensor {key!r}: zarr.json field {k!r} is not understood (and not marked "
            "must_understand: false)",
            spec_id="SP-ARRAY-5",
        )
    if meta.get("storage_transformers", []) != []:
        raise UnsupportedFormatError(
            f"tensor {key!r}: zarr.json has storage transformers", spec_id="SP-ARRAY-5"
        )
    dims = meta.get("dimension_names")
    if dims is not None and not (
        isinstance(dims, list)
        and len(dims) == len(shape)
        and all(d is None or isinstance(d, str) for d in dims)
    ):
        raise _corrupt(key, f"zarr.json dimension_names {dims!r} malformed", "SP-ARRAY-5")
    if not isinstance(meta.get("attributes", {}), dict):
        raise _corrupt(key, "zarr.json attributes is not an object", "SP-ARRAY-5")
    want_grid = {"name": "regular", "configuration": {"chunk_shape": list(chunk)}}
    problems = []
    if not _same_ints(meta.get("shape"), shape):
        problems.append(f"shape {meta.get('shape')!r} != manifest {list(shape)}")
    if meta.get("data_type") != dtype:
        problems.append(f"data_type {meta.get('data_type')!r} != manifest {dtype!r}")
    grid = meta.get("chunk_grid")
    if grid != want_grid or not _same_ints(grid["configuration"]["chunk_shape"], chunk):
        problems.append(f"chunk_grid {meta.get('chunk_grid')!r} != {want_grid}")
    codecs = meta.get("codecs")
    if _zstd_chain(codecs, dtype, key):
        pass  # (1.5) bytes, zstd, crc32c [SP-ARRAY-7]
    elif not _plain_chain(codecs, dtype):
        sh = codecs[0] if isinstance(codecs, list) and len(codecs) == 1 else None
        conf = sh.get("configuration") if isinstance(sh, dict) else None
        if not (
            isinstance(sh, dict) and sh.get("name") == "sharding_indexed" and isinstance(conf, dict)
        ):
            names = (
                [c.get("name") if isinstance(c, dict) else c for c in codecs]
                if isinstance(codecs, list)
                else codecs
            )
            if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
                # missing, empty or malformed: damage, not a later construct (1.3)
                problems.append(f"codecs {codecs!r} is not a list of named codecs")
            elif all(n in ("bytes", "crc32c", "sharding_indexed") for n in names):
                problems.append(
                    f"codec chain {names} is not one the spec allows (bytes "
                    "then crc32c, each chunk and shard index ending in crc32c)"
                )
            else:
                raise UnsupportedFormatError(
                    f"tensor {key!r}: codec chain {names} uses a codec format 1.x does not define",
                    spec_id="SP-ARRAY-1",
                )
        else:
            inner = conf.get("chunk_shape")
            nested = any(
                isinstance(c, dict) and c.get("name") == "sharding_indexed"
                for c in conf.get("codecs") or []
            )
            if nested:
                raise UnsupportedFormatError(
                    f"tensor {key!r}: nested sharding is outside format 1.x", spec_id="SP-ARRAY-1"
                )
            if not (
                set(conf) <= {"chunk_shape", "codecs", "index_codecs", "index_location"}
                and isinstance(inner, list)
                and len(inner) == len(chunk)
                and all(type(i) is int and i >= 1 and c % i == 0 for i, c in zip(inner, chunk))
                and _plain_chain(conf.get("codecs"), dtype)
                and _plain_chain(conf.get("index_codecs"), dtype, index=True)
                and conf.get("index_location", "end") == "end"
            ):
                problems.append(
                    f"sharding_indexed configuration {conf!r} is not one the spec allows"
                )
    if problems:
        raise _corrupt(
            key,
            "zarr.json disagrees with the manifest or the spec: " + "; ".join(problems),
            "SP-ARRAY-2",
        )
    cke = meta.get("chunk_key_encoding")
    if not (
        isinstance(cke, dict)
        and cke.get("name") == "default"
        and set(cke) <= {"name", "configuration"}
        and cke.get("configuration", {}) in ({}, {"separator": "/"})
    ):
        raise _corrupt(key, f"chunk_key_encoding {cke!r} is not default with '/'", "SP-ARRAY-3")
    fill = meta.get("fill_value")
    if dtype == "bool":
        ok = fill is False
    elif dtype.startswith("complex"):
        ok = isinstance(fill, list) and len(fill) == 2 and all(_is_zero(x) for x in fill)
    elif "float" in dtype:
        ok = _is_zero(fill)
    else:
        ok = type(fill) is int and fill == 0
    if not ok:
        raise _corrupt(key, f"fill_value {fill!r} is not +0/false for {dtype}", "SP-ARRAY-3")


def has_crc(codecs: list[Any]) -> bool:
    """Every chunk ends in crc32c: a chain whose last codec is crc32c, or one
    sharding_indexed codec whose inner and index chains both do ([SP-ARRAY-2])."""
    if not codecs:
        return False
    if len(codecs) == 1 and codecs[0].get("name") == "sharding_indexed":
        conf = codecs[0].get("configuration", {})
        return has_crc(conf.get("codecs", [])) and has_crc(conf.get("index_codecs", []))
    return bool(codecs[-1].get("name") == "crc32c")


def metadata_problems(shape: Any, meta: dict[str, Any], spec: ArraySpec) -> list[Any]:
    """Where a zarr.json disagrees with the manifest's entry ([SP-ARRAY-2])."""
    problems = []
    if tuple(shape) != tuple(spec.shape):
        problems.append(f"shape {tuple(shape)} != manifest {tuple(spec.shape)}")
    if meta.get("data_type") != spec.dtype:
        problems.append(f"data_type {meta.get('data_type')!r} != manifest {spec.dtype!r}")
    grid = meta.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape")
    if grid is not None and tuple(grid) != tuple(spec.chunk_shape):
        problems.append(f"chunk_shape {tuple(grid)} != manifest {tuple(spec.chunk_shape)}")
    if not has_crc(meta.get("codecs", [])):
        problems.append("codec chain has no crc32c")
    return problems


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


def check_metadata(
    shape: Any, meta: dict[str, Any], spec: ArraySpec, key: str, array_path: str
) -> None:
    """Refuse a zarr.json that disagrees with the manifest ([SP-ARRAY-2])."""
    problems = metadata_problems(shape, meta, spec)
    if problems:
        raise CorruptCheckpointError(
            f"tensor {key!r}: zarr.json of {array_path!r} "
            f"disagrees with the manifest: {'; '.join(problems)}",
            spec_id="SP-ARRAY-2",
        )
