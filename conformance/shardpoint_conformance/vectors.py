"""Golden vectors: small checkpoints written by the reference that every reader must read.

``generate(root)`` (re)writes ``root/valid/<case>/`` (a checkpoint + ``expected.json``) and
``root/invalid/<case>/`` (a damaged checkpoint + ``expected.json`` naming the error class and
requirement ID). Bytes are reproducible: the data comes from fixed seeds and the manifest's
``writer`` and ``created_unix`` are pinned. ``check_vectors(root)`` reads every valid case
twice, once with only tensorstore + msgpack + hashlib (an independent reader path) and once
with ``shardpoint.load``, and opens every invalid case expecting its documented error.

    python -m shardpoint_conformance.vectors generate spec/vectors
    python -m shardpoint_conformance.vectors check spec/vectors
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Optional

import msgpack
import numpy as np

DEFAULT_ROOT = Path(__file__).resolve().parents[2] / "spec" / "vectors"
PINNED_WRITER = "shardpoint-py/vectors"
PINNED_TIME = 1_790_000_000.0


def _specials(name: str, bits: int) -> list:
    """Five bit patterns that a lossy reader would get wrong: for floats -0.0, a NaN with a
    payload, -inf (e4m3fn has none: a negative NaN), the smallest subnormal, the largest
    finite; for integers the extremes, 0, all ones and 1; for bool 0 and 1."""
    table = {
        "float16": [0x8000, 0x7E01, 0xFC00, 0x0001, 0x7BFF],
        "bfloat16": [0x8000, 0x7FC1, 0xFF80, 0x0001, 0x7F7F],
        "float32": [0x80000000, 0x7FC00001, 0xFF800000, 0x00000001, 0x7F7FFFFF],
        "float64": [1 << 63, 0x7FF8000000000001, 0xFFF0000000000000, 1, 0x7FEFFFFFFFFFFFFF],
        "float8_e4m3fn": [0x80, 0x7F, 0xFF, 0x01, 0x7E],
        "float8_e5m2": [0x80, 0x7D, 0xFC, 0x01, 0x7B],
        "bool": [0, 1, 1, 0, 1],
    }
    if name in table:
        return [v.to_bytes(bits // 8, "little") for v in table[name]]
    if name.startswith("complex"):
        part = _specials("float32" if name == "complex64" else "float64", bits // 2)
        return [part[i] + part[(i + 1) % 5] for i in range(5)]   # real, then imaginary
    return [v.to_bytes(bits // 8, "little")
            for v in (1 << (bits - 1), (1 << (bits - 1)) - 1, 0, (1 << bits) - 1, 1)]


def _bits(dtype_name: str, shape: tuple, seed: int, specials: bool = False):
    """A tensor of random bits from ``seed`` (bool: 0/1), optionally starting with the
    dtype's special bit patterns; built from little-endian bytes, never from values."""
    from shardpoint import dtypes
    d = dtypes.from_name(dtype_name)
    n = int(np.prod(shape, dtype=np.int64)) * d.itemsize
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    if dtype_name == "bool":
        raw &= 1
    if specials:
        head = b"".join(_specials(dtype_name, d.itemsize * 8))
        raw[:len(head)] = np.frombuffer(head, dtype=np.uint8)
    return dtypes.numpy_to_torch(raw.view(d.numpy).reshape(shape).copy())  # little-endian host


def _obj_value(i: int) -> dict:
    """Entry ``i`` of the nested_tree sharded object: every kind of object value."""
    import torch
    return {"seed": 42 + i, "state": _bits("uint8", (16,), 103 + i), "pos": (i, "epoch"),
            "np": np.arange(3, dtype=np.float64) * i, 5: [None, True, 2.5, b"\x01"],
            "t": torch.tensor([i, -i], dtype=torch.int64)}


