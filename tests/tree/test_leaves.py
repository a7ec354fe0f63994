"""One typed state tree: leaf handlers (one per kind of leaf, used by save and by load
targets) and the typed tree readers see (``Manifest.state_tree``, ``sp.open(...).tree``)."""
import numpy as np
import pytest
import torch

import shardpoint as sp
from shardpoint.tree import leaves
from shardpoint_core.statetree import (ObjectLeaf, TensorLeaf, ValueLeaf, iter_leaves,
                                       wire_tree)


def _state() -> dict:
    return {"model": {"w": torch.arange(6.0).view(2, 3), "n": np.arange(4, dtype=np.int16)},
            "sched": [1, (2.5, "x"), None], "rng": sp.ShardedObject({"seed": 7}, 0, 1),
            "empty": {}}


def test_state_tree_is_the_saved_tree_with_typed_leaves(tmp_ckpt):
    sp.save(_state(), tmp_ckpt)
    m = sp.read_metadata(tmp_ckpt)
    t = m.state_tree
    assert set(t) == {"model", "sched", "rng", "empty"} and t["empty"] == {}
    w, n = t["model"]["w"], t["model"]["n"]
    assert isinstance(w, TensorLeaf) and (w.key, w.shape, w.dtype) == ("model/w", (2, 3),
                                                                       "float32")
    assert w.origin == "torch" and n.origin == "numpy" and n.dtype == "int16"
    assert w.nbytes == 24 and w.entry is m.tensors["model/w"]
    assert isinstance(t["sched"], list) and isinstance(t["sched"][1], tuple)
    assert t["sched"][1][1] == ValueLeaf("sched/1/1", "x")
    assert t["sched"][2] == ValueLeaf("sched/2", None)
    assert isinstance(t["rng"], ObjectLeaf) and t["rng"].grid == (1,)
    assert t["rng"].nested() == [{"seed": 7}]
    assert [k for k, _ in iter_leaves(t)][:2] == [("model", "w"), ("model", "n")]
    assert wire_tree(t) == m.tree            # the manifest's encoding, given back


def test_open_hands_the_typed_tree(tmp_ckpt):
    sp.save(_state(), tmp_ckpt)
    with sp.open(tmp_ckpt) as ck:
        assert isinstance(ck.tree["model"]["w"], TensorLeaf)
        assert ck.tensor_keys() == ["model/w", "model/n"]
        assert ck["sched/1/1"] == "x" and ck["rng"] == [{"seed": 7}]
        assert torch.equal(ck["model/w"][1].to_torch(), torch.tensor([3.0, 4.0, 5.0]))


def test_handlers_in_match_order():
    assert leaves.leaf_kinds() == ["ShardedTensor", "ShardedPieces", "DTensor",
                                   "torch.Tensor", "numpy.ndarray", "ShardedObject", "value"]
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
    like = {"a": torch.zeros(1), "t": torch.zeros(2), "n": np.zeros(2),
            "o": sp.ShardedObject("keep", 0, 1), "v": 5}
    out = sp.load(tmp_ckpt, like=like, strict=False, report=rep)
    assert rep.missing_keys == ["tensor 't'", "tensor 'n'", "sharded object 'o'", "value 'v'"]
    assert out["o"] == "keep" and out["v"] == 5 and out["t"] is like["t"]
    with pytest.raises(sp.LayoutMismatchError, match="holds a tensor at this key"):
        sp.load(tmp_ckpt, like={"a": 1})
