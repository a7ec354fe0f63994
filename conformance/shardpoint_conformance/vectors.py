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
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

import msgpack
import numpy as np

DEFAULT_ROOT = Path(__file__).resolve().parents[2] / "spec" / "vectors"
PINNED_WRITER = "shardpoint-py/vectors"
PINNED_TIME = 1_790_000_000.0


def _bits(dtype_name: str, shape: tuple, seed: int):
    from shardpoint import dtypes
    d = dtypes.from_name(dtype_name)
    n = int(np.prod(shape, dtype=np.int64)) * d.itemsize
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    if dtype_name == "bool":
        raw &= 1
    return dtypes.numpy_to_torch(raw.view(d.numpy).reshape(shape).copy())


def _cases() -> dict:
    """Case name -> (state, save kwargs)."""
    import torch
    import shardpoint as sp
    from shardpoint import dtypes
    from shardpoint_tensorstore import TensorStoreBackend
    all_dtypes = {name: _bits(name, (3, 5), i) for i, name in enumerate(dtypes.DTYPES)}
    specials = torch.tensor([0x7FC00001, 0xFFC12345, 0x80000000, 0x00000001, 0x7F800000],
                            dtype=torch.int64).to(torch.int32).view(torch.float32)
    all_dtypes["float32_specials"] = specials
    nested = {
        "model": {"layers.0.weight": _bits("float32", (4, 3), 100),
                  "layers.0.bias": _bits("bfloat16", (4,), 101)},
        "optim": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": _bits("float32", (4, 3), 102)}},
                  "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": [0],
                                    "amsgrad": False, "name": None, "tag": b"\x00\x01"}]},
        "iteration": 1234,
        "rng": sp.ShardedObject({"seed": 42, "state": _bits("uint8", (16,), 103)}, 0, 1),
        "np": dtypes.torch_to_numpy(_bits("int16", (2, 2), 104)).copy(),
    }
    big = _bits("float32", (37, 11), 200)
    backend = TensorStoreBackend(shard_above_bytes=256, inner_chunk_bytes=128)
    multi = {
        "grid": sp.ShardedTensor(big, (37, 11), (0, 0)),
        "rows": _bits("int32", (23, 4), 201),
    }
    multi_opts = sp.SaveOptions(plan=sp.PlanOptions(max_chunk_bytes=400,
                                                    chunk_overhead_bytes=0))
    empty = {"scalar": torch.tensor(3.5, dtype=torch.float64), "empty": torch.zeros(0, 4),
             "empty_int": torch.zeros(2, 0, 3, dtype=torch.int8),
             "scalar_bf16": torch.tensor(-0.0, dtype=torch.bfloat16)}
    keys = {"a/b c": torch.ones(2), "7": torch.zeros(1), 7: torch.full((1,), 7.0),
            "ünï": {"~x": torch.arange(3)}, "-3": {-3: torch.ones(1, dtype=torch.uint8)}}
    return {
        "all_dtypes": (all_dtypes, {}),
        "nested_tree": (nested, {}),
        "multi_chunk": (multi, {"backend": backend, "options": multi_opts}),
        "empty_and_scalar": (empty, {}),
        "key_escaping": (keys, {}),
    }


def _pin_manifest(path: str) -> None:
    from shardpoint.metadata import decode_manifest, encode_manifest
    mpath = os.path.join(path, "manifest.msgpack")
    m = decode_manifest(open(mpath, "rb").read())
    m.writer, m.created_unix = PINNED_WRITER, PINNED_TIME
    with open(mpath, "wb") as f:
        f.write(encode_manifest(m))


def _expected(path: str) -> dict:
    """expected.json: per tensor key its shape, dtype and SHA-256 of the little-endian bytes;
    values and objects as JSON (bytes as {"$hex"}, arrays as {"$array": dtype, shape, sha})."""
    import shardpoint as sp
    from shardpoint import dtypes
    m = sp.read_metadata(path)
    state = sp.load(path)
    from shardpoint.keys import decode_key
    tensors = {}
    for key, e in m.tensors.items():
        t = state
        for c in decode_key(key):
            t = t[c]
        a = t if isinstance(t, np.ndarray) else dtypes.torch_to_numpy(t.contiguous())
        tensors[key] = {"shape": list(e.shape), "dtype": e.dtype,
                        "sha256": hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()}
    from shardpoint.model import iter_tree_leaves
    vals = {"/".join(map(str, p)): _jsonable(n["value"]) for p, n in iter_tree_leaves(m.tree)
            if "value" in n}
    objs = {k: [_jsonable(v) for v in vs] for k, vs in m.objects.items()}
    return {"format_version": list(m.format_version), "tensors": tensors, "values": vals,
            "objects": objs}


def _jsonable(v):
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
        return {"$array": dtypes.from_numpy(a.dtype).name, "shape": list(a.shape),
                "sha256": hashlib.sha256(a.tobytes()).hexdigest()}
    if isinstance(v, float) and v != v:
        return {"$float": "nan"}
    return v


