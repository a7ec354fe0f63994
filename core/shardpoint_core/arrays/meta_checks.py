"""The zarr.json document of an array, checked by the reader rules (spec/format.md section
7, [SP-ARRAY-1/2/3/5/6/7]): parsed strictly (size cap, depth, repeated names, ``-0``), then
held against the manifest's entry and the codec chains, chunk key encoding and fill values
the spec allows. Kept apart from :mod:`.checks`, the checks of the files themselves, so
both object stores and local files share one set of document rules.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Sequence

import numpy as np

from shardpoint_core.format.errors import CorruptCheckpointError, UnsupportedFormatError
from shardpoint_core.format.compression import zstd_config_ok
from shardpoint_core.format.spec import ArraySpec

__all__ = [
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


_CACHED_DOC_BYTES = 4096  # zarr.json documents remembered once checked: ours are ~400 B
_CACHED_DOCS = 256
# (zarr.json bytes, shape, dtype, chunk) -> checked meta
_CHECKED: dict[tuple[bytes, tuple[int, ...], str, tuple[int, ...]], dict[str, Any]] = {}


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
