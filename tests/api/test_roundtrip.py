"""Single-process round trips: every dtype, random trees and bits, like=, subsets, overwrite."""

import hypothesis.strategies as st
import numpy as np
import pytest
import tensorstore as ts
import torch
from hypothesis import HealthCheck, given, settings

import shardpoint as sp
from shardpoint.tree import dtypes
from shardpoint_testing.tensors import random_bits as shared_random_bits, same_bits

DTYPES = list(dtypes.DTYPES.values())
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def random_bits(d, shape, seed):
    """A tensor of dtype ``d`` with random *bits* (NaN payloads, -0.0, subnormals)."""
    return shared_random_bits(seed, shape, d.torch)


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)
leaf_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=8),
)
keys = st.one_of(
    st.text(min_size=1, max_size=6).filter(lambda s: s not in (".", "..")), st.integers(-5, 50)
)


@st.composite
def trees(draw):
    def leaf():
        kind = draw(st.sampled_from(["tensor", "numpy", "value"]))
        if kind == "value":
            return draw(leaf_values)
        d = draw(st.sampled_from(DTYPES))
        t = random_bits(d, draw(shapes), draw(st.integers(0, 2**32 - 1)))
        return dtypes.torch_to_numpy(t).copy() if kind == "numpy" else t

    def node(depth):
        if depth == 0 or draw(st.booleans()):
            return leaf()
        kind = draw(st.sampled_from(["dict", "list", "tuple"]))
        n = draw(st.integers(0, 3))
        if kind == "dict":
            return {draw(keys): node(depth - 1) for _ in range(n)}
        items = [node(depth - 1) for _ in range(n)]
        return items if kind == "list" else tuple(items)

    return {"root": node(3)}


def assert_tree_equal(a, b):
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_tree_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_tree_equal(x, y)
    elif isinstance(a, (torch.Tensor, np.ndarray)):
        assert same_bits(a, b), (a, b)
    else:
        assert type(a) is type(b) and a == b


def round_trip(tmp_path_factory, tree):
    path = str(tmp_path_factory.mktemp("rt") / "ckpt")
    sp.save(tree, path)
    assert_tree_equal(tree, sp.load(path))


test_random_trees_round_trip_bitwise = settings(max_examples=25, **SETTINGS)(
    given(tree=trees())(round_trip)
)
test_random_trees_round_trip_bitwise_long = pytest.mark.slow(
    settings(max_examples=300, **SETTINGS)(given(tree=trees())(round_trip))
)


@pytest.mark.parametrize("d", DTYPES, ids=lambda d: d.name)
def test_every_dtype_every_bit_pattern(tmp_ckpt, d):
    n = 1 << (8 * min(d.itemsize, 2))  # every byte/halfword pattern for small dtypes
    t = random_bits(d, (300,), 1)
    if d.itemsize <= 2 and d.name != "bool":
        t = dtypes.numpy_to_torch(
            np.arange(n, dtype=np.uint16 if d.itemsize == 2 else np.uint8).view(d.numpy).copy()
        )
    state = {"t": t, "scalar": t.reshape(-1)[0].clone(), "empty": t[:0].reshape(0, 3)[:, :0]}
    sp.save(state, tmp_ckpt)
    back = sp.load(tmp_ckpt)
    for k in state:
        assert same_bits(state[k], back[k]), k


def test_negative_zero_and_nan_payload_survive(tmp_ckpt):
    bits = torch.tensor([0x7FC00001, 0xFFC12345, 0x80000000, 0x00000001], dtype=torch.int64)
    t = bits.to(torch.int32).view(torch.float32)
    sp.save({"t": t}, tmp_ckpt)
    assert torch.equal(sp.load(tmp_ckpt)["t"].view(torch.int32), bits.to(torch.int32))


def test_non_contiguous_views(tmp_ckpt):
    base = torch.arange(60, dtype=torch.float64).reshape(6, 10)
    state = {"t": base.t(), "s": base[1:5:2, ::3], "e": base.expand(3, 6, 10)[1]}
    sp.save(state, tmp_ckpt)
    back = sp.load(tmp_ckpt)
    for k, v in state.items():
        assert torch.equal(back[k], v) and back[k].shape == v.shape


def test_like_fills_in_place_and_returns_tree(tmp_ckpt):
    state = {"w": torch.randn(7, 3), "np": np.arange(5.0), "step": 9, "nested": [torch.ones(2)]}
    sp.save(state, tmp_ckpt)
    like = {"w": torch.zeros(7, 3), "np": np.zeros(5), "step": 0, "nested": [torch.zeros(2)]}
    ptr = like["w"].data_ptr()
    out = sp.load(tmp_ckpt, like=like)
    assert out["w"] is like["w"] and like["w"].data_ptr() == ptr
    assert torch.equal(like["w"], state["w"]) and np.array_equal(like["np"], state["np"])
    assert out["step"] == 9 and torch.equal(like["nested"][0], torch.ones(2))


