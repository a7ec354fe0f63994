"""Save/load throughput against peers, in one run on the same machine and the same state.

Compares shardpoint with PyTorch Distributed Checkpoint (DCP, shipped with torch) and, in one
process, plain ``torch.save``/``torch.load``. Each rank holds a TP-style row shard of every
weight plus a replicated bias; loads go to the same layout. Prints seconds, GiB/s and ratios.

    python benchmarks/save_load.py                      # 1 and 2 ranks, ~512 MiB
    python benchmarks/save_load.py --mib 2048 --ranks 1 2 4 --repeat 3
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import warnings

import torch
import torch.distributed as dist

import shardpoint as sp
from shardpoint_conformance.launch import run_world


def _state(rank: int, world: int, mib: int, ntensors: int):
    per = mib * 2**20 // 4 // ntensors          # elements per full tensor
    cols = 1024
    rows = max(world, per // cols)
    g = torch.Generator().manual_seed(1234)
    full = {}
    for i in range(ntensors):
        full[f"layer{i}.w"] = torch.randn(rows, cols, generator=g)
    lo = lambda n: rank * n // world  # noqa: E731
    hi = lambda n: (rank + 1) * n // world  # noqa: E731
    sp_state, dcp_state = {}, {}
    for k, t in full.items():
        shard = t[lo(rows):hi(rows)].clone()
        sp_state[k] = sp.ShardedTensor(shard, t.shape, (lo(rows), 0))
        dcp_state[k] = shard
    sp_state["bias"] = torch.ones(cols)
    dcp_state["bias"] = torch.ones(cols)
    return sp_state, dcp_state, full


def _sync():
    if dist.is_initialized():
        dist.barrier()


def _timed(fn):
    _sync()
    t = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t


def _dcp_state(rank, world, dcp_state, rows_cols):
    """DCP needs DTensors to know the global layout of a sharded tensor."""
    if world == 1:
        return dcp_state
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for k, v in dcp_state.items():
        if k == "bias":
            out[k] = DTensor.from_local(v, mesh, [Replicate()], run_check=False)
        else:
            rows, cols = rows_cols
            out[k] = DTensor.from_local(v, mesh, [Shard(0)], run_check=False,
                                        shape=torch.Size((rows, cols)),
                                        stride=(cols, 1))
    return out


def _bench(rank, world, base, mib, ntensors, repeat):
    import torch.distributed.checkpoint as dcp
    torch.set_num_threads(1)
    sp_state, dcp_plain, full = _state(rank, world, mib, ntensors)
    k0 = next(iter(full))
    dcp_state = _dcp_state(rank, world, dcp_plain, tuple(full[k0].shape))
    res = {"shardpoint save": [], "shardpoint load": [], "dcp save": [], "dcp load": []}
    if world == 1:
        res.update({"torch.save": [], "torch.load": []})
    for it in range(repeat):
        p_sp, p_dcp = f"{base}/sp{it}", f"{base}/dcp{it}"
        res["shardpoint save"].append(_timed(lambda: sp.save(sp_state, p_sp)))
        like = {k: (sp.ShardedTensor(torch.empty_like(v.data), v.global_shape, v.global_offset)
                    if isinstance(v, sp.ShardedTensor) else torch.empty_like(v))
                for k, v in sp_state.items()}
        res["shardpoint load"].append(_timed(lambda: sp.load(p_sp, like=like)))
        assert torch.equal(like[k0].data, sp_state[k0].data), "shardpoint load mismatch"
        res["dcp save"].append(_timed(lambda: dcp.save(dcp_state, checkpoint_id=p_dcp)))
        dlike = {k: torch.empty_like(v) for k, v in dcp_state.items()}
        res["dcp load"].append(_timed(lambda: dcp.load(dlike, checkpoint_id=p_dcp)))
        if world == 1:
            p_t = f"{base}/t{it}.pt"

            def tsave():
                torch.save(dcp_plain, p_t)
                with open(p_t, "rb+") as f:
                    os.fsync(f.fileno())
            res["torch.save"].append(_timed(tsave))
            res["torch.load"].append(_timed(lambda: torch.load(p_t)))
        _sync()
        if rank == 0:
            for p in (p_sp, p_dcp):
                shutil.rmtree(p, ignore_errors=True)
    return res if rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="total state size in MiB")
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    a = ap.parse_args()
    warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
    base = a.dir or tempfile.mkdtemp(prefix="sp-bench-")
    gib = a.mib / 1024
    print(f"state {a.mib} MiB in {a.tensors} fp32 tensors, median of {a.repeat}, dir {base}")
    for world in a.ranks:
        if world == 1:
            res = _bench(0, 1, base, a.mib, a.tensors, a.repeat)
        else:
            res = run_world(world, _bench, base, a.mib, a.tensors, a.repeat, timeout=1800)[0]
        med = {k: statistics.median(v) for k, v in res.items()}
        print(f"\n{world} rank(s):")
        for k, v in med.items():
            print(f"  {k:16s} {v:7.3f} s  {gib / v:6.2f} GiB/s")
        for op in ("save", "load"):
            print(f"  shardpoint/dcp {op} time ratio: "
                  f"{med[f'shardpoint {op}'] / med[f'dcp {op}']:.2f} (lower is better)")
        if world == 1:
            print(f"  shardpoint/torch.save time ratio: "
                  f"{med['shardpoint save'] / med['torch.save']:.2f}")
    if not a.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
