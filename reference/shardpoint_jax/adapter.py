"""The conformance suite's adapter protocol for shardpoint_jax
(conformance/shardpoint_conformance/adapters.py describes it; nothing of it is imported):

    python -m shardpoint_jax.adapter capabilities
    python -m shardpoint_jax.adapter write CASE.json DIR
    python -m shardpoint_jax.adapter read DIR CASE.json OUT_DIR

Runs as one process with 4 host CPU devices: tensors are saved as jax.Arrays sharded over
them where their first dimension allows, and loaded into another sharding before the case's
region is cut out, so both the shard writer and the shard reader are exercised."""

from __future__ import annotations

import base64
import json
from typing import Optional
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

jax.config.update("jax_enable_x64", True)  # 64-bit dtypes stay 64-bit

from shardpoint_jax import __version__, load, save  # noqa: E402
from shardpoint_jax.dtypes import BY_NAME  # noqa: E402
from shardpoint_jax.loading import Checkpoint  # noqa: E402
from shardpoint_jax.tree import ShardedObject  # noqa: E402

FEATURES = ["values", "objects", "partial_read", "zero_size", "scalar"]
RAW_BITS: dict[str, np.dtype] = {
    "bfloat16": np.dtype("<u2"),
    "float8_e4m3fn": np.dtype("u1"),
    "float8_e5m2": np.dtype("u1"),
}


def from_npy(a: np.ndarray, dtype: str) -> np.ndarray:
    want = RAW_BITS.get(dtype, BY_NAME[dtype])
    if a.dtype.itemsize != want.itemsize or a.dtype.kind != want.kind:
        raise ValueError(f"npy dtype {a.dtype} does not carry {dtype}")
    a = a.astype(want.newbyteorder("<"), copy=False)
    return a.view(BY_NAME[dtype]) if dtype in RAW_BITS else a


def save_npy(path: str, a: np.ndarray, dtype: str) -> None:
    a = np.array(a, order="C")  # (ascontiguousarray makes a 0-d array 1-d)
    np.save(path, a.view(RAW_BITS[dtype]) if dtype in RAW_BITS else a, allow_pickle=False)


def decode(v):
    if isinstance(v, dict):
        if set(v) == {"$b64"}:
            return base64.b64decode(v["$b64"])
        return {k: decode(x) for k, x in v.items()}
    if isinstance(v, list):
        return [decode(x) for x in v]
    return v


def encode(v):
    if isinstance(v, (bytes, bytearray)):
        return {"$b64": base64.b64encode(bytes(v)).decode()}
    if isinstance(v, dict):
        return {str(k): encode(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [encode(x) for x in v]
    if isinstance(v, np.generic):
        return v.item()
    return v


def set_path(tree: dict, path: list, leaf) -> None:
    for c in path[:-1]:
        tree = tree.setdefault(c, {})
    tree[path[-1]] = leaf


def get_path(tree, path: list):
    for c in path:
        tree = tree[c]
    return tree


def sharding_for(shape, turn: int) -> NamedSharding:
    """Split the first (turn even) or last dimension over as many devices as divide it."""
    devs = jax.devices()
    mesh = Mesh(np.array(devs), ("d",))
    if not shape:
        return NamedSharding(mesh, P())
    dim = 0 if turn % 2 == 0 else len(shape) - 1
    for n in (4, 2):
        if shape[dim] % n == 0 and shape[dim] >= n:
            sub = Mesh(np.array(devs[:n]), ("d",))
            spec: list[Optional[str]] = [None] * len(shape)
            spec[dim] = "d"
            return NamedSharding(sub, P(*spec))
    return NamedSharding(mesh, P())


def write(case_json: str, ckpt: str) -> None:
    with open(case_json) as f:
        case = json.load(f)
    base = os.path.dirname(os.path.abspath(case_json))
    tree: dict = {}
    for i, t in enumerate(case["tensors"]):
        a = from_npy(np.load(os.path.join(base, t["file"]), allow_pickle=False), t["dtype"])
        set_path(tree, t["path"], jax.device_put(a, sharding_for(a.shape, i)))
    for v in case["values"]:
        set_path(tree, v["path"], decode(v["value"]))
    for o in case["objects"]:
        if len(o["values"]) != 1:
            raise ValueError(
                f"object {o['key']!r}: one process writes count 1, not {len(o['values'])}"
            )
        set_path(tree, o["path"], ShardedObject(decode(o["values"][0]), 0, 1))
    save(ckpt, tree)


def placeholder(v):
    if isinstance(v, dict):
        return {k: placeholder(x) for k, x in v.items()}
    if isinstance(v, list):
        return [placeholder(x) for x in v]
    return "<not loaded>"


def read(ckpt: str, case_json: str, out_dir: str) -> None:
    with open(case_json) as f:
        case = json.load(f)
    target: dict = {}
    for i, t in enumerate(case["tensors"]):
        set_path(
            target,
            t["path"],
            jax.ShapeDtypeStruct(
                tuple(t["shape"]), BY_NAME[t["dtype"]], sharding=sharding_for(t["shape"], i + 1)
            ),
        )
    for v in case["values"]:
        set_path(target, v["path"], placeholder(decode(v["value"])))
    for o in case["objects"]:
        set_path(target, o["path"], ShardedObject(None, 0, len(o["values"])))
    got = load(ckpt, target)
    ck = Checkpoint(ckpt)
    os.makedirs(out_dir, exist_ok=True)
    for i, t in enumerate(case["tensors"]):
        whole = np.asarray(get_path(got, t["path"]))
        r = t.get("read")
        if r:  # the region once more, read alone (only the chunks it touches)
            part = ck.read(t["key"], r["offset"], r["shape"])
            cut = whole[tuple(slice(o, o + n) for o, n in zip(r["offset"], r["shape"]))]
            if part.tobytes() != cut.tobytes():
                raise RuntimeError(f"{t['key']}: region read disagrees with the whole read")
            whole = part
        save_npy(os.path.join(out_dir, f"{i}.npy"), whole, t["dtype"])
    objs = []
    for o in case["objects"]:
        n = len(o["values"])
        vals = [get_path(got, o["path"]).value]
        for i in range(1, n):
            one: dict = {}
            set_path(one, o["path"], ShardedObject(None, i, n))
            vals.append(get_path(load(ckpt, one), o["path"]).value)
        objs.append([encode(v) for v in vals])
    with open(os.path.join(out_dir, "values.json"), "w") as f:
        json.dump(
            {"values": [encode(get_path(got, v["path"])) for v in case["values"]], "objects": objs},
            f,
        )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["capabilities"]:
            print(
                json.dumps(
                    {
                        "name": "shardpoint-jax",
                        "version": __version__,
                        "dtypes": list(BY_NAME),
                        "features": FEATURES,
                    }
                )
            )
        elif argv[:1] == ["write"] and len(argv) == 3:
            write(argv[1], argv[2])
        elif argv[:1] == ["read"] and len(argv) == 4:
            read(argv[1], argv[2], argv[3])
        else:
            print(
                "usage: capabilities | write CASE.json DIR | read DIR CASE.json OUT_DIR",
                file=sys.stderr,
            )
            return 2
    except Exception as e:  # noqa: BLE001 - the protocol reports failures on stderr
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