def test_subset_load_reads_only_what_is_asked(tmp_ckpt):
    sp.save({"model": {"w": torch.ones(3)}, "optim": {"m": torch.ones(3)}}, tmp_ckpt)
    rep = sp.LoadReport()
    out = sp.load(tmp_ckpt, like={"model": {"w": torch.zeros(3)}}, report=rep)
    assert torch.equal(out["model"]["w"], torch.ones(3))
    assert rep.unexpected_keys == ["optim/m"] and rep.rank_bytes_read == 12


def test_strict_and_non_strict_missing_keys(tmp_ckpt):
    sp.save({"a": torch.ones(2)}, tmp_ckpt)
    with pytest.raises(sp.LayoutMismatchError, match="'b'"):
        sp.load(tmp_ckpt, like={"a": torch.zeros(2), "b": torch.zeros(2)})
    rep = sp.LoadReport()
    out = sp.load(
        tmp_ckpt, like={"a": torch.zeros(2), "b": torch.zeros(2)}, strict=False, report=rep
    )
    assert rep.missing_keys == ["tensor 'b'"] and torch.equal(out["a"], torch.ones(2))


@pytest.mark.parametrize("bad", [torch.zeros(3), torch.zeros(2, dtype=torch.float64)])
def test_shape_or_dtype_mismatch_names_the_key(tmp_ckpt, bad):
    sp.save({"a": torch.ones(2)}, tmp_ckpt)
    with pytest.raises(sp.LayoutMismatchError, match="'a'.*shape"):
        sp.load(tmp_ckpt, like={"a": bad})


def test_overwrite(tmp_ckpt):
    sp.save({"a": torch.ones(2)}, tmp_ckpt)
    with pytest.raises(sp.CheckpointExistsError):
        sp.save({"a": torch.zeros(2)}, tmp_ckpt)
    assert torch.equal(sp.load(tmp_ckpt)["a"], torch.ones(2))
    sp.save({"b": torch.zeros(2)}, tmp_ckpt, overwrite=True)
    assert list(sp.load(tmp_ckpt)) == ["b"]


def test_sharded_tensor_in_one_process_must_cover(tmp_ckpt):
    with pytest.raises(sp.InvalidShardingError, match="gap"):
        sp.save({"w": sp.ShardedTensor(torch.ones(2, 3), (4, 3), (0, 0))}, tmp_ckpt)
    assert not __import__("os").path.exists(tmp_ckpt)
    sp.save(
        {
            "w": sp.ShardedTensor(
                torch.arange(12.0), (4, 3), (0, 0), local_shape=(4, 3), flattened_range=(0, 12)
            )
        },
        tmp_ckpt,
    )
    assert torch.equal(sp.load(tmp_ckpt)["w"], torch.arange(12.0).reshape(4, 3))


def test_sharded_objects_and_values(tmp_ckpt):
    rng = torch.get_rng_state()
    sp.save(
        {"rng": sp.ShardedObject({"torch": rng, "pos": (3, 4)}, 0, 1), "cfg": {"lr": 0.1}}, tmp_ckpt
    )
    back = sp.load(tmp_ckpt)
    assert torch.equal(back["rng"][0]["torch"], rng) and back["rng"][0]["pos"] == (3, 4)
    out = sp.load(tmp_ckpt, like={"rng": sp.ShardedObject(None, 0, 1)})
    assert torch.equal(out["rng"]["torch"], rng)
    with pytest.raises(sp.LayoutMismatchError, match="count"):
        sp.load(tmp_ckpt, like={"rng": sp.ShardedObject(None, 0, 2)})


@pytest.mark.parametrize("layout", ["packed", "per-array"])
def test_save_result_counts_the_files_the_checkpoint_holds(tmp_ckpt, layout):
    """``SaveResult.files`` is what lies on disk: in the packed layout (the default) the
    manifest and one data file, however many tensors; it counted the per-array layout's
    chunk files and zarr.json files whatever the layout."""
    import os

    kw = {"backend": sp.ZarrBackend()} if layout == "per-array" else {}
    state = {"model": {f"l{i}": torch.full((4, 3), float(i)) for i in range(5)}, "step": 1}
    res = sp.save(state, tmp_ckpt, **kw)
    on_disk = sorted(
        os.path.relpath(os.path.join(d, f), tmp_ckpt) for d, _, fs in os.walk(tmp_ckpt) for f in fs
    )
    assert res.files == len(on_disk) and res.chunks == 5, (res, on_disk)
    if layout == "packed":
        assert len(on_disk) == 2 and on_disk[0] == "manifest.msgpack", on_disk
        assert on_disk[1].startswith("packed/") and on_disk[1].endswith("-0.bin"), on_disk


