"""The independent reader's part for the packed layout (format 1.4, spec/format.md section
13), written from spec/ alone like :mod:`.independent_reader`, importing nothing of the core.

:func:`check_field` applies the manifest-level rules ([SP-PACK-2] to [SP-PACK-5]; 1.5: a
compressed array's entry and its records' bounds, [SP-PACK-12]) when the manifest is read;
:func:`export_tensor` then, per tensor read, checks its data objects
([SP-SEC-5], [SP-PACK-7], [SP-READ-2]) and writes the array as section 7 stores it (the
implied ``zarr.json`` of [SP-PACK-3] and one file per chunk holding the record's bytes,
each checked against its record's crc32c, [SP-PACK-6]) into a scratch directory, where
the reader's per-array checks and its TensorStore read run unchanged. Incremental
checkpoints ([SP-PACK-9], [SP-PACK-10]): objects of a base are read beside the checkpoint,
after the base's manifest envelope's sha256 was compared with the recorded identity; each
chunk's BLAKE3 digest (16 bytes) is compared with the recorded hash where there is one.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct

_COMPONENT = re.compile(r"[A-Za-z0-9_.~%\-]+\Z")
_REC = struct.Struct("<IIQQQI")  # array, object, chunk, offset, length, crc32c
_PLAIN = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
_SIZES = {
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


class PackedError(Exception):
    """A packed-layout rule broken: ``spec_id`` names it (the reader re-raises it as its
    own error class)."""

    def __init__(self, spec_id: str, msg: str) -> None:
        super().__init__(f"[{spec_id}] packed: {msg}")
        self.spec_id = spec_id


def _err(spec_id: str, msg: str) -> Exception:
    return PackedError(spec_id, msg)


def _grid(e: dict) -> int:
    return math.prod(-(-n // c) for n, c in zip(e["shape"], e["chunk_shape"]))


def check_field(p, entries: list) -> dict:
    """The packed field checked against the tensor entries ``[(key, entry)]``; returns
    array name -> (key, entry, inner, [records in chunk order]) and the objects."""
    if not (
        isinstance(p, dict)
        and {"objects", "arrays", "index"}
        <= set(p)
        <= {"objects", "arrays", "index", "bases", "hashes"}
        and isinstance(p["objects"], list)
        and isinstance(p["arrays"], list)
        and isinstance(p["index"], bytes)
    ):
        raise _err("SP-PACK-2", "the field is not {objects, arrays, index}")
    objects = p["objects"]
    for o in objects:
        if not (
            isinstance(o, list)
            and len(o) in (2, 3)
            and isinstance(o[0], str)
            and type(o[1]) is int
            and 0 <= o[1] < 1 << 63
            and (len(o) == 2 or type(o[2]) is int)
        ):
            raise _err("SP-PACK-2", f"object entry {o!r}")
    for o in objects:
        if any(c in (".", "..") or not _COMPONENT.match(c) for c in o[0].split("/")):
            raise _err("SP-SEC-1", f"unsafe object path {o[0]!r}")
    if len(objects) > 2**32 - 1 or "manifest.msgpack" in [o[0] for o in objects]:
        raise _err("SP-PACK-2", "too many objects, or one named manifest.msgpack")
    by_name = {e["array"]: (k, e) for k, e in entries}
    spaces: dict = {None: [n + "/" for n in by_name]}  # each base's objects apart
    for o in objects:
        spaces.setdefault(o[2] if len(o) == 3 else None, []).append(o[0] + "/")
    for names in spaces.values():
        names = sorted(names)
        if any(b.startswith(a) for a, b in zip(names, names[1:])):
            raise _err("SP-PACK-2", "two object paths or array names equal, or one inside another")
    arrays: list = []
    codecs: dict = {}  # (1.5) array name -> the codec object of its compressed chain
    for a in p["arrays"]:
        if not (
            isinstance(a, list)
            and len(a) in (2, 3)
            and isinstance(a[0], str)
            and (a[1] is None or isinstance(a[1], list))
            and (len(a) == 2 or (a[1] is None and isinstance(a[2], dict)))  # (1.5) [SP-PACK-12]
        ):
            raise _err("SP-PACK-2", f"array entry {a!r}")
        if a[0] not in by_name or a[0] in [x[0] for x in arrays]:
            raise _err("SP-PACK-2", f"array {a[0]!r} names no tensor entry, or twice")
        key, e = by_name[a[0]]
        inner = a[1]
        if inner is not None and not (
            len(inner) == len(e["chunk_shape"])
            and all(
                type(i) is int and i >= 1 and c % i == 0 for i, c in zip(inner, e["chunk_shape"])
            )
        ):
            raise _err("SP-PACK-3", f"{key}: inner chunk shape {inner!r}")
        arrays.append((a[0], key, e, inner or None))
        if len(a) == 3:
            codecs[a[0]] = a[2]
    if len(arrays) != len(by_name):
        raise _err("SP-PACK-2", "a tensor entry's array is not listed")
    raw = p["index"]
    if len(raw) % 36:
        raise _err("SP-PACK-4", "index is not a whole number of 36-byte records")
    if len(raw) // 36 != sum(_grid(e) for _n, _k, e, _i in arrays):
        raise _err("SP-PACK-4", "record count is not the number of chunks")
    recs = [_REC.unpack_from(raw, 36 * i) for i in range(len(raw) // 36)]
    for prev, r in zip(recs, recs[1:]):
        if (r[0], r[2]) <= (prev[0], prev[2]):
            raise _err("SP-PACK-4", "records not in strictly increasing (array, chunk) order")
    bases = p.get("bases", [])
    if not isinstance(bases, list) or not all(
        isinstance(b, list)
        and len(b) == 2
        and isinstance(b[0], str)
        and _COMPONENT.match(b[0])
        and b[0] not in (".", "..")
        and isinstance(b[1], bytes)
        and len(b[1]) == 32
        for b in bases
    ):
        raise _err("SP-PACK-9", "a base is not [one safe path component, 32 bytes]")
    used = {o[2] for o in objects if len(o) == 3}
    if len({b[0] for b in bases}) != len(bases) or used != set(range(len(bases))):
        raise _err("SP-PACK-9", "bases repeated, unused, or an object's base out of range")
    hashes = p.get("hashes")
    if hashes is not None and not (isinstance(hashes, bytes) and len(hashes) == 16 * len(recs)):
        raise _err("SP-PACK-10", "hashes are not 16 bytes per record")
    out: dict = {n: (k, e, inner, [], codecs.get(n)) for n, k, e, inner in arrays}
    for i, r in enumerate(recs):
        a, o, c, off, length, _crc = r
        if a >= len(arrays) or o >= len(objects):
            raise _err("SP-PACK-4", f"record {r}: array or object out of range")
        name, key, e, inner = arrays[a]
        if c >= _grid(e) or off + length > objects[o][1]:
            raise _err("SP-PACK-4", f"{key}: record {r} outside the grid or its object")
        size = _SIZES[e["dtype"]]
        codec = codecs.get(name)
        if codec is not None:  # (1.5) [SP-PACK-12]: the bounds of [SP-READ-9]
            n = math.prod(e["chunk_shape"]) * size
            zstd = codec.get("name") == "zstd"  # another codec: unsupported when read
            if zstd and not 10 + 4 * max(1, -(-n // (1 << 17))) <= length <= n + n // 128 + 4100:
                raise _err("SP-PACK-4", f"{key}: compressed chunk record of {length} bytes")
        elif inner is None and length != math.prod(e["chunk_shape"]) * size + 4:
            raise _err("SP-PACK-4", f"{key}: plain chunk record of {length} bytes")
        if (
            inner is not None
            and length < 16 * math.prod(ch // i for ch, i in zip(e["chunk_shape"], inner)) + 4
        ):
            raise _err("SP-PACK-4", f"{key}: shard record shorter than its index")
        out[name][3].append(
            r + ((hashes[16 * i : 16 * i + 16],) if hashes is not None else (None,))
        )
    spans = sorted((r[1], r[3], r[4]) for r in recs)
    for (o1, a1, n1), (o2, a2, _n2) in zip(spans, spans[1:]):
        if o1 == o2 and a1 + n1 > a2:
            raise _err("SP-PACK-5", f"records overlap in object {objects[o1][0]!r}")
    return {"arrays": out, "objects": objects, "bases": bases}


def _regular_file(root: str, rel: str) -> int:
    """Size of ``rel``: every component checked without following links ([SP-SEC-5])."""
    p = root
    parts = rel.split("/")
    for i, c in enumerate(parts):
        p = os.path.join(p, c)
        mode = os.lstat(p).st_mode  # FileNotFoundError: missing
        if (i < len(parts) - 1 and not stat.S_ISDIR(mode)) or (
            i == len(parts) - 1 and not stat.S_ISREG(mode)
        ):
            raise _err("SP-SEC-5", f"{rel} is a link or special file")
    return os.lstat(p).st_size


def _fill(dtype: str):
    return (
        False
        if dtype == "bool"
        else [0.0, 0.0]
        if dtype.startswith("complex")
        else 0.0
        if "float" in dtype
        else 0
    )


def _root_of(path: str, field: dict, o: int) -> str:
    """Where object ``o`` lies: the checkpoint, or its base beside it, whose manifest
    envelope's sha256 must be the identity recorded ([SP-PACK-9])."""
    obj = field["objects"][o]
    if len(obj) == 2:
        return path
    name, ident = field["bases"][obj[2]]
    root = os.path.join(os.path.dirname(os.path.abspath(path)), name)
    try:
        with open(os.path.join(root, "manifest.msgpack"), "rb") as f:
            env = _unpack_envelope(f.read())
    except FileNotFoundError:
        raise _err("SP-PACK-9", f"base {name!r} is missing") from None
    if not isinstance(env, dict) or env.get("sha256") != ident:
        raise _err("SP-PACK-9", f"base {name!r} is not the checkpoint recorded (replaced)")
    return root


