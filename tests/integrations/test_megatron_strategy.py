"""megatron-core's own ``dist_checkpointing.save``/``load`` writing and reading shardpoint
through the ``shardpoint`` backend strategies, on 4 real gloo ranks across TP/PP/DP changes:
plain, under Megatron's fully-parallel save wrapper (and its load wrapper where CUDA exists),
through its async save path (the ``AsyncRequest`` it returns, finalized as its queue does),
with the common state in a shardpoint checkpoint instead of ``common.pt``. The sharded state
dicts are test_megatron's (layer-stacked weights, MoE experts, a SwiGLU factory, 0.16
bucket-space optimizer buffers, RNG and data-loader object grids; the flattened ranges
megatron-core 0.16's own save refuses are left out). Slow (4 ranks, three saves): the
default suite covers the backend through tests/integrations/test_crossover.py and the README example."""

import importlib.util
import os
import subprocess
import sys

import pytest

from shardpoint_testing.launch import run_world

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (pip install "
    "'megatron-core==0.16.*', part of the test extra)",
)


def _ssd(*args, **kwargs):
    """test_megatron's state dict without the flattened_range optimizer pieces, which
    megatron-core 0.16's own ``save`` refuses ("flattened_range is not supported")."""
    from .test_megatron import sharded_state_dict

    ssd = sharded_state_dict(*args, **kwargs)
    state = ssd["optimizer"]["state"]
    for k in [k for k, v in state.items() if getattr(v, "flattened_range", None) is not None]:
        del state[k]
    return ssd


def _job(rank, world, base):
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )
    import shardpoint.integrations.megatron_strategy as ms
    from .test_megatron import check_loaded

    ms.use_shardpoint_common(True)
    bad = []

    # A: TP2 x PP2 saved by Megatron's save with the backend named; loaded as TP4 by
    # Megatron's load, which finds the strategy from the checkpoint's metadata.json
    a = f"{base}/a"
    if rank == 0:
        os.makedirs(a)
    dist.barrier()
    dist_checkpointing.save(_ssd(2, 2, 1, rank), a, sharded_strategy=("shardpoint", 1))
    ssd = _ssd(4, 1, 1, rank, load=True, objects=("loader",), buckets=False)
    out = dist_checkpointing.load(ssd, a)
    bad += check_loaded(ssd, out, 4, 1, 1, rank)
    if out["dataloader"] != {"consumed": 100}:
        bad.append(f"loader state {out['dataloader']}")
    meta = dist_checkpointing.load_tensors_metadata(a)
    if tuple(meta["decoder.layers.self_attention.linear_qkv.weight"].global_shape) != (4, 12, 8):
        bad.append(f"tensors metadata {meta}")

    # B: TP1 x PP2 x DP2 under the fully-parallel save wrapper (replicas elected across DP),
    # loaded as TP2 x PP2: under the fully-parallel load wrapper where CUDA exists (its
    # exchange in megatron-core 0.16 allocates on CUDA and calls torch.cuda.synchronize()),
    # else with the plain strategy
    import torch

    b = f"{base}/b"
    if rank == 0:
        os.makedirs(b)
    dist.barrier()
    save_s = FullyParallelSaveStrategyWrapper(ms.ShardpointSaveStrategy(), dist.group.WORLD)
    dist_checkpointing.save(_ssd(1, 2, 2, rank), b, sharded_strategy=save_s)
    ssd = _ssd(2, 2, 1, rank, load=True, objects=(), buckets=False)
    load_s = (
        FullyParallelLoadStrategyWrapper(ms.ShardpointLoadStrategy(), dist.group.WORLD)
        if torch.cuda.is_available()
        else None
    )
    bad += check_loaded(
        ssd, dist_checkpointing.load(ssd, b, sharded_strategy=load_s), 2, 2, 1, rank
    )

    # C: Megatron's async path: save returns an AsyncRequest, its queue finalizes it
    c = f"{base}/c"
    if rank == 0:
        os.makedirs(c)
    dist.barrier()
    src = _ssd(2, 1, 2, rank)
    req = dist_checkpointing.save(
        src, c, sharded_strategy=ms.ShardpointSaveStrategy(), async_sharded_save=True
    )
    for st in src["model"].values():  # staged: the job may change its tensors right away
        if getattr(st, "data", None) is not None:
            st.data.zero_()
    if torch.cuda.is_available():
        queue = AsyncCallsQueue()
        queue.schedule_async_request(req)
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
    else:  # megatron-core 0.16's AsyncCallsQueue syncs ranks through CUDA tensors; on CPU
        # ranks run the request as the queue does: its async part, then its finalize steps
        assert req.async_fn is None
        for fn in req.finalize_fns:
            fn()
    ssd = _ssd(1, 4, 1, rank, load=True, objects=(), buckets=False)
    bad += check_loaded(ssd, dist_checkpointing.load(ssd, c), 1, 4, 1, rank)
    ms.use_shardpoint_common(False)
    return bad


@pytest.mark.slow
def test_megatron_dist_checkpointing_with_shardpoint_backend(tmp_path):
    tests = os.path.dirname(os.path.abspath(__file__))
    if tests not in sys.path:
        sys.path.insert(0, tests)
    res = run_world(4, _job, str(tmp_path), timeout=300)
    assert res == [[]] * 4, res
    for name in ("a", "b", "c"):
        d = tmp_path / name
        assert sorted(os.listdir(d)) == ["common", "metadata.json", "shardpoint"], name
        for part in ("shardpoint", "common"):
            r = subprocess.run(
                [sys.executable, "-m", "shardpoint", "verify", "--strict", str(d / part)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert r.returncode == 0 and r.stdout.startswith("OK:"), r.stdout + r.stderr
    import shardpoint as sp

    common = sp.load(str(tmp_path / "a" / "common"))
    assert common["iteration"] == 700 and common["checkpoint_version"] == 3.0


def test_sharded_metadata_is_read_from_the_typed_tree(tmp_path):
    """``load_tensors_metadata`` / ``load_sharded_metadata`` (what Megatron asks before a
    load): every tensor and each cell of each object grid under ``sharded/`` (a cell keyed
    by its ``unique_key``, as Megatron's torch_dist answers), nothing outside it, no bytes."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    import shardpoint as sp
    from shardpoint.integrations.megatron import SHARDED
    from shardpoint.integrations.megatron_strategy import ShardpointLoadStrategy

    sp.save(
        {
            SHARDED: {
                "dec.w": torch.ones(3, 2, dtype=torch.bfloat16),
                "rng": sp.ShardedObject(1, (0, 0), (1, 1)),
                "n": 4,
            },
            "other": torch.zeros(1),
        },
        str(tmp_path / "shardpoint"),
    )
    meta = ShardpointLoadStrategy().load_sharded_metadata(tmp_path)
    assert sorted(meta) == ["dec.w", "rng/shard_0.0_1.1"]
    w, rng = meta["dec.w"], meta["rng/shard_0.0_1.1"]
    assert isinstance(w, ShardedTensor) and w.data is None and w.dtype == torch.bfloat16
    assert (w.key, w.global_shape, w.local_shape) == ("dec.w", (3, 2), (3, 2))
    assert isinstance(rng, ShardedObject) and rng.global_shape == (1, 1)
    assert rng.key == "rng" and rng.global_offset == (0, 0)
    assert sorted(ShardpointLoadStrategy().load_tensors_metadata(tmp_path)) == ["dec.w"]