def test_plain_tensorstore_opens_saved_tensor(tmp_ckpt):
    """The per-array layout's arrays open in place (packed ones through the TensorStore
    export: tests/api/test_zarr_readers.py)."""
    w = torch.randn(33, 17).bfloat16()
    sp.save({"layer": {"w": w}}, tmp_ckpt, backend=sp.ZarrBackend())
    t = ts.open(
        {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{tmp_ckpt}/tensors/layer/w"}}
    ).result()
    assert t.dtype.name == "bfloat16" and t.shape == (33, 17)
    assert t.read().result().tobytes() == dtypes.torch_to_numpy(w).tobytes()


def test_large_tensor_gets_a_multi_chunk_sharded_array(tmp_ckpt):
    from shardpoint_core.transactions.backend import ZarrBackend

    be = ZarrBackend(shard_above_bytes=1 << 16, inner_chunk_bytes=1 << 12)
    w = torch.randn(300, 100)
    opts = sp.SaveOptions(plan=sp.PlanOptions(max_chunk_bytes=40_000))
    sp.save({"w": w}, tmp_ckpt, backend=be, options=opts)
    e = sp.read_metadata(tmp_ckpt).tensors["w"]
    assert e.chunk_shape[0] < 300 and torch.equal(sp.load(tmp_ckpt)["w"], w)


# ------------------------------------------------------------------ regressions and extras
def test_overwrite_with_another_shape_reads_the_new_checkpoint(tmp_ckpt):
    """Caches of the old arrays must not serve reads of a checkpoint replaced in place."""
    from shardpoint_core.transactions.backend import ZarrBackend

    for be in (None, ZarrBackend(context={"cache_pool": {"total_bytes_limit": 1 << 24}})):
        sp.save({"w": torch.ones(3)}, tmp_ckpt, backend=be, overwrite=True)
        assert torch.equal(sp.load(tmp_ckpt, backend=be)["w"], torch.ones(3))
        sp.save({"w": torch.full((6,), 5.0)}, tmp_ckpt, overwrite=True, backend=be)
        assert torch.equal(sp.load(tmp_ckpt, backend=be)["w"], torch.full((6,), 5.0))
        sp.save({"w": torch.full((4, 3), 2.0)}, tmp_ckpt, overwrite=True, backend=be)
        assert torch.equal(sp.load(tmp_ckpt, backend=be)["w"], torch.full((4, 3), 2.0))


def test_overwrite_false_never_deletes_a_directory_that_is_not_a_checkpoint(tmp_path):
    import os

    d = tmp_path / "mine"
    d.mkdir()
    (d / "precious.txt").write_text("keep me")
    with pytest.raises(sp.CheckpointExistsError):
        sp.save({"a": torch.ones(1)}, str(d))
    assert (d / "precious.txt").read_text() == "keep me"
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(sp.CheckpointExistsError):
        sp.save({"a": torch.ones(1)}, str(f))
    assert f.read_text() == "x"
    assert not [n for n in os.listdir(tmp_path) if "shardpoint" in n]  # no staging left
    e = tmp_path / "empty"
    e.mkdir()
    sp.save({"a": torch.ones(1)}, str(e))  # an empty dir is fine
    assert torch.equal(sp.load(str(e))["a"], torch.ones(1))
    for how in (True, "any"):  # a plain file is never replaced (issue 21)
        with pytest.raises(sp.CheckpointExistsError, match="is a file, not a checkpoint"):
            sp.save({"a": torch.zeros(1)}, str(f), overwrite=how)
    assert f.read_text() == "x"
    assert not [n for n in os.listdir(tmp_path) if "shardpoint" in n]


def test_like_fills_parameters_in_place(tmp_ckpt):
    lin = torch.nn.Linear(3, 2)
    sp.save({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)}, tmp_ckpt)
    ptr = lin.weight.data_ptr()
    out = sp.load(tmp_ckpt, like={"w": lin.weight, "b": lin.bias})
    assert out["w"] is lin.weight and lin.weight.data_ptr() == ptr and lin.weight.requires_grad
    assert torch.equal(lin.weight.detach(), torch.arange(6.0).reshape(2, 3))
    assert torch.equal(lin.bias.detach(), torch.ones(2))