INVALID = {
    # name: (base case, damage, error class, spec id)
    "bad_checksum": ("multi_chunk", "flip_chunk", "CorruptCheckpointError", "SP-READ-3"),
    "missing_chunk": ("multi_chunk", "delete_chunk", "CorruptCheckpointError", "SP-READ-2"),
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
    body = msgpack.unpackb(env["body"], strict_map_key=False)
    edit(body)
    raw = msgpack.packb(body, use_bin_type=True)
    with open(mpath, "wb") as f:
        f.write(msgpack.packb({"sha256": hashlib.sha256(raw).digest(), "body": raw},
                              use_bin_type=True))


def _damage(path: str, how: str) -> None:
    chunks = sorted(str(p) for p in Path(path, "tensors").rglob("*")
                    if p.is_file() and p.name != "zarr.json")
    mpath = os.path.join(path, "manifest.msgpack")
    if how == "flip_chunk":
        data = bytearray(open(chunks[0], "rb").read())
        data[len(data) // 3] ^= 0x10
        open(chunks[0], "wb").write(bytes(data))
    elif how == "delete_chunk":
        os.remove(chunks[0])
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


def generate(root: Optional[str] = None) -> list:
    """Write every vector under ``root`` (default: the repository's spec/vectors)."""
    import shardpoint as sp
    root = Path(root or DEFAULT_ROOT)
    made = []
    cases = _cases()
    for name, (state, kw) in cases.items():
        d = root / "valid" / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        sp.save(state, str(d / "checkpoint"), **kw)
        _pin_manifest(str(d / "checkpoint"))
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


# ------------------------------------------------------------------------------ checking
def read_independently(path: str) -> dict:
    """Read a checkpoint with tensorstore + msgpack + hashlib only (no shardpoint code):
    key -> (shape, dtype, sha256 of little-endian bytes)."""
    import tensorstore as ts
    env = msgpack.unpackb(open(os.path.join(path, "manifest.msgpack"), "rb").read())
    if hashlib.sha256(env["body"]).digest() != env["sha256"]:
        raise ValueError("manifest SHA-256 mismatch")
    body = msgpack.unpackb(env["body"], strict_map_key=False,
                           ext_hook=lambda code, data: msgpack.ExtType(code, data))
    assert body["format"] == "shardpoint" and body["format_version"][0] == 1
    out = {}
    for key, e in body["tensors"].items():
        parts = e["array"].split("/")
        assert all(p not in ("", ".", "..") for p in parts)
        t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file",
                                                     "path": os.path.join(path, e["array"])},
                     "open": True, "fill_missing_data_reads": False}).result()
        assert list(t.shape) == e["shape"] and t.dtype.name == e["dtype"]
        a = t.read().result()
        le = a.astype(a.dtype.newbyteorder("<"), copy=False)
        out[key] = (list(a.shape), e["dtype"], hashlib.sha256(le.tobytes()).hexdigest())
    return out


def check_vectors(root: Optional[str] = None) -> tuple:
    """(ok, report text) for every vector under ``root``."""
    import shardpoint as sp
    from shardpoint import errors
    root = Path(root or DEFAULT_ROOT)
    lines, ok = [], True
    valid = sorted((root / "valid").iterdir()) if (root / "valid").is_dir() else []
    invalid = sorted((root / "invalid").iterdir()) if (root / "invalid").is_dir() else []
    if not valid:
        return False, f"no vectors under {root}"
    for d in valid:
        exp = json.loads((d / "expected.json").read_text())
        ck = str(d / "checkpoint")
        try:
            ind = read_independently(ck)
            want = {k: (v["shape"], v["dtype"], v["sha256"]) for k, v in exp["tensors"].items()}
            assert ind == want, f"independent read differs: {set(ind.items()) ^ set(want.items())}"
            got = _expected(ck)
            assert got == exp, "shardpoint.load differs from expected.json"
            lines.append(f"valid/{d.name}: ok ({len(want)} tensors)")
        except Exception as e:  # noqa: BLE001
            ok = False
            lines.append(f"valid/{d.name}: FAILED {type(e).__name__}: {e}")
    for d in invalid:
        exp = json.loads((d / "expected.json").read_text())
        try:
            sp.load(str(d / "checkpoint"))
            ok = False
            lines.append(f"invalid/{d.name}: FAILED (loaded without error)")
        except errors.ShardpointError as e:
            good = type(e).__name__ == exp["error"] and e.spec_id == exp["spec_id"]
            ok &= good
            lines.append(f"invalid/{d.name}: {'ok' if good else 'FAILED'} "
                         f"({type(e).__name__} {e.spec_id}; expected {exp['error']} "
                         f"{exp['spec_id']})")
    return ok, "\n".join(lines)


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
