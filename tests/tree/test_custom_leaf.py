"""A leaf kind added with ``register_leaf`` alone is understood by save, load with ``like``,
``shardpoint inspect``, ``diff`` and ``convert`` (torch.save in, shardpoint out), with no edit
to any of them: they classify leaves through the registry and the checkpoint's typed tree."""

import json

import pytest
import torch

import shardpoint as sp
from shardpoint.tools.cli import main as cli
from shardpoint.tools.convert import convert
from shardpoint.tools.convert.base import Source
from shardpoint.tools.convert.torchsave import walk_tree
from shardpoint.tools.diff import diff_checkpoints
from shardpoint.tree.leaves import TensorHandler, leaf_kinds, register_leaf, unregister_leaf
from shardpoint_core.transactions.resolve import read_metadata
from shardpoint_testing.tensors import random_bits, same_bits


class Boxed:
    """A framework's own tensor holder that is not a torch.Tensor (the custom leaf)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class BoxedHandler(TensorHandler):
    """Saved as the tensor it holds; as a load target, that tensor is filled in place and
    the holder comes back."""

    name = "Boxed"

    def matches(self, x):
        return isinstance(x, Boxed)

    def flatten(self, x, key, what, out):
        return super().flatten(x.t, key, what, out)

    def target(self, x, key, what, load):
        super().target(x.t, key, what, load)
        return x


@pytest.fixture
def boxed():
    register_leaf(BoxedHandler(), before="torch.Tensor")
    try:
        yield
    finally:
        unregister_leaf("Boxed")
    assert "Boxed" not in leaf_kinds()


def state(seed="w"):
    return {
        "model": {"w": Boxed(random_bits(seed, (6, 5), torch.bfloat16)), "b": torch.ones(5)},
        "step": 3,
    }


def test_save_load_like_inspect_and_diff(boxed, tmp_path, capsys):
    a, b, c = (str(tmp_path / n) for n in "abc")
    sp.save(state(), a)
    sp.save(state(), b)
    sp.save(state("other"), c)
    m = read_metadata(a)
    assert m.tree["model"]["w"].kind == "tensor" and m.tensors["model/w"].shape == (6, 5)

    like = {
        "model": {"w": Boxed(torch.empty(6, 5, dtype=torch.bfloat16)), "b": torch.empty(5)},
        "step": 0,
    }
    target = like["model"]["w"].t
    got = sp.load(a, like=like)
    assert isinstance(got["model"]["w"], Boxed) and got["model"]["w"].t is target
    assert same_bits(target, state()["model"]["w"].t) and got["step"] == 3
    whole = sp.load(a)  # no like: a plain tensor
    assert same_bits(whole["model"]["w"], state()["model"]["w"].t)

    assert cli(["inspect", a, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tensors"]["model/w"]["dtype"] == "bfloat16" and out["values"] == {"step": 3}
    assert cli(["inspect", a]) == 0
    w = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("w "))
    assert "bfloat16" in w and "6x5" in w

    assert diff_checkpoints(a, b).equal
    rep = diff_checkpoints(a, c)
    assert [t.key for t in rep.tensors] == ["model/w"] and not rep.only_a and not rep.values


def test_convert_a_torch_save_file_holding_the_custom_leaf(boxed, tmp_path):
    src, dst = str(tmp_path / "m.pt"), str(tmp_path / "ck")
    torch.save(state(), src)
    with torch.serialization.safe_globals([Boxed]):  # weights_only may build it
        rep = convert(src, dst)
    assert rep.tensors == 2 and rep.values == 1 and rep.skipped == []
    got = sp.load(dst)
    assert same_bits(got["model"]["w"], state()["model"]["w"].t) and got["step"] == 3


def test_convert_skips_what_a_single_file_cannot_hold_whole(tmp_path):
    """A piece of a sharded tensor is skipped with the reason, never written as if whole;
    a sparse tensor gets the save's own refusal."""
    src, dst = str(tmp_path / "m.pt"), str(tmp_path / "ck")
    piece = sp.ShardedTensor(torch.ones(2, 3), (4, 3), (2, 0))
    torch.save({"w": torch.zeros(2), "sparse": torch.eye(3).to_sparse()}, src)
    rep = convert(src, dst)
    reasons = dict(rep.skipped)
    assert "dense" in reasons["sparse"] and rep.tensors == 1
    s, tensors = Source("mem"), {}
    walk_tree({"p": piece, "v": [1, 2]}, (), s, tensors)
    assert [k for k, _ in s.skipped] == ["p"] and "global shape (4, 3)" in s.skipped[0][1]
    assert s.values == {("v",): [1, 2]} and tensors == {}