def _cases() -> dict:
    """Case name -> (state, save kwargs, manifest edit or None, format version). The 1.0
    vectors stay 1.0 checkpoints, so every 1.x reader is tested on them ([SP-VER-4])."""
    import torch
    import shardpoint as sp
    from shardpoint import dtypes
    from shardpoint_tensorstore import TensorStoreBackend
    all_dtypes = {name: _bits(name, (3, 5), i, specials=True)
                  for i, name in enumerate(dtypes.DTYPES)}
    nested = {
        "model": {"layers.0.weight": _bits("float32", (4, 3), 100),
                  "layers.0.bias": _bits("bfloat16", (4,), 101)},
        "optim": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": _bits("float32", (4, 3), 102)}},
                  "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": [0],
                                    "amsgrad": False, "name": None, "tag": b"\x00\x01"}]},
        "values": {"none": None, "true": True, "false": False, "int": -1234,
                   "int64_min": -(1 << 63), "uint64_max": (1 << 64) - 1, "float": 0.1,
                   "neg_zero": -0.0, "inf": float("inf"), "nan": float("nan"),
                   "str": "h\u00e9llo \u2713", "empty_str": "", "bytes": b"\x00\x01\xff",
                   "empty_bytes": b"", "np_float32": np.float32(1.5), "np_int8": np.int8(-7),
                   3: "an int key", "empty_list": [], "empty_dict": {}, "empty_tuple": ()},
        "iteration": 1234,
        "rng": sp.ShardedObject(_obj_value(0), 0, 1),
        "np": dtypes.torch_to_numpy(_bits("int16", (2, 2), 104)).copy(),
    }

    def three_ranks(m):
        # One process holds one index of a sharded object. A 3-rank gloo save (rank i holding
        # ShardedObject(_obj_value(i), i, 3), the rest replicated) writes this very manifest
        # and the same tensors/ bytes (checked when the vector was made).
        m.objects["rng"] = [_obj_value(i) for i in range(3)]
        m.save_world_size = 3

    big = _bits("float32", (37, 11), 200)
    backend = TensorStoreBackend(shard_above_bytes=256, inner_chunk_bytes=128)
    multi = {
        "grid": sp.ShardedTensor(big, (37, 11), (0, 0)),
        "rows": _bits("int32", (23, 4), 201),
        "small": _bits("uint16", (5, 3), 202),
    }
    multi_opts = sp.SaveOptions(plan=sp.PlanOptions(max_chunk_bytes=400,
                                                    chunk_overhead_bytes=0))
    empty = {"scalar": torch.tensor(3.5, dtype=torch.float64), "empty": torch.zeros(0, 4),
             "empty_int": torch.zeros(2, 0, 3, dtype=torch.int8),
             "scalar_bf16": torch.tensor(-0.0, dtype=torch.bfloat16)}
    keys = {"a/b c": torch.ones(2), "7": torch.zeros(1), 7: torch.full((1,), 7.0),
            "\u00fcn\u00ef": {"~x": torch.arange(3)}, "-3": {-3: torch.ones(1, dtype=torch.uint8)},
            "50%": torch.tensor([50], dtype=torch.int16), "..x": torch.tensor([True])}
    def stage_by_tensor(m):
        # Six ranks, one RNG state per (pipeline stage, tensor rank) on a 2 x 3 grid; a real
        # 6-rank save writes this manifest (tests/test_object_grid.py saves such grids).
        from shardpoint.model import ObjectValues
        m.objects["rng"] = ObjectValues([{"stage": s, "tp": t, "seed": 10 * s + t}
                                         for s in range(2) for t in range(3)], (2, 3))
        m.objects["per_stage"] = ObjectValues([(s, "stage") for s in range(2)], (2,))
        m.save_world_size = 6

    grid = {"rng": sp.ShardedObject(None, (0, 0), (1, 1)),
            "per_stage": sp.ShardedObject(None, 0, 1),
            "w": _bits("float32", (2, 3), 300)}
    v10, v11 = (1, 0), (1, 1)
    return {
        "all_dtypes": (all_dtypes, {}, None, v10),
        "nested_tree": (nested, {}, three_ranks, v10),
        "multi_chunk": (multi, {"backend": backend, "options": multi_opts}, None, v10),
        "empty_and_scalar": (empty, {}, None, v10),
        "key_escaping": (keys, {}, None, v10),
        "object_grid": (grid, {}, stage_by_tensor, v11),
    }


