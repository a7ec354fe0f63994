"""Resharded loads on real gloo ranks: tensors saved by ``save_world`` ranks split by rows,
loaded by the same layout (the reference) and by columns, shardpoint and DCP interleaved, the
page cache dropped by rank 0 before every timed step. Run through ``run_world``."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

import shardpoint as sp
from bench_tools import drop_caches


def _split(n: int, world: int, rank: int) -> tuple:
    """torch.chunk's split (what DTensor Shard uses): ceil-sized pieces, last one short."""
    step = -(-n // world)
    return min(n, rank * step), min(n, (rank + 1) * step)


def _full(i: int, rows: int, cols: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(rows, cols, generator=g)


def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (world,))


def _dtensor(local, mesh, dim, rows, cols):
    from torch.distributed.tensor import DTensor, Shard
    return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False,
                              shape=torch.Size((rows, cols)), stride=(cols, 1))


def save_job(rank, world, base, n, rows, cols):
    """Both tools save the same row-split state (not timed here)."""
    import torch.distributed.checkpoint as dcp
    a, b = _split(rows, world, rank)
    full = [_full(i, rows, cols) for i in range(n)]
    sp.save({f"w{i}": sp.ShardedTensor(t[a:b].clone(), (rows, cols), (a, 0))
             for i, t in enumerate(full)}, f"{base}/sp", overwrite=True)
    mesh = _mesh(world)
    dcp.save({f"w{i}": _dtensor(t[a:b].clone(), mesh, 0, rows, cols) for i, t in enumerate(full)},
             checkpoint_id=f"{base}/dcp")
    return True


def _timed(fn, drop: bool, rank: int):
    dist.barrier()
    if drop and rank == 0:
        drop_caches()
    dist.barrier()
    t = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t, out


def save_and_load_job(rank, world, base, n, rows, cols, repeat, drop):
    """The saving world also runs the loads (same layout and by columns): one spawn less."""
    save_job(rank, world, base, n, rows, cols)
    return load_job(rank, world, base, n, rows, cols, repeat, drop, True)


def load_job(rank, world, base, n, rows, cols, repeat, drop, same_layout):
    """Timings (seconds, per repeat) of each load kind on this world; rank 0's list is the
    one reported (every step ends in a barrier, so it is the slowest rank's time)."""
    import torch.distributed.checkpoint as dcp
    mesh = _mesh(world)
    ra, rb = _split(rows, world, rank)
    ca, cb = _split(cols, world, rank)
    res: dict = {}
    want = [_full(i, rows, cols) for i in range(n)]

    def sp_load(dim, strategy="auto"):
        def run():
            if dim == 0:
                like = {f"w{i}": sp.ShardedTensor(torch.empty(rb - ra, cols), (rows, cols),
                                                  (ra, 0)) for i in range(n)}
            else:
                like = {f"w{i}": sp.ShardedTensor(torch.empty(rows, cb - ca), (rows, cols),
                                                  (0, ca)) for i in range(n)}
            rep = sp.LoadReport()
            out = sp.load(f"{base}/sp", like=like, report=rep,
                          options=sp.LoadOptions(strategy=strategy))
            sl = (slice(ra, rb), slice(None)) if dim == 0 else (slice(None), slice(ca, cb))
            assert all(torch.equal(out[f"w{i}"], want[i][sl]) for i in range(n)), "mismatch"
            return rep
        return run

    def dcp_load(dim):
        def run():
            shape = (rb - ra, cols) if dim == 0 else (rows, cb - ca)
            like = {f"w{i}": _dtensor(torch.empty(shape), mesh, dim, rows, cols)
                    for i in range(n)}
            dcp.load(like, checkpoint_id=f"{base}/dcp")
            sl = (slice(ra, rb), slice(None)) if dim == 0 else (slice(None), slice(ca, cb))
            assert all(torch.equal(like[f"w{i}"].to_local(), want[i][sl]) for i in range(n))
        return run

    steps = []
    if same_layout:
        steps += [("sp rows", sp_load(0)), ("dcp rows", dcp_load(0))]
    steps += [("sp cols", sp_load(1)), ("dcp cols", dcp_load(1)),
              ("sp cols dedup", sp_load(1, "dedup"))]
    for name, fn in steps if drop else []:   # warm up: group setup, first-call costs
        _timed(fn, False, rank)
    for _ in range(repeat):
        for name, fn in steps:
            t, rep = _timed(fn, drop, rank)
            res.setdefault(name, []).append(t)
            if name == "sp cols":
                res.setdefault("auto chose", []).append(rep.strategy)
            if name == "sp cols dedup":
                xt = rep.timings.get("exchange", 0.0)
                rate = rep.exchange_bytes / xt / 1e9 if xt else 0.0
                rates = [None] * world
                dist.all_gather_object(rates, rate)
                res.setdefault("exchange GB/s per rank", []).append(
                    sorted(rates)[len(rates) // 2])
    return res if rank == 0 else None


def single_process(base, n, rows, cols, repeat, drop):
    """A world of one loading the whole tensors of the row-split checkpoints."""
    import torch.distributed.checkpoint as dcp
    res: dict = {}
    for _ in range(repeat):
        for name in ("sp full", "dcp full"):
            like = {f"w{i}": torch.empty(rows, cols) for i in range(n)}
            if drop:
                drop_caches()
            t = time.perf_counter()
            if name == "sp full":
                sp.load(f"{base}/sp", like=like)
            else:
                dcp.load(like, checkpoint_id=f"{base}/dcp", no_dist=True)
            res.setdefault(name, []).append(time.perf_counter() - t)
            assert torch.equal(like["w0"], _full(0, rows, cols)), name
    return res


def main(argv=None) -> None:
    """Only the resharded-load table of ``bench.py`` (one command, same steps and table)."""
    import argparse
    import os
    import sys
    import tempfile
    import warnings
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench
    import bench_tools as bt
    ap = argparse.ArgumentParser(description="shardpoint resharded-load benchmark")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one run")
    ap.add_argument("--repeat", type=int, default=None, help="runs per step (default 3)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    repeat = a.repeat or (1 if a.quick else 3)
    base = tempfile.mkdtemp(prefix="sp-bench-reshard-", dir=a.dir)
    drop = not a.quick and bt.drop_caches()
    print(f"page cache: {'dropped before every timed step' if drop else 'NOT dropped'}")
    try:
        bench.bench_reshard(base, a.quick, repeat, drop)
    finally:
        bt.rm(base)


if __name__ == "__main__":
    main()
