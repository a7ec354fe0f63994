"""One typed state tree: leaf handlers (one per kind of leaf, used by save and by load
targets) and the typed tree readers see (``Manifest.tree``, ``sp.open(...).tree``)."""

import numpy as np
import pytest
import torch

import shardpoint as sp
from shardpoint.tree import leaves
from shardpoint_core.format.statetree import (
    ObjectLeaf,
    TensorLeaf,
    ValueLeaf,
    iter_leaves,
    wire_tree,
)


def _state() -> dict:
    return {
        "model": {"w": torch.arange(6.0).view(2, 3), "n": np.arange(4, dtype=np.int16)},
        "sched": [1, (2.5, "x"), None],
        "rng": sp.ShardedObject({"seed": 7}, 0, 1),
        "empty": {},
    }


def test_metadata_tree_is_the_saved_tree_with_typed_leaves(tmp_ckpt):
    sp.save(_state(), tmp_ckpt)
    m = sp.read_metadata(tmp_ckpt)
    t = m.tree
    assert m.state_tree is t and m.tree is t  # built once; state_tree is an alias
    assert set(t) == {"model", "sched", "rng", "empty"} and t["empty"] == {}
    w, n = t["model"]["w"], t["model"]["n"]
    assert isinstance(w, TensorLeaf) and (w.key, w.shape, w.dtype) == ("model/w", (2, 3), "float32")
    assert w.origin is None and n.origin == "numpy" and n.dtype == "int16"  # [SP-MAN-6]
    assert w.nbytes == 24 and w.entry is m.tensors["model/w"]
    assert isinstance(t["sched"], list) and isinstance(t["sched"][1], tuple)
    assert t["sched"][1][1] == ValueLeaf("sched/1/1", "x")
    assert t["sched"][2] == ValueLeaf("sched/2", None)
    assert isinstance(t["rng"], ObjectLeaf) and t["rng"].grid == (1,)
    assert t["rng"].nested() == [{"seed": 7}]
    assert [k for k, _ in iter_leaves(t)][:2] == [("model", "w"), ("model", "n")]
    assert wire_tree(t) == m.wire_tree  # the manifest's encoding, given back


def _every_kind() -> dict:
    """A state with a leaf of every kind a one-process save takes (DTensor aside: it needs a
    mesh) and every kind of container, empty ones and int keys included."""
    rows = torch.arange(24.0).view(4, 6)
    return {
        "t": torch.ones(2, 3, dtype=torch.bfloat16),
        "np": np.arange(5, dtype=np.uint16),
        "st": sp.ShardedTensor(rows, (4, 6), (0, 0)),
        "flat": sp.ShardedTensor(
            torch.arange(12), (3, 4), (0, 0), local_shape=(3, 4), flattened_range=(0, 12)
        ),
        "pieces": sp.ShardedPieces(
            [sp.ShardedTensor(rows[:1], (4, 6), (0, 0)), sp.ShardedTensor(rows[1:], (4, 6), (1, 0))]
        ),
        "obj": sp.ShardedObject({"seed": 1}, 0, 1),
        "grid": sp.ShardedObject((1, "a"), (0, 0), (1, 1)),
        7: {0: "int keys", "7": b"bytes"},
        "values": [None, True, -3, 2.5, float("inf"), "s", b"\x00", np.float32(1.5)],
        "tup": (torch.zeros(1), (1, ("deep",)), [sp.ShardedObject(3, 0, 1)]),
        "empty": {"d": {}, "l": [], "t": ()},
    }


def _expected_skeleton(x, path=()):
    """What the typed tree must be for the saved ``x``: containers as they are, a leaf as
    (kind, shape, dtype) / (kind, grid) / (kind, value)."""
    from shardpoint.tree import dtypes

    if isinstance(x, dict):
        return {k: _expected_skeleton(v, path + (k,)) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_expected_skeleton(v, path + (i,)) for i, v in enumerate(x))
    if isinstance(x, sp.ShardedPieces):
        x = x.pieces[0]
    if isinstance(x, sp.ShardedTensor):
        return ("tensor", tuple(x.global_shape), dtypes.from_torch(x.data.dtype).name, None)
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), dtypes.from_torch(x.dtype).name, None)
    if isinstance(x, np.ndarray):
        return ("tensor", x.shape, dtypes.from_numpy(x.dtype).name, "numpy")
    if isinstance(x, sp.ShardedObject):
        return ("object", tuple(x.grid_shape), [x.value])
    return ("value", x)


def _typed_skeleton(t):
    if isinstance(t, dict):
        return {k: _typed_skeleton(v) for k, v in t.items()}
    if isinstance(t, (list, tuple)):
        return type(t)(_typed_skeleton(v) for v in t)
    if isinstance(t, TensorLeaf):
        return ("tensor", t.shape, t.dtype, t.origin)
    if isinstance(t, ObjectLeaf):
        return ("object", t.grid, list(t.values))
    return ("value", t.value)