def _pin_manifest(path: str, edit=None, version=None) -> None:
    """Make the manifest reproducible: rewrite it through shardpoint.metadata's own
    decode/encode with ``writer`` and ``created_unix`` pinned (and ``edit`` applied)."""
    from shardpoint.metadata import decode_manifest, encode_manifest
    mpath = os.path.join(path, "manifest.msgpack")
    m = decode_manifest(open(mpath, "rb").read())
    m.writer, m.created_unix = PINNED_WRITER, PINNED_TIME
    m.format_version = version or m.format_version
    if edit is not None:
        edit(m)
    with open(mpath, "wb") as f:
        f.write(encode_manifest(m))


def _float(v: float):
    if v != v:
        return {"$float": "nan"}
    if v in (float("inf"), float("-inf")):
        return {"$float": "inf" if v > 0 else "-inf"}
    if v == 0.0 and math.copysign(1.0, v) < 0:
        return {"$float": "-0.0"}
    return v


def _array_json(dtype: str, shape: list, le_bytes: bytes) -> dict:
    return {"$array": dtype, "shape": list(shape), "sha256": hashlib.sha256(le_bytes).hexdigest()}


def _jsonable(v):
    """A value as loaded by shardpoint -> its JSON form in expected.json."""
    import torch
    from shardpoint import dtypes
    if isinstance(v, bytes):
        return {"$hex": v.hex()}
    if isinstance(v, tuple):
        return {"$tuple": [_jsonable(x) for x in v]}
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, torch.Tensor):
        v = dtypes.torch_to_numpy(v.contiguous())
    if isinstance(v, (np.ndarray, np.generic)):
        a = np.asarray(v)
        le = a.astype(a.dtype.newbyteorder("<"), copy=False)
        return _array_json(dtypes.from_numpy(a.dtype).name, a.shape, le.tobytes())
    if isinstance(v, float):
        return _float(v)
    return v


def _expected(path: str) -> dict:
    """expected.json through the reference: ``shardpoint.load`` walked along the manifest's
    tree. ``tree``: the skeleton (leaves name their key); ``tensors``: key -> shape, dtype,
    SHA-256 of the little-endian bytes; ``values`` and ``objects``: key -> JSON form."""
    import torch
    import shardpoint as sp
    from shardpoint import dtypes
    from shardpoint.keys import encode_key
    m = sp.read_metadata(path)
    state = sp.load(path)
    out = {"format_version": list(m.format_version), "tensors": {}, "values": {},
           "objects": {}}

    def walk(node, obj, path):
        for kind, typ in (("dict", dict), ("list", list), ("tuple", tuple)):
            if kind in node:
                if type(obj) is not typ:
                    raise AssertionError(f"{path}: loaded {type(obj).__name__}, tree has {kind}")
                items = node[kind]
                if kind == "dict":
                    if list(obj) != [k for k, _ in items]:
                        raise AssertionError(f"{path}: keys {list(obj)} != {items}")
                    return {kind: [[k, walk(n, obj[k], path + (k,))] for k, n in items]}
                if len(obj) != len(items):
                    raise AssertionError(f"{path}: length {len(obj)} != {len(items)}")
                return {kind: [walk(n, obj[i], path + (i,)) for i, n in enumerate(items)]}
        key = encode_key(path)
        if "tensor" in node:
            want = np.ndarray if node.get("origin") == "numpy" else torch.Tensor
            if not isinstance(obj, want):
                raise AssertionError(f"{key}: loaded {type(obj).__name__}, not {want.__name__}")
            a = obj if isinstance(obj, np.ndarray) else dtypes.torch_to_numpy(obj.contiguous())
            a = np.array(a, order="C")      # not ascontiguousarray: it makes 0-d arrays 1-d
            le = a.astype(a.dtype.newbyteorder("<"), copy=False)
            out["tensors"][key] = {"shape": list(a.shape), "dtype": dtypes.from_numpy(a.dtype).name,
                                   "sha256": hashlib.sha256(le.tobytes()).hexdigest()}
            return {"tensor": key}
        if "object" in node:
            out["objects"][key] = [_jsonable(v) for v in obj]
            return {"object": key}
        out["values"][key] = _jsonable(obj)
        return {"value": key}

    out["tree"] = walk(m.tree, state, ())
    return out


