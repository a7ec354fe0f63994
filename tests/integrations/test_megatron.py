"""megatron-core's own sharded_state_dict objects saved and loaded through
``shardpoint.integrations.megatron`` on real gloo ranks, across TP/PP/DP changes, bitwise.

The state dicts are built with megatron-core's ``ShardedTensor.from_rank_offsets``,
``ShardedTensor`` (the 0.16 distributed optimizer's bucket-space tensors),
``ShardedTensorFactory``, ``ShardedObject`` and ``LocalNonpersistentObject``: layer-stacked
weights (``prepend_axis_num``; a pipeline stage holds several layers of one key), MoE experts
(several per rank), TP row/column splits, TP-replicated layernorms, a SwiGLU factory (two
pieces of one key per rank), a tensor every rank holds with Megatron's fully-parallel replica
ids (0 for the main holder, 1 for all others), distributed-optimizer ``flattened_range``
pieces split over DP, a (PP, TP) grid of RNG states and a DP grid of data-loader states.
"""

import importlib.util
import os
import re

import pytest
import torch

from shardpoint_testing.launch import run_world
from shardpoint_testing.tensors import same_bits, seeded_randn

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (pip install "
    "'megatron-core==0.16.*', part of the test extra)",
)

L, H, QKV, FFN, E, V, P = 4, 8, 12, 4, 4, 16, 6  # layers, hidden, ..., experts, vocab


def full(key, shape, dtype):
    # position-weighted seed: keys that are anagrams ("q.k" / "k.q") get different tensors
    return seeded_randn(sum(ord(c) * (i + 1) for i, c in enumerate(key)), shape, dtype)


MODEL = {  # key -> (global shape, dtype)
    "embedding.word_embeddings.weight": ((V, H), torch.bfloat16),
    "embedding.position_embeddings.weight": ((P, H), torch.bfloat16),
    "decoder.layers.self_attention.linear_qkv.weight": ((L, QKV, H), torch.bfloat16),
    "decoder.layers.self_attention.linear_proj.weight": ((L, H, QKV), torch.bfloat16),
    "decoder.layers.input_layernorm.weight": ((L, H), torch.float32),
    "decoder.layers.mlp.experts.linear_fc1.weight": ((L, E, FFN, H), torch.bfloat16),
    "decoder.final_layernorm.weight": ((H,), torch.float32),
    "output_layer.linear_fc1.weight": ((2 * FFN, H), torch.bfloat16),  # via a factory
}
FACTORY = "output_layer.linear_fc1.weight"
OPTIMIZED = [
    "embedding.word_embeddings.weight",
    "decoder.layers.self_attention.linear_qkv.weight",
    "decoder.layers.self_attention.linear_proj.weight",
    "decoder.layers.mlp.experts.linear_fc1.weight",
]


def opt_key(key):
    return "optimizer.state.exp_avg." + key


def split(n, parts, i):
    return i * n // parts, (i + 1) * n // parts


def expected_full(key):
    if key.startswith("optimizer.state.exp_avg."):
        shape = MODEL[key[len("optimizer.state.exp_avg.") :]][0]
        return full(key, shape, torch.float32)
    return full(key, *MODEL[key])


