"""A checkpoint reader written from spec/ alone, to check the reference against.

Uses msgpack, hashlib, json, numpy and TensorStore (for the element reads, after checking
every file itself); never imports shardpoint. ``read_independently(path)`` returns the dict
that a valid vector's ``expected.json`` holds, or raises :class:`VectorError` naming the
requirement the checkpoint breaks (spec/format.md section 12 is its outline).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import tempfile

import msgpack
import numpy as np

from shardpoint_conformance.independent_packed import PackedError, check_field, export_tensor
from shardpoint_conformance.independent_zstd import (
    ZstdVectorError,
    check_compressed,
    is_zstd_chain,
)


class VectorError(Exception):
    """A checkpoint broke a rule of the spec; ``spec_id`` names it."""

    def __init__(self, spec_id: str, msg: str) -> None:
        super().__init__(f"[{spec_id}] {msg}")
        self.spec_id = spec_id


def _crc_table() -> list:
    out = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        out.append(c)
    return out


_CRC = _crc_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected, init and xor-out 0xFFFFFFFF), as Zarr's crc32c codec."""
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


DTYPES = {
    "bool": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
MAX_DEPTH = 256
_SAFE = set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_INT = re.compile(r"-?[0-9]+\Z")
_ENC = re.compile(r"(?:[A-Za-z0-9_.\-]|%[0-9A-F]{2})+\Z")
_COMPONENT = re.compile(r"[A-Za-z0-9_.~%\-]+\Z")
_TOP = {
    "format",
    "format_version",
    "writer",
    "created_unix",
    "save_world_size",
    "tree",
    "tensors",
    "objects",
    "extensions",
    "packed",
}  # the last: 1.4
_ENTRY = {"array", "shape", "dtype", "chunk_shape", "chunk_crc32c"}  # the last: 1.3
_OBJECT = {"count", "values", "shape"}
_ZARR_KNOWN = {
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


def float_json(v: float):
    """A float's JSON form in expected.json (NaN, infinities and -0.0 spelled out)."""
    if v != v:
        return {"$float": "nan"}
    if v in (float("inf"), float("-inf")):
        return {"$float": "inf" if v > 0 else "-inf"}
    if v == 0.0 and math.copysign(1.0, v) < 0:
        return {"$float": "-0.0"}
    return v


def array_json(dtype: str, shape: list, le_bytes: bytes) -> dict:
    return {"$array": dtype, "shape": list(shape), "sha256": hashlib.sha256(le_bytes).hexdigest()}


# ------------------------------------------------------------------ keys (format.md s.2)
def spec_encode_component(c) -> str:
    if isinstance(c, int) and not isinstance(c, bool):
        return str(c)
    if not isinstance(c, str) or c in ("", ".", ".."):
        raise VectorError("SP-KEY-2", f"component {c!r} cannot be part of a key")
    out = "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in c.encode("utf-8"))
    return "~" + out if _INT.match(out) else out


def spec_check_key(key) -> None:
    """[SP-KEY-2], [SP-KEY-3], [SP-KEY-4] on a key read from a manifest."""
    if not isinstance(key, str) or not key:
        raise VectorError("SP-KEY-3", f"key {key!r}")
    if len(key.encode()) > 4096:
        raise VectorError("SP-KEY-4", "key over 4096 bytes")
    for s in key.split("/"):
        if s in ("", ".", ".."):
            raise VectorError("SP-KEY-2", f"key {key!r} has component {s!r}")
        if _INT.match(s):
            if s != str(int(s)) or not -(1 << 63) <= int(s) < (1 << 64):
                raise VectorError("SP-KEY-3", f"integer component {s!r}")
            continue
        body = s[1:] if s.startswith("~") else s
        if not _ENC.match(body) or (s.startswith("~") and not _INT.match(body)):
            raise VectorError("SP-KEY-3", f"component {s!r}")
        raw = re.sub(r"%([0-9A-F]{2})", lambda m: chr(int(m.group(1), 16)), body)
        try:
            text = raw.encode("latin-1").decode("utf-8")
        except UnicodeDecodeError:
            raise VectorError("SP-KEY-3", f"component {s!r} is not UTF-8") from None
        if spec_encode_component(text) != s:
            raise VectorError("SP-KEY-3", f"component {s!r} is not canonical")


_RESERVED = re.compile(r"(CON|PRN|AUX|NUL|COM[0-9]|LPT[0-9])\Z", re.I)
_LETTERS = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


def spec_array_path(key: str) -> str:
    """The array path a 1.1 writer gives tensor ``key`` ([SP-LAYOUT-4], format.md section 3):
    readers never need it; it checks the writers' paths in the vectors."""
    parts = []
    for c in key.split("/"):
        letters = [ch for ch in re.sub(r"%[0-9A-F]{2}", "", c) if ch in _LETTERS]
        mask = sum(1 << i for i, ch in enumerate(letters) if ch.isupper())
        parts.append(f"{c}~{mask:x}" if mask else c)
    path = "tensors/" + "/".join(parts)
    if len(path.encode()) > 1024 or any(
        len(p.encode()) > 255 or p.endswith(".") or _RESERVED.match(p.split(".")[0]) for p in parts
    ):
        return "tensors/~h/" + hashlib.sha256(key.encode()).hexdigest()
    return path


# ------------------------------------------------------------- msgpack (format.md s.4, s.6)
def _pairs(pairs):
    keys = [k for k, _ in pairs]
    if any(type(k) not in (str, int) for k in keys):
        raise VectorError("SP-MAN-5", f"map key types {[type(k).__name__ for k in keys]}")
    if len(set(keys)) != len(keys):
        raise VectorError("SP-MAN-5", "a map repeats a key")
    return dict(pairs)


def _unpack(b: bytes):
    """One msgpack object, ext values kept as ExtType, SP-MAN-5 map rules."""
    return msgpack.unpackb(
        b,
        raw=False,
        strict_map_key=False,
        object_pairs_hook=_pairs,
        ext_hook=lambda code, data: msgpack.ExtType(code, data),
    )


def _ext2_items(v: msgpack.ExtType):
    """The items of an ext 2 tuple; a payload that is not one msgpack array is [SP-VALUE-2]."""
    try:
        items = _unpack(v.data)
    except VectorError:
        raise
    except Exception as e:  # noqa: BLE001 - any malformation is this rule
        raise VectorError("SP-VALUE-2", f"ext 2 payload: {e}") from e
    if not isinstance(items, list):
        raise VectorError("SP-VALUE-2", "ext 2 payload is not an array")
    return items


def _depth(v, level=1) -> int:
    """Nesting level of the deepest container; an ext 2 tuple and its payload's array are
    one level together, ext 1 payloads are leaves ([SP-MAN-5])."""
    if level > MAX_DEPTH:  # stop at the first level too deep (1.2: bounded work)
        return level
    if isinstance(v, msgpack.ExtType) and v.code == 2:
        return _depth(_ext2_items(v), level)
    if isinstance(v, dict):
        return max([level] + [_depth(x, level + 1) for x in v.values()])
    if isinstance(v, list):
        return max([level] + [_depth(x, level + 1) for x in v])
    return level


def value_json(v):
    """A decoded msgpack value -> its JSON form in expected.json (format.md section 6)."""
    if isinstance(v, msgpack.Timestamp):  # ext type -1, decoded by msgpack itself (1.3)
        raise VectorError("SP-VALUE-2", "unknown extension type -1 (a msgpack timestamp)")
    if isinstance(v, msgpack.ExtType):
        if v.code == 2:
            return {"$tuple": [value_json(x) for x in _ext2_items(v)]}
        if v.code == 1:
            try:
                dtype, shape, raw, origin = msgpack.unpackb(v.data, raw=False)
            except Exception as e:  # noqa: BLE001 - any malformation is this rule
                raise VectorError("SP-VALUE-2", f"ext 1 payload: {e}") from e
            ok = (
                dtype in DTYPES
                and isinstance(shape, list)
                and len(shape) <= 64
                and all(type(n) is int and 0 <= n < 1 << 63 for n in shape)  # SEC-2 limits
                and isinstance(raw, bytes)
                and len(raw) == math.prod(shape) * DTYPES[dtype]
                and origin in ("torch", "numpy", "numpy-scalar")
                and (origin != "numpy-scalar" or shape == [])
                and (dtype != "bool" or set(raw) <= {0, 1})
            )
            if not ok:
                raise VectorError("SP-VALUE-2", f"malformed array value {dtype} {shape}")
            return array_json(dtype, shape, raw)
        raise VectorError("SP-VALUE-2", f"unknown extension type {v.code}")
    if isinstance(v, bytes):
        return {"$hex": v.hex()}
    if isinstance(v, list):
        return [value_json(x) for x in v]
    if isinstance(v, dict):
        return {str(k): value_json(x) for k, x in v.items()}
    if isinstance(v, float):
        return float_json(v)
    return v


def _must_understand(fields: dict, known: set, where: str) -> None:
    for k, v in fields.items():
        if k not in known and not (isinstance(v, dict) and v.get("must_understand") is False):
            raise VectorError("SP-VER-3", f"{where}: unknown field {k!r}")


# ----------------------------------------------------------------- files (security.md)
def _regular(root: str, rel: str) -> int:
    """lstat each component below root: directories, then a regular file ([SP-SEC-5])."""
    path = root
    parts = rel.split("/")
    for i, p in enumerate(parts):
        path = os.path.join(path, p)
        mode = os.lstat(path).st_mode  # FileNotFoundError passes through
        if not (stat.S_ISREG(mode) if i == len(parts) - 1 else stat.S_ISDIR(mode)):
            raise VectorError("SP-SEC-5", f"{path} is not a regular file / directory")
    return os.lstat(path).st_size


def _read(root: str, rel: str, limit: int) -> bytes:
    _regular(root, rel)
    with open(os.path.join(root, *rel.split("/")), "rb") as f:
        return f.read(limit)


# ------------------------------------------------------------- Zarr (format.md s.7)
def _plain(codecs, dtype: str, index: bool = False) -> bool:
    if not (
        isinstance(codecs, list) and len(codecs) == 2 and all(isinstance(c, dict) for c in codecs)
    ):
        return False
    b, c = codecs
    if (
        c.get("name") != "crc32c"
        or set(c) - {"name", "configuration"}
        or c.get("configuration", {}) != {}
    ):
        return False
    if b.get("name") != "bytes" or set(b) - {"name", "configuration"}:
        return False
    conf = b.get("configuration")
    return conf == {"endian": "little"} or (not index and DTYPES[dtype] == 1 and conf in (None, {}))


def _json_depth(text: str) -> int:
    """Deepest nesting of objects/arrays in JSON text, strings skipped, no recursion."""
    depth = deepest = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


class _Repeated(Exception):
    pass


def _no_repeats(pairs):
    if len({k for k, _ in pairs}) != len(pairs):
        raise _Repeated("an object repeats a name")
    return dict(pairs)


def _zarr_json(raw: bytes, key: str) -> dict:
    """zarr.json by [SP-ARRAY-6] (1.2): UTF-8, <= 32 levels, no repeated names; a zero
    spelled with a minus sign is kept apart so no fill value accepts it ([SP-ARRAY-3])."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise VectorError("SP-ARRAY-6", f"{key}: zarr.json is not UTF-8") from err
    if _json_depth(text) > 32:
        raise VectorError("SP-ARRAY-6", f"{key}: zarr.json nests deeper than 32 levels")

    def number(t: str):  # 1.3: the value counts; 1e-400 is not zero, whatever binary64 says
        return t if float(t) == 0 and re.search(r"[1-9]", t.lower().split("e")[0]) else float(t)

    def constant(t: str):  # NaN, Infinity: not JSON (RFC 8259), [SP-ARRAY-1] (1.3)
        raise ValueError(f"{t} is not JSON")

    try:
        return json.loads(
            text,
            object_pairs_hook=_no_repeats,
            parse_int=lambda t: -0.0 if t.startswith("-") and int(t) == 0 else int(t),
            parse_float=number,
            parse_constant=constant,
        )
    except _Repeated as err:
        raise VectorError("SP-ARRAY-6", f"{key}: zarr.json: {err}") from err
    except ValueError as err:
        raise VectorError("SP-ARRAY-1", f"{key}: zarr.json is not JSON ({err})") from err


def _zero(v) -> bool:
    return type(v) in (int, float) and v == 0 and math.copysign(1.0, v) > 0


def _check_zarr(root: str, array: str, e: dict, key: str) -> dict:
    rel = array + "/zarr.json"
    try:
        if _regular(root, rel) > 1 << 20:
            raise VectorError("SP-SEC-2", f"{key}: zarr.json over 1 MiB")
        raw = _read(root, rel, 1 << 20)
    except OSError as err:
        raise VectorError("SP-ARRAY-1", f"{key}: no readable zarr.json ({err})") from err
    meta = _zarr_json(raw, key)
    if not (
        isinstance(meta, dict) and meta.get("zarr_format") == 3 and meta.get("node_type") == "array"
    ):
        raise VectorError("SP-ARRAY-1", f"{key}: not a Zarr v3 array")
    for k, v in meta.items():
        if k not in _ZARR_KNOWN and not (isinstance(v, dict) and v.get("must_understand") is False):
            raise VectorError("SP-ARRAY-5", f"{key}: zarr.json field {k!r}")
    if meta.get("storage_transformers", []) != []:
        raise VectorError("SP-ARRAY-5", f"{key}: storage transformers")
    dtype, chunk = e["dtype"], e["chunk_shape"]
    want = {
        "shape": e["shape"],
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
    }
    for k, v in want.items():  # json.dumps: 5.0 or -0 (read as -0.0) is no integer (1.3)
        if json.dumps(meta.get(k), sort_keys=True) != json.dumps(v, sort_keys=True):
            raise VectorError("SP-ARRAY-2", f"{key}: zarr.json {k} is {meta.get(k)!r}, not {v!r}")
    codecs = meta.get("codecs")
    if is_zstd_chain(codecs, lambda c: _plain(c, dtype)):
        pass  # (1.5) [SP-ARRAY-7]; any other zstd form is an unknown codec below
    elif not _plain(codecs, dtype):
        names = (
            [c.get("name") for c in codecs if isinstance(c, dict)]
            if isinstance(codecs, list)
            else []
        )
        if any(
            isinstance(n, str) and n not in ("bytes", "crc32c", "sharding_indexed") for n in names
        ):  # a missing or nameless codec is damage (1.3)
            raise VectorError("SP-ARRAY-1", f"{key}: unknown codec in {names}")
        conf = (
            codecs[0].get("configuration", {})
            if names == ["sharding_indexed"] and isinstance(codecs, list)
            else None
        )
        if not isinstance(conf, dict):
            raise VectorError("SP-ARRAY-2", f"{key}: codec chain {codecs!r}")
        if any(
            isinstance(c, dict) and c.get("name") == "sharding_indexed"
            for c in conf.get("codecs") or []
        ):
            raise VectorError("SP-ARRAY-1", f"{key}: nested sharding")
        inner = conf.get("chunk_shape")
        ok = (
            isinstance(inner, list)
            and len(inner) == len(chunk)
            and all(type(i) is int and i >= 1 and c % i == 0 for i, c in zip(inner, chunk))
            and not set(conf) - {"chunk_shape", "codecs", "index_codecs", "index_location"}
            and _plain(conf.get("codecs"), dtype)
            and _plain(conf.get("index_codecs"), dtype, index=True)
            and conf.get("index_location", "end") == "end"
        )
        if not ok:
            raise VectorError("SP-ARRAY-2", f"{key}: codec chain {codecs!r}")
    cke = meta.get("chunk_key_encoding")
    if not (
        isinstance(cke, dict)
        and cke.get("name") == "default"
        and not set(cke) - {"name", "configuration"}
        and cke.get("configuration", {}) in ({}, {"separator": "/"})
    ):
        raise VectorError("SP-ARRAY-3", f"{key}: chunk_key_encoding {cke!r}")
    fill = meta.get("fill_value")
    ok = (
        fill is False
        if dtype == "bool"
        else isinstance(fill, list) and len(fill) == 2 and all(map(_zero, fill))
        if dtype.startswith("complex")
        else _zero(fill)
        if "float" in dtype
        else type(fill) is int and fill == 0
    )
    if not ok:
        raise VectorError("SP-ARRAY-3", f"{key}: fill_value {fill!r}")
    return meta


def _check_piece(piece: bytes, n: int, size: int, bool_: bool, what: str) -> None:
    if len(piece) != n * size + 4:
        raise VectorError("SP-READ-3", f"{what}: {len(piece)} bytes, not {n * size + 4}")
    if crc32c(piece[:-4]) != int.from_bytes(piece[-4:], "little"):
        raise VectorError("SP-READ-3", f"{what}: crc32c mismatch")
    if bool_ and set(piece[:-4]) - {0, 1}:
        raise VectorError("SP-READ-3", f"{what}: bool byte other than 0/1")


def _check_chunks(root: str, array: str, e: dict, meta: dict, key: str) -> None:
    """Every chunk file present, regular, the right size, every crc32c right."""
    shape, chunk, size = e["shape"], e["chunk_shape"], DTYPES[e["dtype"]]
    if 0 in shape:
        return  # no chunk holds an element
    grid = [-(-n // c) for n, c in zip(shape, chunk)]
    sh = meta["codecs"][0]
    inner = sh["configuration"]["chunk_shape"] if sh["name"] == "sharding_indexed" else None
    is_bool = e["dtype"] == "bool"
    stored = 0
    n_inner = math.prod(c // i for c, i in zip(chunk, inner)) if inner else 0
    table = _chunk_table(e, key)  # 1.3: every unit's crc32c, [SP-MAN-7]
    units = max(n_inner, 1)
    if table is not None and len(table) != 4 * math.prod(grid) * units:
        raise VectorError(
            "SP-READ-8",
            f"{key}: chunk table of {len(table) // 4} entries for "
            f"{math.prod(grid) * units} stored units",
        )

    def mine(piece: bytes, unit: int, what: str) -> None:  # [SP-READ-8] (1.3)
        if table is not None and piece[-4:] != table[4 * unit : 4 * unit + 4]:
            raise VectorError(
                "SP-READ-8",
                f"{what}: its crc32c is not the one the manifest's "
                "chunk table records for this position",
            )

    if is_zstd_chain(meta["codecs"], lambda c: _plain(c, e["dtype"])):  # (1.5)
        try:
            check_compressed(
                grid,
                chunk,
                shape,
                size,
                is_bool,
                key,
                lambda name: _regular(root, f"{array}/{name}"),
                lambda name, n: _read(root, f"{array}/{name}", n),
                crc32c,
                mine,
            )
        except FileNotFoundError:
            raise VectorError("SP-READ-2", f"{key}: a chunk is missing") from None
        except ZstdVectorError as err:
            raise VectorError(err.spec_id, str(err).split("] ", 1)[1]) from err
        return
    for idx in np.ndindex(*grid):  # [SP-READ-6] (1.2): bytes present, before any read
        name = "/".join(["c"] + [str(i) for i in idx])
        try:
            nbytes = _regular(root, f"{array}/{name}")
        except FileNotFoundError:
            raise VectorError("SP-READ-2", f"{key}: chunk {name} is missing") from None
        if (inner is None and nbytes != math.prod(chunk) * size + 4) or (
            inner is not None and nbytes < 16 * n_inner + 4
        ):  # sizes first ([SP-ERR-2])
            raise VectorError("SP-READ-3", f"{key}: chunk {name} has {nbytes} bytes")
        stored += nbytes
    if stored < math.prod(shape) * size:
        raise VectorError(
            "SP-READ-6",
            f"{key}: declares {math.prod(shape) * size} bytes, its chunk files hold {stored}",
        )
    for number, idx in enumerate(np.ndindex(*grid)):
        name = "/".join(["c"] + [str(i) for i in idx])
        try:
            nbytes = _regular(root, f"{array}/{name}")
        except FileNotFoundError:
            raise VectorError("SP-READ-2", f"{key}: chunk {name} is missing") from None
        if inner is None:
            if nbytes != math.prod(chunk) * size + 4:
                raise VectorError("SP-READ-3", f"{key}: chunk {name} has {nbytes} bytes")
            piece = _read(root, f"{array}/{name}", nbytes)
            _check_piece(piece, math.prod(chunk), size, is_bool, f"{key} chunk {name}")
            mine(piece, number, f"{key} chunk {name}")
            continue
        data = _read(root, f"{array}/{name}", nbytes)
        per = [c // i for c, i in zip(chunk, inner)]
        n = math.prod(per)
        lo = len(data) - (16 * n + 4)
        if lo < 0:
            raise VectorError("SP-READ-3", f"{key}: shard {name} shorter than its index")
        index = data[lo:-4]
        if crc32c(index) != int.from_bytes(data[-4:], "little"):
            raise VectorError("SP-READ-3", f"{key}: shard {name} index fails its crc32c")
        start = [i * c for i, c in zip(idx, chunk)]
        want = math.prod(inner) * size + 4
        spans = sorted(
            (
                int.from_bytes(index[16 * j : 16 * j + 8], "little"),
                int.from_bytes(index[16 * j + 8 : 16 * j + 16], "little"),
            )
            for j in range(n)
        )
        spans = [(o, b) for o, b in spans if (o, b) != ((1 << 64) - 1, (1 << 64) - 1)]
        for (o1, b1), (o2, _b2) in zip(spans, spans[1:]):
            if o1 + b1 > o2 and o1 + b1 <= lo and o2 + _b2 <= lo:  # [SP-READ-7] (1.2)
                raise VectorError("SP-READ-7", f"{key}: shard {name} index entries overlap")
        for j, sub in enumerate(np.ndindex(*per)):
            off, nb = (int.from_bytes(index[16 * j + k : 16 * j + k + 8], "little") for k in (0, 8))
            inside = all(s + q * i < dim for s, q, i, dim in zip(start, sub, inner, shape))
            absent = off == nb == (1 << 64) - 1
            if not absent and ((1 << 64) - 1) in (off, nb):  # every entry (1.3)
                raise VectorError("SP-READ-3", f"{key}: shard {name} entry {sub} half absent")
            if not absent and off + nb > lo:  # every entry (1.3)
                raise VectorError("SP-READ-3", f"{key}: shard {name} entry {sub} past the index")
            if not inside:
                continue  # its bytes are never read ([SP-READ-5])
            if absent:
                raise VectorError("SP-READ-2", f"{key}: shard {name} lacks inner chunk {sub}")
            if nb != want or off + nb > lo:
                raise VectorError("SP-READ-3", f"{key}: shard {name} entry {sub} ({off}, {nb})")
            _check_piece(
                data[off : off + nb],
                math.prod(inner),
                size,
                is_bool,
                f"{key} shard {name} inner chunk {sub}",
            )
            mine(data[off : off + nb], number * n + j, f"{key} shard {name} inner chunk {sub}")


def _chunk_table(e: dict, key: str):
    """The 1.3 chunk table of a tensor entry (None when absent), its form checked
    ([SP-MAN-7]): exactly {"must_understand": false, "crc32c": bin of 4 bytes per unit}."""
    if "chunk_crc32c" not in e:
        return None
    v = e["chunk_crc32c"]
    if not (
        isinstance(v, dict)
        and set(v) == {"must_understand", "crc32c"}
        and v["must_understand"] is False
        and isinstance(v["crc32c"], bytes)
        and len(v["crc32c"]) % 4 == 0
    ):
        raise VectorError("SP-MAN-7", f"{key}: malformed chunk_crc32c field")
    return v["crc32c"]


# ------------------------------------------------------------------------ the reader
def _envelope_pairs(pairs):
    """The envelope's map: a repeated key is [SP-MAN-1] there, like any other envelope fault
    (1.3), not the body's [SP-MAN-5]."""
    if len({k for k, _ in pairs}) != len(pairs):
        raise ValueError("the envelope repeats a key")
    return dict(pairs)


def _manifest(path: str) -> dict:
    mpath = os.path.join(path, "manifest.msgpack")
    if not os.path.isdir(path) or not os.path.lexists(mpath):
        raise VectorError("SP-COMMIT-3", f"{path} has no manifest.msgpack: not a checkpoint")
    if _regular(path, "manifest.msgpack") > 1 << 30:
        raise VectorError("SP-SEC-2", "manifest over 1 GiB")
    try:
        env = msgpack.unpackb(
            _read(path, "manifest.msgpack", (1 << 30) + 1),
            raw=False,
            object_pairs_hook=_envelope_pairs,
        )
        ok = (
            isinstance(env, dict)
            and set(env) == {"sha256", "body"}
            and isinstance(env["body"], bytes)
            and isinstance(env["sha256"], bytes)
            and hashlib.sha256(env["body"]).digest() == env["sha256"]
        )
    except Exception as err:  # noqa: BLE001 - any decoding failure is this rule
        raise VectorError("SP-MAN-1", f"envelope does not decode: {err}") from err
    if not ok:
        raise VectorError("SP-MAN-1", "envelope malformed or SHA-256 mismatch")
    try:
        body = _unpack(env["body"])
    except VectorError:
        raise
    except msgpack.StackError as err:  # the decoder's own nesting limit (1.2)
        raise VectorError("SP-MAN-5", "body nests deeper than the decoder allows") from err
    except Exception as err:  # noqa: BLE001
        raise VectorError("SP-MAN-1", f"body does not decode: {err}") from err
    try:
        deep = _depth(body) > MAX_DEPTH
    except RecursionError:
        deep = True
    if deep:
        raise VectorError("SP-MAN-5", "body nests too deeply")
    value_json(body)  # every ext payload, ignorable fields included, is checked [SP-VALUE-2]
    if (
        not isinstance(body, dict)
        or body.get("format") != "shardpoint"
        or not isinstance(body.get("format_version"), list)
    ):
        raise VectorError("SP-MAN-2", "not a shardpoint manifest")
    if body["format_version"][0] != 1:
        raise VectorError("SP-VER-2", f"format version {body['format_version']}")
    _must_understand(body, _TOP, "manifest")
    _must_understand(body.get("extensions", {}), set(), "extensions")
    if not all(isinstance(body.get(f), dict) for f in ("tree", "tensors", "objects")):
        raise VectorError("SP-MAN-2", "tree, tensors and objects must be maps")
    return body


def _tree(body: dict, out: dict) -> dict:
    seen = []

    def walk(node, path):
        if not isinstance(node, dict) or len(node) != 1 and set(node) != {"tensor", "origin"}:
            raise VectorError("SP-MAN-4", f"node at {path!r}")
        kind = next(iter(node)) if len(node) == 1 else "tensor"
        if kind in ("dict", "list", "tuple"):
            items = node[kind]
            if kind == "dict":
                ks = [k for k, _ in items]
                if len(set(ks)) != len(ks) or any(type(k) not in (str, int) for k in ks):
                    raise VectorError("SP-MAN-4", f"dict keys at {path!r}")
                return {kind: [[k, walk(n, path + (k,))] for k, n in items]}
            return {kind: [walk(n, path + (i,)) for i, n in enumerate(items)]}
        key = "/".join(spec_encode_component(c) for c in path)
        if kind in ("tensor", "object"):
            if (
                node[kind] != key
                or key not in body[kind + "s"]
                or node.get("origin", "torch") not in ("torch", "numpy")
            ):
                raise VectorError("SP-MAN-4", f"{kind} leaf {node[kind]!r} at {key!r}")
            seen.append((kind, key))
            return {kind: key}
        if kind != "value":
            raise VectorError("SP-MAN-4", f"unknown node kind {kind!r}")
        v = node["value"]
        if isinstance(v, (list, dict)) or isinstance(v, msgpack.ExtType) and v.code != 1:
            raise VectorError("SP-MAN-4", f"value leaf at {key!r} is not a scalar")
        if isinstance(v, msgpack.ExtType):
            value_json(v)  # SP-VALUE-2 first
            if msgpack.unpackb(v.data, raw=False)[3] != "numpy-scalar":
                raise VectorError("SP-MAN-4", f"value leaf at {key!r} is an array")
        if len(key.encode()) > 4096:  # every leaf's key, a value's too (1.3)
            raise VectorError("SP-KEY-4", f"value leaf key of {len(key.encode())} bytes")
        out["values"][key] = value_json(v)
        return {"value": key}

    root = body["tree"]
    if not (
        isinstance(root, dict) and len(root) == 1 and next(iter(root)) in ("dict", "list", "tuple")
    ):
        raise VectorError("SP-MAN-4", "the root must be a dict, list or tuple node")
    tree = walk(root, ())
    if sorted(seen) != sorted(
        [("tensor", k) for k in body["tensors"]] + [("object", k) for k in body["objects"]]
    ):
        raise VectorError("SP-MAN-4", "tree and tables disagree")
    return tree


def _nest(flat: list, grid: list) -> list:
    """Row-major values -> nested lists along the grid (format.md section 6)."""
    if len(grid) == 1:
        return flat
    step = len(flat) // grid[0]
    return [_nest(flat[i * step : (i + 1) * step], grid[1:]) for i in range(grid[0])]


def read_independently(path: str) -> dict:
    """Read a checkpoint following spec/ only; return the same dict as expected.json, or
    raise :class:`VectorError` naming the rule. A full read: every tensor, every chunk."""
    body = _manifest(path)
    out = {"format_version": body["format_version"], "tensors": {}, "values": {}, "objects": {}}
    entries = []
    for key, e in body["tensors"].items():
        spec_check_key(key)
        if not isinstance(e, dict):
            raise VectorError("SP-MAN-3", f"{key}: entry is not a map")
        _must_understand(e, _ENTRY, key)
        ok = (
            isinstance(e.get("shape"), list)
            and isinstance(e.get("chunk_shape"), list)
            and all(type(n) is int and n >= 0 for n in e["shape"])
            and all(type(n) is int and n >= 1 for n in e["chunk_shape"])
            and len(e["shape"]) == len(e["chunk_shape"])
            and isinstance(e.get("array"), str)
        )
        if not ok:
            raise VectorError("SP-MAN-3", f"{key}: entry {e!r}")
        if len(e["shape"]) > 64 or any(n >= 1 << 63 for n in e["shape"] + e["chunk_shape"]):
            raise VectorError("SP-SEC-2", f"{key}: rank or dimension over the limits")
        if not isinstance(e.get("dtype"), str):  # a malformed field (1.3), not a dtype
            raise VectorError("SP-MAN-3", f"{key}: dtype {e.get('dtype')!r} is not a string")
        if e["dtype"] not in DTYPES:
            raise VectorError("SP-DTYPE-1", f"{key}: dtype {e.get('dtype')!r}")
        parts = e["array"].split("/")
        if any(p in (".", "..") or not _COMPONENT.match(p) for p in parts):
            raise VectorError("SP-SEC-1", f"{key}: unsafe array path {e['array']!r}")
        _chunk_table(e, key)
        entries.append((key, e))
    arrays = sorted(e["array"] + "/" for _, e in entries)
    if any(b.startswith(a) for a, b in zip(arrays, arrays[1:])):
        raise VectorError("SP-LAYOUT-2", "two tensors share an array, or one lies in another")
    for key, o in body["objects"].items():
        spec_check_key(key)
        if not (
            isinstance(o, dict)
            and type(o.get("count")) is int
            and o["count"] >= 1
            and isinstance(o.get("values"), list)
            and o["count"] == len(o["values"])
        ):
            raise VectorError("SP-MAN-3", f"{key}: object entry")
        _must_understand(o, _OBJECT, key)
        grid = o.get("shape", [o["count"]])
        if not (
            isinstance(grid, list)
            and grid
            and all(type(n) is int and n >= 1 for n in grid)
            and math.prod(grid) == o["count"]
        ):
            raise VectorError("SP-OBJ-4", f"{key}: grid shape {grid!r}")
        out["objects"][key] = _nest([value_json(v) for v in o["values"]], grid)
    out["tree"] = _tree(body, out)
    # 1.4: the packed layout; each tensor is exported as a section 7 array and read so
    try:
        packed = check_field(body["packed"], entries) if "packed" in body else None
        with tempfile.TemporaryDirectory(prefix="sp-packed-") as scratch:
            _read_tensors(path, entries, out, packed, scratch)
    except PackedError as e:
        raise VectorError(e.spec_id, str(e).split("] ", 1)[1]) from e
    return out


def _read_tensors(path: str, entries: list, out: dict, packed, scratch) -> None:
    import tensorstore as ts

    checkpoint = path
    for key, e in entries:
        if packed is not None:  # the array as section 7 stores it, in the scratch root
            export_tensor(checkpoint, packed, e["array"], scratch)
            path = scratch
        meta = _check_zarr(path, e["array"], e, key)
        arr_dir = os.path.join(path, *e["array"].split("/"))
        for dirpath, dirs, files in os.walk(arr_dir):
            for name in dirs + files:
                rel = os.path.relpath(os.path.join(dirpath, name), path).replace(os.sep, "/")
                mode = os.lstat(os.path.join(path, rel)).st_mode
                if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                    raise VectorError("SP-SEC-5", f"{rel} is a symlink or special file")
        _check_chunks(path, e["array"], e, meta, key)
        t = ts.open(
            {
                "driver": "zarr3",
                "kvstore": {"driver": "file", "path": arr_dir + "/"},
                "open": True,
                "fill_missing_data_reads": False,
            }
        ).result()
        a = np.array(t.read().result(), order="C")  # keeps a 0-d array 0-d
        le = a.astype(a.dtype.newbyteorder("<"), copy=False)
        out["tensors"][key] = {
            "shape": list(a.shape),
            "dtype": e["dtype"],
            "sha256": hashlib.sha256(le.tobytes()).hexdigest(),
        }