INVALID = {
    # name: (base case, damage, error class, spec id)
    "bad_checksum": ("multi_chunk", "flip_chunk", "CorruptCheckpointError", "SP-READ-3"),
    "bad_shard_index": ("multi_chunk", "flip_index", "CorruptCheckpointError", "SP-READ-3"),
    "missing_chunk": ("multi_chunk", "delete_chunk", "CorruptCheckpointError", "SP-READ-2"),
    "missing_inner_chunk": ("multi_chunk", "drop_inner", "CorruptCheckpointError", "SP-READ-2"),
    "missing_manifest": ("nested_tree", "delete_manifest", "IncompleteCheckpointError",
                         "SP-COMMIT-3"),
    "truncated_manifest": ("nested_tree", "truncate_manifest", "CorruptCheckpointError",
                           "SP-MAN-1"),
    "unknown_major_version": ("nested_tree", "major_2", "UnsupportedFormatError", "SP-VER-2"),
    "unknown_must_understand_field": ("nested_tree", "unknown_field",
                                      "UnsupportedFormatError", "SP-VER-3"),
    "path_traversal": ("nested_tree", "traversal", "CorruptCheckpointError", "SP-SEC-1"),
}


def _rewrite_body(path: str, edit) -> None:
    mpath = os.path.join(path, "manifest.msgpack")
    env = msgpack.unpackb(open(mpath, "rb").read())
    body = msgpack.unpackb(env["body"], strict_map_key=False,
                           ext_hook=lambda code, data: msgpack.ExtType(code, data))
    edit(body)
    raw = msgpack.packb(body, use_bin_type=True)
    with open(mpath, "wb") as f:
        f.write(msgpack.packb({"sha256": hashlib.sha256(raw).digest(), "body": raw},
                              use_bin_type=True))


def _shard_index_span(data: bytes, n_inner: int) -> tuple:
    """(start, stop) of the shard index (entries + crc32c) at the end of a shard."""
    return len(data) - (16 * n_inner + 4), len(data)