def _blake3_16(data: bytes) -> bytes:
    import blake3

    return blake3.blake3(data).digest(16)


def _unpack_envelope(data: bytes):
    import msgpack

    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception:  # noqa: BLE001 - any undecodable envelope is not the base
        return None


def export_tensor(path: str, field: dict, name: str, scratch: str) -> None:
    """Write array ``name`` of the packed checkpoint at ``path`` as a section 7 array below
    ``scratch`` (zarr.json and chunk files), after checking its objects and records."""
    key, e, inner, recs, codec = field["arrays"][name]
    objects = field["objects"]
    roots = {o: _root_of(path, field, o) for o in sorted({r[1] for r in recs})}
    for o in sorted({r[1] for r in recs}):  # [SP-PACK-7], before any chunk
        rel, size = objects[o][0], objects[o][1]
        try:
            got = _regular_file(roots[o], rel)
        except FileNotFoundError:
            raise _err("SP-READ-2", f"{key}: data object {rel} is missing") from None
        if got < size:
            raise _err("SP-READ-3", f"{key}: data object {rel} holds {got} of {size} bytes")
    codecs = (
        [_PLAIN[0], codec, _PLAIN[1]]  # (1.5) the compressed chain, [SP-PACK-12]
        if codec is not None
        else _PLAIN
        if inner is None
        else [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": inner,
                    "codecs": _PLAIN,
                    "index_codecs": _PLAIN,
                    "index_location": "end",
                },
            }
        ]
    )
    meta = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": e["shape"],
        "data_type": e["dtype"],
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": e["chunk_shape"]}},
        "chunk_key_encoding": {"name": "default"},
        "fill_value": _fill(e["dtype"]),
        "codecs": codecs,
    }
    adir = os.path.join(scratch, *name.split("/"))
    os.makedirs(adir, exist_ok=True)
    with open(os.path.join(adir, "zarr.json"), "w") as f:
        json.dump(meta, f)
    grid = [-(-n // c) for n, c in zip(e["shape"], e["chunk_shape"])]
    for _a, o, c, off, length, crc, digest in recs:
        with open(os.path.join(roots[o], *objects[o][0].split("/")), "rb") as f:
            f.seek(off)
            data = f.read(length)
        if len(data) != length:
            raise _err("SP-READ-3", f"{key}: chunk {c} cut short in {objects[o][0]}")
        if int.from_bytes(data[-4:], "little") != crc:  # [SP-PACK-6]
            raise _err("SP-READ-8", f"{key}: chunk {c}'s stored crc32c is not its record's")
        if digest is not None and _blake3_16(data) != digest:
            raise _err("SP-PACK-10", f"{key}: chunk {c}'s BLAKE3 is not its recorded hash")
        idx, rest = [], c
        for g in reversed(grid):
            idx.append(rest % g)
            rest //= g
        cpath = os.path.join(adir, "c", *[str(i) for i in reversed(idx)])
        os.makedirs(os.path.dirname(cpath), exist_ok=True)
        with open(cpath, "wb") as f:
            f.write(data)