def test_namedtuples_round_trip_with_like(tmp_ckpt):
    import collections

    NT = collections.namedtuple("NT", "a b")
    sp.save({"n": NT(torch.ones(2), 3)}, tmp_ckpt)
    out = sp.load(tmp_ckpt, like={"n": NT(torch.zeros(2), 0)})
    assert type(out["n"]) is NT and out["n"].b == 3 and torch.equal(out["n"].a, torch.ones(2))


def test_conjugate_and_negative_views_are_saved_by_value(tmp_ckpt):
    x = torch.randn(4, dtype=torch.complex128)
    sp.save({"c": x.conj(), "n": torch._neg_view(torch.arange(3.0))}, tmp_ckpt)
    back = sp.load(tmp_ckpt)
    assert torch.equal(back["c"], x.conj().resolve_conj())
    assert torch.equal(back["n"], -torch.arange(3.0))


def test_non_contiguous_like_targets_are_filled_in_place(tmp_ckpt):
    w = torch.arange(12.0).reshape(4, 3)
    sp.save({"w": w, "bf": w.bfloat16(), "n": w.numpy().copy()}, tmp_ckpt)
    base = torch.zeros(3, 4)
    wide = torch.zeros(4, 6, dtype=torch.bfloat16)
    nbase = np.zeros((3, 4), np.float32)
    like = {"w": base.t(), "bf": wide[:, ::2], "n": nbase.T}
    sp.load(tmp_ckpt, like=like)
    assert torch.equal(base.t(), w) and torch.equal(wide[:, ::2], w.bfloat16())
    assert (wide[:, 1::2] == 0).all() and np.array_equal(nbase.T, w.numpy())


def test_numpy_comes_back_as_numpy_and_like_numpy_in_place(tmp_ckpt):
    a = np.arange(6, dtype=np.float16).reshape(2, 3)
    sp.save({"a": a, "s": np.float64(2.5), "z": np.zeros((0, 2), np.int8)}, tmp_ckpt)
    back = sp.load(tmp_ckpt)
    assert type(back["a"]) is np.ndarray and back["a"].dtype == np.float16
    assert np.array_equal(back["a"], a) and back["z"].shape == (0, 2)
    assert type(back["s"]) is np.float64 and back["s"] == 2.5
    tgt = np.zeros((2, 3), np.float16)
    out = sp.load(tmp_ckpt, like={"a": tgt})
    assert out["a"] is tgt and np.array_equal(tgt, a)
    with pytest.raises(sp.LayoutMismatchError, match="big-endian"):
        sp.load(tmp_ckpt, like={"a": np.zeros((2, 3), ">f2")})


def test_strict_false_missing_keys_of_every_kind(tmp_ckpt):
    sp.save({"a": torch.ones(2)}, tmp_ckpt)
    rep = sp.LoadReport()
    like = {
        "a": torch.zeros(2),
        "t": torch.zeros(1),
        "v": 5,
        "o": sp.ShardedObject(7, 0, 1),
        "st": sp.ShardedTensor(torch.zeros(2), (4,), (0,)),
    }
    out = sp.load(tmp_ckpt, like=like, strict=False, report=rep)
    assert sorted(rep.missing_keys) == sorted(
        ["tensor 't'", "value 'v'", "sharded object 'o'", "tensor 'st'"]
    )
    assert out["v"] == 5 and torch.equal(like["t"], torch.zeros(1))
    for k in ("t", "v", "o", "st"):
        with pytest.raises(sp.LayoutMismatchError, match=f"'{k}'"):
            sp.load(tmp_ckpt, like={"a": torch.zeros(2), k: like[k]})


@pytest.mark.parametrize("d", DTYPES, ids=lambda d: d.name)
def test_sharded_tensor_like_in_one_process_every_dtype(tmp_ckpt, d):
    t = random_bits(d, (5, 4), 7)
    sp.save({"w": t}, tmp_ckpt)
    piece = torch.empty(2, 4, dtype=d.torch)
    flat = torch.empty(7, dtype=d.torch)
    out = sp.load(tmp_ckpt, like={"w": sp.ShardedTensor(piece, (5, 4), (3, 0))})
    assert out["w"] is piece and same_bits(piece, t[3:])
    sp.load(
        tmp_ckpt,
        like={
            "w": sp.ShardedTensor(flat, (5, 4), (1, 0), local_shape=(4, 4), flattened_range=(5, 12))
        },
    )
    assert same_bits(flat, t[1:].reshape(-1)[5:12])
