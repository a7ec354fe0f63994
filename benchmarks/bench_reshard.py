"""Resharded loads on real gloo ranks: tensors saved by ``save_world`` ranks split by rows,
loaded by the same layout (the reference) and by columns, shardpoint and DCP interleaved, the
page cache dropped by rank 0 before every timed step. Loads fill existing tensors (as a job
loads into its model; the same as ``bench.py``'s loads), and the check of what each loaded
runs after its timed part. Run through ``run_world``."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import shardpoint as sp
from bench_tools import drop_caches, file_layout, raw_read_files

RAW_THREADS = 8  # per rank, as the backend's read threads


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

    return DTensor.from_local(
        local, mesh, [Shard(dim)], run_check=False, shape=torch.Size((rows, cols)), stride=(cols, 1)
    )


def save_job(rank, world, base, n, rows, cols):
    """Both tools save the same row-split state (not timed here)."""
    import torch.distributed.checkpoint as dcp

    a, b = _split(rows, world, rank)
    full = [_full(i, rows, cols) for i in range(n)]
    sp.save(
        {
            f"w{i}": sp.ShardedTensor(t[a:b].clone(), (rows, cols), (a, 0))
            for i, t in enumerate(full)
        },
        f"{base}/sp",
        overwrite=True,
    )
    mesh = _mesh(world)
    dcp.save(
        {f"w{i}": _dtensor(t[a:b].clone(), mesh, 0, rows, cols) for i, t in enumerate(full)},
        checkpoint_id=f"{base}/dcp",
    )
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
    one reported (every step ends in a barrier, so it is the slowest rank's time).

    Every load fills tensors that already exist, as a job loads into its model: each tool
    has its own destination per layout, allocated once and zeroed before every step (so a
    step that loaded nothing fails its check), and checked after the timed part."""
    import torch.distributed.checkpoint as dcp

    mesh = _mesh(world)
    ra, rb = _split(rows, world, rank)
    ca, cb = _split(cols, world, rank)
    res: dict = {}
    want = [_full(i, rows, cols) for i in range(n)]
    shape = {0: (rb - ra, cols), 1: (rows, cb - ca)}
    offset = {0: (ra, 0), 1: (0, ca)}
    part = {0: (slice(ra, rb), slice(None)), 1: (slice(None), slice(ca, cb))}

    def sp_step(dim, strategy="auto"):
        dst = [torch.zeros(shape[dim]) for _ in range(n)]
        like = {f"w{i}": sp.ShardedTensor(t, (rows, cols), offset[dim]) for i, t in enumerate(dst)}

        def run():
            rep = sp.LoadReport()
            sp.load(f"{base}/sp", like=like, report=rep, options=sp.LoadOptions(strategy=strategy))
            return rep

        return dst, run, dim

    def dcp_step(dim):
        dst = [torch.zeros(shape[dim]) for _ in range(n)]
        like = {f"w{i}": _dtensor(t, mesh, dim, rows, cols) for i, t in enumerate(dst)}
        return dst, lambda: dcp.load(like, checkpoint_id=f"{base}/dcp"), dim

    def raw_step():
        """The disk's limit for any load of this checkpoint: every rank reads its share of
        the checkpoint's files (every world-th, by size) raw, ``RAW_THREADS`` threads of
        preadv each, no checks, all ranks at once as the loads do."""
        layout = sorted(file_layout(f"{base}/sp"), key=lambda f: -f[1])[rank::world]
        bufs = [torch.empty(sum(n_ for _, n_ in layout) or 1, dtype=torch.uint8)]
        return [], lambda: raw_read_files(bufs, layout, f"{base}/sp", RAW_THREADS), None

    steps = [("raw files", raw_step())]
    if same_layout:
        steps += [("sp rows", sp_step(0)), ("dcp rows", dcp_step(0))]
    steps += [
        ("sp cols", sp_step(1)),
        ("dcp cols", dcp_step(1)),
        ("sp cols dedup", sp_step(1, "dedup")),
    ]
    rounds = ([False] if drop else []) + [True] * repeat  # warm up: group setup, first calls
    for timed in rounds:
        for name, (dst, fn, dim) in steps:
            for t_ in dst:
                t_.zero_()
            t, rep = _timed(fn, drop and timed, rank)
            assert dim is None or all(torch.equal(dst[i], want[i][part[dim]]) for i in range(n)), (
                name
            )
            if not timed:
                continue
            res.setdefault(name, []).append(t)
            if name == "sp cols":
                res.setdefault("auto chose", []).append(rep.strategy)
            if name == "sp cols dedup":
                xt = rep.timings.get("exchange", 0.0)
                rate = rep.exchange_bytes / xt / 1e9 if xt else 0.0
                rates = [None] * world
                dist.all_gather_object(rates, rate)
                res.setdefault("exchange GB/s per rank", []).append(sorted(rates)[len(rates) // 2])
    return res if rank == 0 else None


def single_process(base, n, rows, cols, repeat, drop):
    """A world of one loading the whole tensors of the row-split checkpoints, each tool into
    its own existing tensors (zeroed before every step, checked after the timed part)."""
    import torch.distributed.checkpoint as dcp

    res: dict = {}
    want = [_full(i, rows, cols) for i in range(n)]
    dst = {
        name: {f"w{i}": torch.zeros(rows, cols) for i in range(n)}
        for name in ("sp full", "dcp full")
    }
    load = {
        "sp full": lambda like: sp.load(f"{base}/sp", like=like),
        "dcp full": lambda like: dcp.load(like, checkpoint_id=f"{base}/dcp", no_dist=True),
    }
    for timed in ([False] if drop else []) + [True] * repeat:
        for name, like in dst.items():
            for t_ in like.values():
                t_.zero_()
            if drop and timed:
                drop_caches()
            t = time.perf_counter()
            load[name](like)
            if timed:
                res.setdefault(name, []).append(time.perf_counter() - t)
            assert all(torch.equal(like[f"w{i}"], want[i]) for i in range(n)), name
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
        reshard = bench.bench_reshard(base, a.quick, repeat, drop)
        bench.tg.print_targets([], {}, reshard)
    finally:
        bt.rm(base)


if __name__ == "__main__":
    main()