def _damage(path: str, how: str) -> None:
    grid0 = os.path.join(path, "tensors", "grid", "c", "0", "0")   # a 9x11 shard of 1x11
    mpath = os.path.join(path, "manifest.msgpack")
    if how == "flip_chunk":
        data = bytearray(open(grid0, "rb").read())
        data[len(data) // 3] ^= 0x10
        open(grid0, "wb").write(bytes(data))
    elif how == "flip_index":
        data = bytearray(open(grid0, "rb").read())
        data[_shard_index_span(data, 9)[0] + 3] ^= 0x01
        open(grid0, "wb").write(bytes(data))
    elif how == "drop_inner":
        # Mark inner chunk 2 as absent (offset = nbytes = 2**64-1) and re-seal the index, so
        # only the missing-chunk rule can catch it.
        data = bytearray(open(grid0, "rb").read())
        lo, hi = _shard_index_span(data, 9)
        idx = bytearray(data[lo:hi - 4])
        idx[32:48] = b"\xff" * 16
        data[lo:hi] = bytes(idx) + crc32c(bytes(idx)).to_bytes(4, "little")
        open(grid0, "wb").write(bytes(data))
    elif how == "delete_chunk":
        os.remove(grid0)
    elif how == "delete_manifest":
        os.remove(mpath)
    elif how == "truncate_manifest":
        data = open(mpath, "rb").read()
        open(mpath, "wb").write(data[: len(data) // 2])
    elif how == "major_2":
        _rewrite_body(path, lambda b: b.update(format_version=[2, 0]))
    elif how == "unknown_field":
        _rewrite_body(path, lambda b: b.update(checksums_v2={"must_understand": True}))
    elif how == "traversal":
        def edit(b):
            k = sorted(b["tensors"])[0]
            b["tensors"][k]["array"] = "../../outside"
        _rewrite_body(path, edit)
    else:
        raise ValueError(how)


def generate(root: Optional[str] = None) -> list:
    """Write every vector under ``root`` (default: the repository's spec/vectors)."""
    import shardpoint as sp
    root = Path(root or DEFAULT_ROOT)
    made = []
    for name, (state, kw, edit, version) in _cases().items():
        d = root / "valid" / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        sp.save(state, str(d / "checkpoint"), **kw)
        _pin_manifest(str(d / "checkpoint"), edit, version)
        (d / "expected.json").write_text(json.dumps(_expected(str(d / "checkpoint")),
                                                    indent=1, sort_keys=True) + "\n")
        made.append(str(d))
    for name, (base, how, cls, sid) in INVALID.items():
        d = root / "invalid" / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        shutil.copytree(root / "valid" / base / "checkpoint", d / "checkpoint")
        _damage(str(d / "checkpoint"), how)
        (d / "expected.json").write_text(json.dumps(
            {"base": base, "damage": how, "error": cls, "spec_id": sid}, indent=1) + "\n")
        made.append(str(d))
    return made


# ---------------------------------------------------------------- the independent reader
# Written from spec/ alone: msgpack, hashlib, json, tensorstore (and numpy, which tensorstore
# returns). No shardpoint import below this line.
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


_SAFE = set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_INT = re.compile(r"-?[0-9]+\Z")
_COMPONENT = re.compile(r"[A-Za-z0-9_.~%\-]+\Z")
_DTYPES = {"bool": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1, "uint16": 2,
           "uint32": 4, "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
           "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1}
_BYTES_CRC = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
_TOP = {"format", "format_version", "writer", "created_unix", "save_world_size", "tree",
        "tensors", "objects", "extensions"}
_ENTRY = {"array", "shape", "dtype", "chunk_shape"}


def spec_encode_component(c) -> str:
    """format.md section 2, written out again."""
    if isinstance(c, int) and not isinstance(c, bool):
        return str(c)
    if not isinstance(c, str) or c in ("", ".", ".."):
        raise VectorError("SP-KEY-2", f"component {c!r} cannot be part of a key")
    out = "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in c.encode("utf-8"))
    return "~" + out if _INT.match(out) else out


def _fill(dtype: str):
    return (False if dtype == "bool" else [0.0, 0.0] if dtype.startswith("complex")
            else 0.0 if "float" in dtype else 0)


def _check_zarr(arr_dir: str, e: dict, key: str) -> dict:
    try:
        meta = json.load(open(os.path.join(arr_dir, "zarr.json")))
    except (OSError, ValueError) as err:
        raise VectorError("SP-ARRAY-1", f"{key}: no readable zarr.json ({err})") from err
    want = {"zarr_format": 3, "node_type": "array", "shape": e["shape"], "data_type": e["dtype"],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": e["chunk_shape"]}}}
    for k, v in want.items():
        if meta.get(k) != v:
            raise VectorError("SP-ARRAY-2", f"{key}: zarr.json {k} is {meta.get(k)!r}, not {v!r}")
    if meta.get("chunk_key_encoding") != {"name": "default"} or \
            meta.get("fill_value") != _fill(e["dtype"]):
        raise VectorError("SP-ARRAY-3", f"{key}: chunk_key_encoding/fill_value")
    codecs = meta.get("codecs")
    # one-byte dtypes may omit the bytes codec's endian (Zarr v3); TensorStore does
    inner_ok = [_BYTES_CRC] + ([[{"name": "bytes"}, {"name": "crc32c"}]]
                               if _DTYPES[e["dtype"]] == 1 else [])
    if codecs not in inner_ok:
        ok = (len(codecs) == 1 and codecs[0]["name"] == "sharding_indexed"
              and codecs[0]["configuration"]["codecs"] in inner_ok
              and codecs[0]["configuration"]["index_codecs"] == _BYTES_CRC
              and codecs[0]["configuration"].get("index_location", "end") == "end")
        if not ok:
            raise VectorError("SP-ARRAY-2", f"{key}: codec chain {codecs!r}")
    return meta


def _check_chunks(arr_dir: str, e: dict, meta: dict, key: str) -> None:
    """Every chunk file present, every crc32c right (format.md sections 7 and 10)."""
    shape, chunk, size = e["shape"], e["chunk_shape"], _DTYPES[e["dtype"]]
    if 0 in shape:
        return   # no chunk holds an element
    grid = [-(-n // c) for n, c in zip(shape, chunk)]
    conf = meta["codecs"][0].get("configuration", {})
    inner = conf.get("chunk_shape") if meta["codecs"][0]["name"] == "sharding_indexed" else None
    for idx in np.ndindex(*grid):
        name = "/".join(["c"] + [str(i) for i in idx])
        try:
            data = open(os.path.join(arr_dir, *name.split("/")), "rb").read()
        except FileNotFoundError:
            raise VectorError("SP-READ-2", f"{key}: chunk {name} is missing") from None
        if inner is None:
            if len(data) != math.prod(chunk) * size + 4 or \
                    crc32c(data[:-4]) != int.from_bytes(data[-4:], "little"):
                raise VectorError("SP-READ-3", f"{key}: chunk {name} fails its crc32c")
            continue
        per = [c // i for c, i in zip(chunk, inner)]
        n = math.prod(per)
        lo = len(data) - (16 * n + 4)
        index = data[lo:-4]
        if lo < 0 or crc32c(index) != int.from_bytes(data[-4:], "little"):
            raise VectorError("SP-READ-3", f"{key}: shard {name} index fails its crc32c")
        start = [i * c for i, c in zip(idx, chunk)]
        for j, sub in enumerate(np.ndindex(*per)):
            off, nb = (int.from_bytes(index[16 * j + k:16 * j + k + 8], "little") for k in (0, 8))
            inside = all(s + q * i < dim for s, q, i, dim in zip(start, sub, inner, shape))
            if off == nb == (1 << 64) - 1:
                if inside:
                    raise VectorError("SP-READ-2", f"{key}: shard {name} lacks inner chunk {sub}")
                continue
            piece = data[off:off + nb]
            if nb != math.prod(inner) * size + 4 or \
                    crc32c(piece[:-4]) != int.from_bytes(piece[-4:], "little"):
                raise VectorError("SP-READ-3", f"{key}: shard {name} inner chunk {sub} crc32c")


def _value_json(v):
    """A decoded msgpack value -> its JSON form in expected.json (format.md section 6)."""
    if isinstance(v, msgpack.ExtType):
        if v.code == 2:
            return {"$tuple": [_value_json(x) for x in _unpack(v.data)]}
        if v.code == 1:
            dtype, shape, raw, origin = msgpack.unpackb(v.data, raw=False)
            if dtype not in _DTYPES or len(raw) != math.prod(shape) * _DTYPES[dtype] or \
                    origin not in ("torch", "numpy", "numpy-scalar"):
                raise VectorError("SP-VALUE-2", f"malformed array value {dtype} {shape}")
            return _array_json(dtype, shape, raw)
        raise VectorError("SP-VALUE-2", f"unknown extension type {v.code}")
    if isinstance(v, bytes):
        return {"$hex": v.hex()}
    if isinstance(v, list):
        return [_value_json(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _value_json(x) for k, x in v.items()}
    if isinstance(v, float):
        return _float(v)
    return v


def _nest(flat: list, grid: list) -> list:
    """Row-major values -> nested lists along the grid (format.md section 6)."""
    if len(grid) == 1:
        return flat
    step = len(flat) // grid[0]
    return [_nest(flat[i * step:(i + 1) * step], grid[1:]) for i in range(grid[0])]


def _unpack(b: bytes):
    return msgpack.unpackb(b, raw=False, strict_map_key=False,
                           ext_hook=lambda code, data: msgpack.ExtType(code, data))


def _must_understand(fields: dict, known: set, where: str) -> None:
    for k, v in fields.items():
        if k not in known and not (isinstance(v, dict) and v.get("must_understand") is False):
            raise VectorError("SP-VER-3", f"{where}: unknown field {k!r}")


def read_independently(path: str) -> dict:
    """Read a checkpoint following spec/ only, with msgpack + hashlib + json + tensorstore;
    return the same dict as expected.json, or raise :class:`VectorError` naming the rule."""
    import tensorstore as ts
    mpath = os.path.join(path, "manifest.msgpack")
    if not os.path.isfile(mpath):
        raise VectorError("SP-COMMIT-3", f"{path} has no manifest.msgpack: not a checkpoint")
    if os.path.getsize(mpath) > 1 << 30:
        raise VectorError("SP-SEC-2", "manifest over 1 GiB")
    try:
        env = msgpack.unpackb(open(mpath, "rb").read(), raw=False)
        ok = (isinstance(env, dict) and set(env) == {"sha256", "body"}
              and isinstance(env["body"], bytes)
              and hashlib.sha256(env["body"]).digest() == env["sha256"])
    except Exception as err:  # noqa: BLE001 - any decoding failure is this rule
        raise VectorError("SP-MAN-1", f"envelope does not decode: {err}") from err
    if not ok:
        raise VectorError("SP-MAN-1", "envelope malformed or SHA-256 mismatch")
    body = _unpack(env["body"])
    if body.get("format") != "shardpoint" or not isinstance(body.get("format_version"), list):
        raise VectorError("SP-MAN-2", "not a shardpoint manifest")
    if body["format_version"][0] != 1:
        raise VectorError("SP-VER-2", f"format version {body['format_version']}")
    _must_understand(body, _TOP, "manifest")
    _must_understand(body.get("extensions", {}), set(), "extensions")
    out = {"format_version": body["format_version"], "tensors": {}, "values": {},
           "objects": {}}
    for key, e in body["tensors"].items():
        _must_understand(e, _ENTRY, key)
        parts = e["array"].split("/")
        if any(p in (".", "..") or not _COMPONENT.match(p) for p in parts):
            raise VectorError("SP-SEC-1", f"{key}: unsafe array path {e['array']!r}")
        if e["dtype"] not in _DTYPES:
            raise VectorError("SP-DTYPE-1", f"{key}: dtype {e['dtype']!r}")
        arr_dir = os.path.join(path, *parts)
        meta = _check_zarr(arr_dir, e, key)
        _check_chunks(arr_dir, e, meta, key)
        t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": arr_dir + "/"},
                     "open": True, "fill_missing_data_reads": False}).result()
        a = np.array(t.read().result(), order="C")   # keeps a 0-d array 0-d
        le = a.astype(a.dtype.newbyteorder("<"), copy=False)
        out["tensors"][key] = {"shape": list(a.shape), "dtype": e["dtype"],
                               "sha256": hashlib.sha256(le.tobytes()).hexdigest()}
    for key, o in body["objects"].items():
        if o["count"] != len(o["values"]) or o["count"] < 1:
            raise VectorError("SP-MAN-3", f"{key}: count {o['count']}")
        _must_understand(o, {"count", "values", "shape"}, key)
        grid = o.get("shape", [o["count"]])
        if not grid or any(not isinstance(n, int) or n < 1 for n in grid) or \
                math.prod(grid) != o["count"]:
            raise VectorError("SP-OBJ-4", f"{key}: grid shape {grid!r}")
        flat = [_value_json(v) for v in o["values"]]
        out["objects"][key] = _nest(flat, grid)
    seen = []

    def walk(node, path):
        for kind in ("dict", "list", "tuple"):
            if kind in node:
                if kind == "dict":
                    return {kind: [[k, walk(n, path + (k,))] for k, n in node[kind]]}
                return {kind: [walk(n, path + (i,)) for i, n in enumerate(node[kind])]}
        key = "/".join(spec_encode_component(c) for c in path)
        for kind in ("tensor", "object"):
            if kind in node:
                if node[kind] != key or key not in body[kind + "s"]:
                    raise VectorError("SP-MAN-4", f"{kind} leaf {node[kind]!r} at {key!r}")
                seen.append((kind, key))
                return {kind: key}
        out["values"][key] = _value_json(node["value"])
        return {"value": key}

    out["tree"] = walk(body["tree"], ())
    if sorted(seen) != sorted([("tensor", k) for k in body["tensors"]] +
                              [("object", k) for k in body["objects"]]):
        raise VectorError("SP-MAN-4", "tree and tables disagree")
    return out


def check_vectors(root: Optional[str] = None) -> tuple:
    """(ok, report text) for every vector under ``root``: valid ones read both ways and
    compared with expected.json; invalid ones refused by both readers with the documented
    error class (shardpoint.load) and requirement ID (both)."""
    import shardpoint as sp
    from shardpoint import errors
    root = Path(root or DEFAULT_ROOT)
    lines, ok = [], True
    valid = sorted((root / "valid").iterdir()) if (root / "valid").is_dir() else []
    invalid = sorted((root / "invalid").iterdir()) if (root / "invalid").is_dir() else []
    if not valid or not invalid:
        return False, f"no vectors under {root}"
    for d in valid:
        exp = json.loads((d / "expected.json").read_text())
        ck = str(d / "checkpoint")
        try:
            ind = json.loads(json.dumps(read_independently(ck)))
            assert ind == exp, f"independent read differs from expected.json: {_diff(ind, exp)}"
            ref = json.loads(json.dumps(_expected(ck)))
            assert ref == exp, f"shardpoint.load differs from expected.json: {_diff(ref, exp)}"
            lines.append(f"valid/{d.name}: ok ({len(exp['tensors'])} tensors)")
        except Exception as e:  # noqa: BLE001
            ok = False
            lines.append(f"valid/{d.name}: FAILED {type(e).__name__}: {e}")
    for d in invalid:
        exp = json.loads((d / "expected.json").read_text())
        try:
            read_independently(str(d / "checkpoint"))
            ind = "no error"
        except VectorError as e:
            ind = e.spec_id
        try:
            sp.load(str(d / "checkpoint"))
            got = "no error"
        except errors.ShardpointError as e:
            got = f"{type(e).__name__} {e.spec_id}"
        good = got == f"{exp['error']} {exp['spec_id']}" and ind == exp["spec_id"]
        ok &= good
        lines.append(f"invalid/{d.name}: {'ok' if good else 'FAILED'} (shardpoint: {got}; "
                     f"independent: {ind}; expected {exp['error']} {exp['spec_id']})")
    return ok, "\n".join(lines)


def _diff(a: dict, b: dict) -> str:
    keys = sorted(set(a) | set(b))
    return "; ".join(f"{k}: {a.get(k)!r} != {b.get(k)!r}"[:400] for k in keys
                     if a.get(k) != b.get(k))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("generate", "check"):
        print(__doc__)
        return 2
    root = argv[1] if len(argv) > 1 else None
    if argv[0] == "generate":
        for p in generate(root):
            print(p)
        return 0
    ok, text = check_vectors(root)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
