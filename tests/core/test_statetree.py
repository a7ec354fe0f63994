"""The typed state tree (``Manifest.tree``): the wire encoding [SP-MAN-4] and the typed tree
map onto each other exactly, the typed tree is built once per manifest, and every golden
vector reads as the tree its ``expected.json`` describes (spec/README.md). Torch-free."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpoint_conformance.independent_reader import array_json, float_json
from shardpoint_core.format import dtypes
from shardpoint_core.format.errors import InvalidKeyError
from shardpoint_core.format.keys import encode_key
from shardpoint_core.format.manifest import (
    Manifest,
    ObjectValues,
    TensorEntry,
    array_path_for,
    decode_manifest,
    encode_manifest,
)
from shardpoint_core.transactions.resolve import read_metadata
from shardpoint_core.format.statetree import (
    ObjectLeaf,
    TensorLeaf,
    ValueLeaf,
    iter_leaves,
    node_at,
    typed_tree,
    wire_tree,
)
from shardpoint_core.format.values import numpy_values

VECTORS = Path(__file__).resolve().parents[2] / "spec" / "vectors" / "valid"


def _key_ok(k) -> bool:
    try:
        encode_key((k,))
        return True
    except InvalidKeyError:
        return False


KEYS = st.one_of(
    st.integers(-3, 40), st.text("abAB_.~%-/ 09\u00fc", min_size=1, max_size=4).filter(_key_ok)
)
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=4),
    st.binary(max_size=4),
)
LEAVES = st.one_of(
    st.sampled_from([("tensor", None), ("tensor", "numpy"), ("tensor", "torch")]),
    st.integers(1, 3).map(lambda n: ("object", n)),
    VALUES.map(lambda v: ("value", v)),
)


def _containers(children):
    return st.one_of(
        st.lists(
            st.tuples(KEYS, children), max_size=4, unique_by=lambda kv: (type(kv[0]), kv[0])
        ).map(lambda kv: ("dict", kv)),
        st.lists(children, max_size=4).map(lambda xs: ("list", xs)),
        st.lists(children, max_size=4).map(lambda xs: ("tuple", xs)),
    )


SHAPES = _containers(st.recursive(LEAVES, _containers, max_leaves=24))  # a container root


def _wire(shape, path, tensors, objects) -> dict:
    """The wire tree of a generated shape, filling the manifest's tables as a writer does."""
    kind, arg = shape
    if kind == "dict":
        return {"dict": [[k, _wire(c, path + (k,), tensors, objects)] for k, c in arg]}
    if kind in ("list", "tuple"):
        return {kind: [_wire(c, path + (i,), tensors, objects) for i, c in enumerate(arg)]}
    if kind == "value":
        return {"value": arg}
    key = encode_key(path)
    if kind == "object":
        objects[key] = ObjectValues([f"v{i}" for i in range(arg)])
        return {"object": key}
    tensors[key] = TensorEntry(key, array_path_for(key), (2, 3), "bfloat16", (1, 3))
    return {"tensor": key, "origin": arg} if arg else {"tensor": key}


@settings(max_examples=100, deadline=None)
@given(SHAPES)
def test_wire_typed_wire_is_identity(shape):
    tensors, objects = {}, {}
    wire = _wire(shape, (), tensors, objects)
    typed = typed_tree(wire, tensors, objects)
    assert wire_tree(typed) == wire
    m = decode_manifest(encode_manifest(Manifest(wire, tensors, objects)))
    assert m.wire_tree == wire and m.tree == typed  # and through the codec
    assert wire_tree(m.tree) == wire
    for path, leaf in iter_leaves(typed):  # every leaf knows its key
        assert leaf.key == encode_key(path) and node_at(typed, path) is leaf
        assert {"tensor": TensorLeaf, "object": ObjectLeaf, "value": ValueLeaf}[leaf.kind] is type(
            leaf
        )
    assert sorted(leaf.key for _p, leaf in iter_leaves(typed) if leaf.kind != "value") == sorted(
        [*tensors, *objects]
    )


def test_typed_tree_is_built_once_and_follows_a_new_wire_tree():
    e = TensorEntry("w", "tensors/w", (4,), "float32", (4,))
    m = Manifest({"dict": [["w", {"tensor": "w"}], ["n", {"value": 3}]]}, {"w": e}, {})
    t = m.tree
    assert m.tree is t and m.state_tree is t and t == {"w": TensorLeaf(e), "n": ValueLeaf("n", 3)}
    m.wire_tree = {"list": [{"value": 1}]}
    assert m.tree == [ValueLeaf("0", 1)]
    assert "_typed" not in repr(m) and m == Manifest(m.wire_tree, {"w": e}, {})


def test_origin_is_what_the_manifest_says():
    """[SP-MAN-6]: absent (the saving framework's own tensor type), "torch" and "numpy" are
    three different hints; the typed tree keeps each."""
    es = {k: TensorEntry(k, f"tensors/{k}", (1,), "uint8", (1,)) for k in "abc"}
    wire = {
        "dict": [
            ["a", {"tensor": "a"}],
            ["b", {"tensor": "b", "origin": "torch"}],
            ["c", {"tensor": "c", "origin": "numpy"}],
        ]
    }
    m = decode_manifest(encode_manifest(Manifest(wire, es, {})))
    assert [m.tree[k].origin for k in "abc"] == [None, "torch", "numpy"]
    assert wire_tree(m.tree) == wire