def test_metadata_tree_of_every_leaf_kind_is_what_was_saved(tmp_ckpt):
    state = _every_kind()
    sp.save(state, tmp_ckpt)
    m = sp.read_metadata(tmp_ckpt)
    assert _typed_skeleton(m.tree) == _expected_skeleton(state)
    assert list(m.tree) == list(state) and list(m.tree[7]) == [0, "7"]  # order and key types
    keys = [leaf.key for _p, leaf in sp.iter_leaves(m.tree)]
    assert keys[:4] == ["t", "np", "st", "flat"] and "7/~7" in keys and len(keys) == 21
    assert sp.node_at(m.tree, ("tup", 1, 1, 0)) == sp.ValueLeaf("tup/1/1/0", "deep")
    assert sp.node_at(m.tree, ("empty", "t")) == () and sp.node_at(m.tree, ("nope",)) is None


def test_open_hands_the_typed_tree(tmp_ckpt):
    sp.save(_state(), tmp_ckpt)
    with sp.open(tmp_ckpt) as ck:
        assert isinstance(ck.tree["model"]["w"], TensorLeaf)
        assert ck.tensor_keys() == ["model/w", "model/n"]
        assert ck["sched/1/1"] == "x" and ck["rng"] == [{"seed": 7}]
        assert torch.equal(ck["model/w"][1].to_torch(), torch.tensor([3.0, 4.0, 5.0]))


def test_handlers_in_match_order():
    assert leaves.leaf_kinds() == [
        "ShardedTensor",
        "ShardedPieces",
        "DTensor",
        "torch.Tensor",
        "numpy.ndarray",
        "ShardedObject",
        "value",
    ]
    assert leaves.handler_for(torch.ones(1)).name == "torch.Tensor"
    assert leaves.handler_for(np.ones(1)).kind == "tensor"
    assert leaves.handler_for(sp.ShardedObject(1, 0, 1)).kind == "object"
    assert leaves.handler_for(3).kind == "value"
    with pytest.raises(ValueError):
        leaves.unregister_leaf("torch.Tensor")


class Scaled:
    """A new kind of leaf for the test: a tensor kept with a scale it is stored divided by."""

    def __init__(self, data: torch.Tensor, scale: float) -> None:
        self.data, self.scale = data, scale


class ScaledHandler(leaves.LeafHandler):
    """The whole of what a new leaf kind needs: saved as its tensor, loaded in place."""

    name = "Scaled"

    def matches(self, x):
        return isinstance(x, Scaled)

    def flatten(self, x, key, what, out):
        return leaves.handler_for(x.data).flatten(x.data / x.scale, key, what, out)

    def target(self, x, key, what, load):
        leaves.handler_for(x.data).target(x.data, key, what, load)
        return x


@pytest.fixture
def scaled_registered():
    leaves.register_leaf(ScaledHandler(), before="torch.Tensor")
    yield
    leaves.unregister_leaf("Scaled")


def test_a_new_leaf_kind_is_one_handler(tmp_ckpt, scaled_registered):
    assert leaves.leaf_kinds().index("Scaled") < leaves.leaf_kinds().index("torch.Tensor")
    sp.save({"s": Scaled(torch.full((4,), 6.0), 2.0), "step": 1}, tmp_ckpt)
    assert torch.equal(sp.load(tmp_ckpt)["s"], torch.full((4,), 3.0))
    like = Scaled(torch.zeros(4), 2.0)
    out = sp.load(tmp_ckpt, like={"s": like, "step": 0})
    assert out["s"] is like and torch.equal(like.data, torch.full((4,), 3.0))
    with pytest.raises(ValueError, match="registered already"):
        leaves.register_leaf(ScaledHandler())


def test_a_missing_leaf_of_each_kind_is_reported(tmp_ckpt):
    sp.save({"a": torch.ones(1)}, tmp_ckpt)
    rep = sp.LoadResult()
    like = {
        "a": torch.zeros(1),
        "t": torch.zeros(2),
        "n": np.zeros(2),
        "o": sp.ShardedObject("keep", 0, 1),
        "v": 5,
    }
    out = sp.load(tmp_ckpt, like=like, strict=False, report=rep)
    assert rep.missing_keys == ["tensor 't'", "tensor 'n'", "sharded object 'o'", "value 'v'"]
    assert out["o"] == "keep" and out["v"] == 5 and out["t"] is like["t"]
    with pytest.raises(sp.LayoutMismatchError, match="holds a tensor at this key"):
        sp.load(tmp_ckpt, like={"a": 1})
