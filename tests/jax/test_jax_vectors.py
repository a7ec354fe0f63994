"""shardpoint_jax reads every golden vector bit for bit and refuses every invalid one with the
documented error class and requirement ID (spec/vectors/, spec/README.md)."""

from __future__ import annotations

import hashlib
import json
import math
import os

import numpy as np
import pytest

pytest.importorskip("jax", reason="shardpoint_jax needs jax (pip install -e '.[jax]')")
import jax  # noqa: E402

import shardpoint_jax as sj  # noqa: E402

ROOT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "spec", "vectors"
)
VALID = sorted(os.listdir(os.path.join(ROOT, "valid")))
INVALID = sorted(os.listdir(os.path.join(ROOT, "invalid")))


def json_form(v):
    """A loaded value in expected.json's notation (spec/README.md)."""
    if isinstance(v, bytes):
        return {"$hex": v.hex()}
    if isinstance(v, tuple):
        return {"$tuple": [json_form(x) for x in v]}
    if isinstance(v, (np.ndarray, np.generic)):
        a = np.asarray(v)
        return {
            "$array": str(a.dtype) if a.dtype.name != "bool" else "bool",
            "shape": list(a.shape),
            "sha256": hashlib.sha256(a.tobytes()).hexdigest(),
        }
    if isinstance(v, float):
        if math.isnan(v):
            return {"$float": "nan"}
        if math.isinf(v):
            return {"$float": "inf" if v > 0 else "-inf"}
        if v == 0 and math.copysign(1, v) < 0:
            return {"$float": "-0.0"}
        return v
    if isinstance(v, dict):
        return {str(k): json_form(x) for k, x in v.items()}
    if isinstance(v, list):
        return [json_form(x) for x in v]
    return v


def leaves(tree, path=()):
    if isinstance(tree, dict):
        for k, x in tree.items():
            yield from leaves(x, path + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, x in enumerate(tree):
            yield from leaves(x, path + (i,))
    else:
        yield path, tree


@pytest.mark.parametrize("case", VALID)
def test_valid_vector_reads_bit_for_bit(case):
    with open(os.path.join(ROOT, "valid", case, "expected.json")) as f:
        exp = json.load(f)
    ck = os.path.join(ROOT, "valid", case, "checkpoint")
    back = sj.load(ck)
    from shardpoint_core.format.keys import encode_key

    flat = {encode_key(p): v for p, v in leaves(back)}
    for key, t in exp["tensors"].items():
        a = np.asarray(flat[key])
        assert a.dtype.name == t["dtype"], key
        assert math.prod(a.shape) == math.prod(t["shape"]) and a.ndim in (len(t["shape"]), 0)
        assert hashlib.sha256(a.tobytes()).hexdigest() == t["sha256"], key
    for key, v in exp["values"].items():
        assert json_form(flat[key]) == v, key
    for key, vals in exp["objects"].items():
        from shardpoint_core.format.keys import decode_component

        got = back
        for c in key.split("/"):
            got = got[decode_component(c)]
        assert json_form(got) == vals, key
        grid, last = [], vals
        while isinstance(last, list):
            grid.append(len(last))
            last = last[-1]
        one = sj.load(ck, _target_of(key, tuple(n - 1 for n in grid), tuple(grid)))
        leaf = [v for _, v in leaves(one)][0]
        assert json_form(leaf.value) == last


def _target_of(key, index, count):
    from shardpoint_core.format.keys import decode_component

    node = root = {}
    parts = [decode_component(c) for c in key.split("/")]
    for c in parts[:-1]:
        node = node.setdefault(c, {})
    node[parts[-1]] = sj.ShardedObject(None, index, count)
    return root


def test_vector_loads_into_abstract_targets_with_partial_regions():
    ck = os.path.join(ROOT, "valid", "multi_chunk", "checkpoint")
    whole = sj.load(ck)
    tgt = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in whole.items()}
    part = sj.load(ck, {"grid": tgt["grid"]})
    assert set(part) == {"grid"}
    assert np.asarray(part["grid"]).tobytes() == np.asarray(whole["grid"]).tobytes()


@pytest.mark.parametrize("case", INVALID)
def test_invalid_vector_is_refused_with_its_id(case):
    with open(os.path.join(ROOT, "invalid", case, "expected.json")) as f:
        exp = json.load(f)
    with pytest.raises(sj.ShardpointError) as ei:
        sj.load(os.path.join(ROOT, "invalid", case, "checkpoint"))
    assert type(ei.value).__name__ == exp["error"], ei.value
    assert ei.value.spec_id == exp["spec_id"], ei.value


# ---- 1.1 clarifications (spec/CHANGELOG.md) ----------------------------------------------
def test_this_writer_computes_the_array_paths_the_portable_paths_vector_holds():
    import msgpack
    from shardpoint_core.format.manifest import array_path_for as array_path

    raw = open(
        os.path.join(ROOT, "valid", "portable_paths", "checkpoint", "manifest.msgpack"), "rb"
    ).read()
    body = msgpack.unpackb(msgpack.unpackb(raw)["body"], strict_map_key=False)
    paths = {k: e["array"] for k, e in body["tensors"].items()}
    assert len(paths) == 11 and all(array_path(k) == a for k, a in paths.items())
    assert paths["%C3%BCnA"] == "tensors/%C3%BCnA~2" and paths["CON"] == "tensors/CON~7"


def test_a_target_leaf_of_another_kind_fails_in_both_modes():
    ck = os.path.join(ROOT, "valid", "nested_tree", "checkpoint")
    for strict in (True, False):  # [SP-LOAD-3]
        for tgt in (
            {"rng": 0},
            {"iteration": jax.ShapeDtypeStruct((1,), np.int32)},
            {"np": sj.ShardedObject(None, 0, 1)},
        ):
            with pytest.raises(sj.LayoutMismatchError) as e:
                sj.load(ck, tgt, strict=strict)
            assert e.value.spec_id == "SP-LOAD-1"
    assert sj.load(ck, {"model": 5}, strict=False) == {"model": 5}  # an inner node: missing


def test_a_region_outside_the_tensor_is_a_caller_error_reported_as_hold_1():
    from shardpoint_jax.loading import Checkpoint

    ck = Checkpoint(os.path.join(ROOT, "valid", "multi_chunk", "checkpoint"))
    with pytest.raises(sj.InvalidRequestError) as e:
        ck.read("small", [4, 0], [2, 3])  # rows 4..5 of 5
    assert e.value.spec_id == "SP-HOLD-1" and isinstance(e.value, ValueError)