def test_node_at_finds_containers_and_leaves_and_nothing_else():
    t = {"a": [ValueLeaf("a/0", 1), (ValueLeaf("a/1/0", 2),)], 3: {}}
    assert node_at(t, ()) is t and node_at(t, ("a", 1, 0)) == ValueLeaf("a/1/0", 2)
    assert node_at(t, (3,)) == {} and node_at(t, ("3",)) is None
    for missing in (("b",), ("a", 2), ("a", -1), ("a", "0"), ("a", True), ("a", 0, 0)):
        assert node_at(t, missing) is None, missing


def _skeleton(node):
    """The typed tree in expected.json's skeleton form (spec/README.md)."""
    if isinstance(node, dict):
        return {"dict": [[k, _skeleton(v)] for k, v in node.items()]}
    if isinstance(node, (list, tuple)):
        return {type(node).__name__: [_skeleton(v) for v in node]}
    return {node.kind: node.key}


def _json(v):
    """A stored value in expected.json's JSON form (spec/README.md)."""
    if isinstance(v, bytes):
        return {"$hex": v.hex()}
    if isinstance(v, tuple):
        return {"$tuple": [_json(x) for x in v]}
    if isinstance(v, list):
        return [_json(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _json(x) for k, x in v.items()}
    if isinstance(v, (np.ndarray, np.generic)):
        a = np.asarray(v)
        return array_json(
            dtypes.from_numpy(a.dtype).name,
            a.shape,
            a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes(),
        )
    return float_json(v) if isinstance(v, float) else v


@pytest.mark.parametrize("case", sorted(p.name for p in VECTORS.iterdir()))
def test_read_metadata_of_a_vector_is_the_tree_its_expected_json_describes(case):
    want = json.loads((VECTORS / case / "expected.json").read_text())
    with numpy_values():
        m = read_metadata(str(VECTORS / case / "checkpoint"))
    assert json.loads(json.dumps(_skeleton(m.tree))) == want["tree"]
    leaves = dict((leaf.key, leaf) for _p, leaf in iter_leaves(m.tree))
    tensors = {k: x for k, x in leaves.items() if isinstance(x, TensorLeaf)}
    assert {k: {"shape": list(t.shape), "dtype": t.dtype} for k, t in tensors.items()} == {
        k: {"shape": t["shape"], "dtype": t["dtype"]} for k, t in want["tensors"].items()
    }
    assert {k: _json(x.value) for k, x in leaves.items() if isinstance(x, ValueLeaf)} == want[
        "values"
    ]
    assert {k: _json(x.nested()) for k, x in leaves.items() if isinstance(x, ObjectLeaf)} == want[
        "objects"
    ]
    assert all(
        t.nbytes == math.prod(t.shape) * dtypes.from_name(t.dtype).itemsize
        for t in tensors.values()
    )


def test_the_shared_container_walk_encodes_and_rebuilds_what_front_ends_hand_it():
    """encode_tree / map_tree, the walk both front ends save and load with: containers as
    the wire encoding says, container types built back, dict keys checked as save does."""
    from collections import OrderedDict, defaultdict, namedtuple

    from shardpoint_core.format.statetree import encode_tree, map_tree, materialize, typed_tree

    P = namedtuple("P", "x y")
    tree = {"a": [1, (2.0, None)], "p": P(3, "s"), "o": OrderedDict(z=b"b"), "e": {}}
    wire = encode_tree(tree, lambda path, key, v: {"value": v})
    assert wire == {
        "dict": [
            ["a", {"list": [{"value": 1}, {"tuple": [{"value": 2.0}, {"value": None}]}]}],
            ["p", {"tuple": [{"value": 3}, {"value": "s"}]}],
            ["o", {"dict": [["z", {"value": b"b"}]]}],
            ["e", {"dict": []}],
        ]
    }
    seen = []
    back = map_tree(tree, lambda path, key, v: seen.append((path, key)) or v)
    assert back == tree and type(back["p"]) is P and type(back["o"]) is OrderedDict
    assert seen == [
        (("a", 0), "a/0"),
        (("a", 1, 0), "a/1/0"),
        (("a", 1, 1), "a/1/1"),
        (("p", 0), "p/0"),
        (("p", 1), "p/1"),
        (("o", "z"), "o/z"),
    ]
    dd = map_tree({"d": defaultdict(list, k=1)}, lambda path, key, v: v)
    assert dd == {"d": {"k": 1}}  # a type that cannot be built from a dict: a dict
    assert materialize(typed_tree(wire, {}, {}), lambda leaf: None) == {
        "a": [1, (2.0, None)],
        "p": (3, "s"),
        "o": {"z": b"b"},
        "e": {},
    }
    for bad in ("", "..", 1.5, True):
        with pytest.raises(InvalidKeyError):
            encode_tree({"ok": {bad: 1}}, lambda path, key, v: {"value": v})