def model_pieces(tp, pp, dp, rank):
    """``[(dict key, key, data, rank_offsets, prepend, replica_id)]`` of one rank's model,
    as Megatron's layers describe them (rank = (pp, dp, tp) row-major, tp fastest)."""
    t, d, p = rank % tp, (rank // tp) % dp, rank // (tp * dp)
    lp = L // pp
    out = []

    def piece(name, key, idx, offsets, prepend, rep):
        out.append((name, key, expected_full(key)[idx].clone(), offsets, prepend, rep))

    if p == 0:
        a, b = split(V, tp, t)
        piece(
            "embedding.word_embeddings.weight",
            "embedding.word_embeddings.weight",
            (slice(a, b),),
            [(0, t, tp)],
            0,
            (0, 0, d),
        )
    # every rank holds it; Megatron's fully-parallel ids: 0 for one holder, 1 for all others
    piece(
        "embedding.position_embeddings.weight",
        "embedding.position_embeddings.weight",
        (slice(None),),
        [],
        0,
        0 if rank == 0 else 1,
    )
    for i in range(lp):
        g = p * lp + i  # global layer; dict keys use local i
        pre = f"decoder.layers.{i}."
        a, b = split(QKV, tp, t)
        piece(
            pre + "self_attention.linear_qkv.weight",
            "decoder.layers.self_attention.linear_qkv.weight",
            (g, slice(a, b)),
            [(0, g, L), (1, t, tp)],
            1,
            (0, 0, d),
        )
        piece(
            pre + "self_attention.linear_proj.weight",
            "decoder.layers.self_attention.linear_proj.weight",
            (g, slice(None), slice(a, b)),
            [(0, g, L), (2, t, tp)],
            1,
            (0, 0, d),
        )
        piece(
            pre + "input_layernorm.weight",
            "decoder.layers.input_layernorm.weight",
            (g,),
            [(0, g, L)],
            1,
            (0, t, d),
        )
        ne = E // tp  # expert parallel over the TP ranks
        for j in range(ne):
            e = t * ne + j
            piece(
                pre + f"mlp.experts.local_experts.{j}.linear_fc1.weight",
                "decoder.layers.mlp.experts.linear_fc1.weight",
                (g, e),
                [(0, g, L), (1, e, E)],
                2,
                (0, 0, d),
            )
    if p == pp - 1:
        piece(
            "decoder.final_layernorm.weight",
            "decoder.final_layernorm.weight",
            (slice(None),),
            [],
            0,
            (0, t, d),
        )
    return out


def sharded_state_dict(tp, pp, dp, rank, *, load=False, objects=("rng", "loader"), buckets=True):
    """One rank's Megatron sharded_state_dict for TP x PP x DP (``load``: sentinel data).
    ``buckets``: the 0.16 bucket-space optimizer buffers (reloadable with the same TP x PP
    only, as in Megatron)."""
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedObject,
        ShardedTensor,
    )

    t, d, p = rank % tp, (rank // tp) % dp, rank // (tp * dp)

    def data(x):
        return torch.full_like(x, -7) if load else x

    model, opt = {}, {}
    pieces = model_pieces(tp, pp, dp, rank)
    for name, key, x, offsets, prepend, rep in pieces:
        model[name] = ShardedTensor.from_rank_offsets(
            key, data(x), *offsets, replica_id=rep, prepend_axis_num=prepend
        )
    if p == pp - 1:
        model[FACTORY] = swiglu_factory(data(factory_local(tp, t)), tp, t, (0, 0, d))
    # distributed optimizer (fully_sharded_model_space, megatron-core <= 0.15): the DP group
    # splits the concatenated local blocks into DP ranges; each rank's part of each block is a
    # flattened_range piece. (0.16 refuses to construct these, so they are set as its
    # earlier versions' from_rank_offsets_flat did.)
    blocks = [pc for pc in pieces if pc[1] in OPTIMIZED]
    total = sum(x.numel() for _, _, x, *_ in blocks)
    lo, hi = split(total, dp, d)
    pos = 0
    for name, key, x, offsets, prepend, _rep in blocks:
        a, b = max(lo, pos) - pos, min(hi, pos + x.numel()) - pos
        pos += x.numel()
        if a >= b:
            continue
        k = opt_key(key)
        block = _block_of(k, offsets, prepend, x.shape)
        st = ShardedTensor.from_rank_offsets(
            k, torch.empty(x.shape), *offsets, replica_id=(0, 0, 0), prepend_axis_num=prepend
        )
        st.flattened_range = slice(a, b)
        st.data = data(block.reshape(-1)[a:b].clone())
        opt[name] = st
    # 0.16's bucket-space distributed optimizer: one 1-D buffer per (PP, TP) group split over DP
    if buckets:
        buf = bucket(tp, pp, p, t)
        ba, bb = split(buf.numel(), dp, d)
        opt["bucket"] = ShardedTensor(
            bucket_key(tp, p, t),
            data(buf[ba:bb].clone()),
            torch.float32,
            (bb - ba,),
            (buf.numel(),),
            (ba,),
            axis_fragmentations=None,
            replica_id=(0, 0, 0),
        )
    ssd = {
        "model": model,
        "optimizer": {
            "state": opt,
            "param_groups": [{"lr": 1e-3, "params": [0, 1]}],
            "padding": LocalNonpersistentObject(rank),
        },
        "iteration": 0 if load else 700,
        "checkpoint_version": 3.0,
    }
    if "rng" in objects:
        ssd["rng_state"] = ShardedObject(
            "rng_state", None if load else rng_value(p, t), (pp, tp), (p, t), replica_id=d
        )
    if "loader" in objects:
        ssd["dataloader"] = ShardedObject(
            "dataloader_state",
            None if load else {"consumed": 100 + d},
            (dp,),
            (d,),
            replica_id=(p, t),
        )
    return ssd


def factory_local(tp, t):
    """A SwiGLU fc1 weight as Megatron keeps it on TP rank ``t``: its rows of W stacked on
    its rows of V (globally all of W, then all of V)."""
    g = expected_full(FACTORY)
    a, b = split(FFN, tp, t)
    return torch.cat([g[a:b], g[FFN + a : FFN + b]])


def swiglu_factory(local, tp, t, replica_id):
    """megatron-core's ShardedTensorFactory, built as its apply_swiglu_sharded_factory does:
    two pieces of one key per rank (fragments t and tp + t of 2 * tp), merged back by cat."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    def build(key, x, rep, flattened_range):
        w, v = torch.chunk(x, 2, dim=0)
        return [
            ShardedTensor.from_rank_offsets(key, w, (0, t, 2 * tp), replica_id=rep),
            ShardedTensor.from_rank_offsets(key, v, (0, tp + t, 2 * tp), replica_id=rep),
        ]

    def merge(sub):
        return torch.cat(sub)

    return ShardedTensorFactory(FACTORY, local, build, merge, replica_id)


def _block_of(key, offsets, prepend, local_shape):
    """The block of ``key``'s full tensor that rank offsets ``offsets`` name."""
    g = expected_full(key)
    idx = [slice(None)] * g.dim()
    for axis, o, _f in offsets:
        n = 1 if axis < prepend else local_shape[axis - prepend]
        idx[axis] = slice(o * n, o * n + n)
    return g[tuple(idx)].reshape(local_shape)


def bucket_key(tp, p, t):
    return f"optimizer.distributed.dp_group_idx_{p * tp + t}.gbuf_idx_0.bucket_idx_0.param"


def bucket(tp, pp, p, t):
    """The 0.16 bucket-space buffer of group (p, t): its optimizer blocks, concatenated."""
    parts = []
    for _name, key, x, offsets, prepend, _ in model_pieces(tp, pp, 1, p * tp + t):
        if key in OPTIMIZED:
            parts.append(_block_of(opt_key(key), offsets, prepend, x.shape).reshape(-1))
    return torch.cat(parts)


def rng_value(p, t):
    import numpy as np

    return {
        "random_rng_state": (3, tuple(range(p, p + 5)), None),
        "np_rng_state": ("MT19937", np.arange(4, dtype=np.uint32) + t, 1, 0, 0.0),
        "torch_rng_state": torch.arange(6, dtype=torch.uint8) + 10 * p + t,
    }


def check_loaded(ssd, out, tp, pp, dp, rank):
    """Every ShardedTensor of ``ssd`` filled in place with the expected bits; ``out`` is the
    state dict load_megatron returned."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    bad = []
    for group in (ssd["model"], ssd["optimizer"]["state"]):
        for name, st in group.items():
            if not isinstance(st, ShardedTensor):
                continue
            if name == "bucket":
                t, p = rank % tp, rank // (tp * dp)
                buf = bucket(tp, pp, p, t)
                want = buf[st.global_offset[0] : st.global_offset[0] + st.data.numel()]
            else:
                want = expected_full(st.key)[st.global_slice()]
                if st.flattened_range is not None:
                    want = want.reshape(-1)[st.flattened_range]
            if not same_bits(st.data, want):
                bad.append(f"tp{tp}pp{pp}dp{dp} rank {rank}: {name} ({st.key})")
    for name, st in ssd["model"].items():
        if name == FACTORY:  # merged by the factory's merge_fn from its filled pieces
            if not same_bits(out["model"][name], factory_local(tp, rank % tp)):
                bad.append(f"tp{tp}pp{pp}dp{dp} rank {rank}: factory {name}")
        elif out["model"][name] is not st.data:
            bad.append(f"{name}: the returned tensor is not the caller's (not filled in place)")
    if out["iteration"] != 700 or out["checkpoint_version"] != 3.0:
        bad.append(f"common values: {out['iteration']} {out['checkpoint_version']}")
    if out["optimizer"]["padding"] != rank or out["optimizer"]["param_groups"] != [
        {"lr": 1e-3, "params": [0, 1]}
    ]:
        bad.append("optimizer common part / nonpersistent object")
    return bad


def megatron_job(rank, world, base):
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    import shardpoint as sp
    from shardpoint.integrations.megatron import load_megatron, save_megatron

    bad, info = [], {}

    # A: TP2 x PP2, saved on the 4 ranks
    r = save_megatron(sharded_state_dict(2, 2, 1, rank), f"{base}/a")
    info["left_out"] = r.left_out
    # ... loaded as TP4 (experts: one per rank per layer; the DP grid (1,) of loader states
    # matches, the (PP, TP) grid of RNG states does not and is left out, as on a TP change)
    ssd = sharded_state_dict(4, 1, 1, rank, load=True, objects=("loader",), buckets=False)
    out = load_megatron(ssd, f"{base}/a")
    bad += check_loaded(ssd, out, 4, 1, 1, rank)
    if out["dataloader"] != {"consumed": 100}:
        bad.append(f"loader state {out['dataloader']}")
    # ... and as TP1 x PP2 x DP2: the distributed optimizer's ranges split over DP
    ssd = sharded_state_dict(1, 2, 2, rank, load=True, objects=(), buckets=False)
    bad += check_loaded(ssd, load_megatron(ssd, f"{base}/a"), 1, 2, 2, rank)
    # the DP grid of loader states is (1,) in A and (2,) here: an error naming both
    try:
        load_megatron(
            sharded_state_dict(1, 2, 2, rank, load=True, objects=("loader",), buckets=False),
            f"{base}/a",
        )
        info["grid_error"] = "loaded"
    except sp.LayoutMismatchError as e:
        info["grid_error"] = str(e)

    # mistakes are named by Megatron key before any write: mapping errors on the rank that
    # makes them, overlapping pieces of one rank when the (collective) save plans
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from shardpoint.integrations.megatron import megatron_tree

    w = torch.ones(2, 3)
    cases = {
        "tensor_and_object": {
            "a": ShardedTensor.from_rank_offsets("k", w),
            "b": ShardedObject("k", 1, (1,), (0,)),
        },
        "object_twice": {
            "a": ShardedObject("o", 1, (2,), (0,)),
            "b": ShardedObject("o", 2, (2,), (1,)),
        },
        "no_data": {"a": ShardedTensor.from_rank_offsets("k", w).without_data()},
        "overlap": {
            "a": ShardedTensor.from_rank_offsets("k", w, (0, 0, 2)),
            "b": ShardedTensor.from_rank_offsets("k", w, (0, 0, 2)),
        },
    }
    for name, case in cases.items():
        try:
            megatron_tree(case) if name != "overlap" else save_megatron(case, f"{base}/x")
            info[name] = "accepted"
        except sp.ShardpointError as e:
            info[name] = f"{type(e).__name__}: {e}"
    info["overlap_written"] = os.path.exists(f"{base}/x")

    # B: TP1 x PP2 x DP2 saved (flattened ranges really split over DP)
    save_megatron(sharded_state_dict(1, 2, 2, rank), f"{base}/b")
    # ... loaded as TP1 x PP2 on 2 ranks: two 2-rank groups load it independently; the RNG
    # state grid (2, 1) matches and comes back, the bucket buffers are resharded over DP
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    sub = rank % 2
    ssd = sharded_state_dict(1, 2, 1, sub, load=True, objects=("rng",))
    out = load_megatron(ssd, f"{base}/b", group=groups[rank // 2])
    bad += check_loaded(ssd, out, 1, 2, 1, sub)
    want = rng_value(sub, 0)
    got = out["rng_state"]
    if (
        got["random_rng_state"] != want["random_rng_state"]
        or not (got["np_rng_state"][1] == want["np_rng_state"][1]).all()
        or not torch.equal(got["torch_rng_state"], want["torch_rng_state"])
    ):
        bad.append(f"rng state {got!r}")
    # ... and as TP2 x PP2 on the 4 ranks
    ssd = sharded_state_dict(2, 2, 1, rank, load=True, objects=(), buckets=False)
    bad += check_loaded(ssd, load_megatron(ssd, f"{base}/b"), 2, 2, 1, rank)
    return bad, info


def test_megatron_core_round_trip_across_tp_pp_dp(tmp_path):
    res = run_world(4, megatron_job, str(tmp_path), timeout=240)
    assert all(not bad for bad, _ in res), [b for b, _ in res]
    for _, info in res:
        assert info["left_out"] == ["sharded_state_dict['optimizer']['padding']"]
        assert info["tensor_and_object"].startswith("InvalidShardingError")
        assert "'k' names both" in info["tensor_and_object"]
        assert "ShardedObject 'o' twice" in info["object_twice"]
        assert info["no_data"].startswith("UnsupportedValueError") and "'k'" in info["no_data"]
        assert "SP-COVER-3" in info["overlap"] and "sharded/k" in info["overlap"]
        assert not info["overlap_written"]
        err = info["grid_error"]
        assert "SP-OBJ-2" in err and "sharded/dataloader_state" in err, err
        assert re.search(r"count[^0-9]*1\b.*count[^0-9]*2\b", err), err
    # every saved tensor, read whole in this process without megatron-core, is the global one
    import shardpoint as sp
    from shardpoint_core.verify import verify_checkpoint

    for name, (tp, pp) in (("a", (2, 2)), ("b", (1, 2))):
        path = str(tmp_path / name)
        assert verify_checkpoint(path, strict=True).ok
        back = sp.load(path)
        for key in MODEL:
            assert same_bits(back["sharded"][key], expected_full(key)), (name, key)
        for key in OPTIMIZED:
            assert same_bits(back["sharded"][opt_key(key)], expected_full(opt_key(key)))
        for p in range(pp):
            for t in range(tp):
                k = bucket_key(tp, p, t)
                assert same_bits(back["sharded"][k], bucket(tp, pp, p, t)), (name, k)
        assert back["common"]["iteration"] == 700 and "padding" not in back["common"]["optimizer"]


def test_save_and_load_megatron_leave_nothing_in_reference_cycles(tmp_path):
    """The Megatron mapping keeps no tensor (nor the closures that hold them) alive in a
    reference cycle: buffers are freed when the call returns, not at the next collection."""
    from shardpoint.integrations.megatron import load_megatron, save_megatron
    from shardpoint_testing.probes import garbage_of

    path = str(tmp_path / "m")
    calls = {
        "save": lambda: save_megatron(sharded_state_dict(1, 1, 1, 0), path, overwrite=True),
        "load": lambda: load_megatron(sharded_state_dict(1, 1, 1, 0, load=True), path),
    }
    for name, fn in calls.items():
        found = garbage_of(fn)
        held = [o for o in found if isinstance(o, torch.Tensor) or type(o).__name__ == "function"]
        assert not held, (
            name,
            sorted({getattr(o, "__qualname__", type(o).__name__) for o in held}),
        )
