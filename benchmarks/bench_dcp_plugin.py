"""``dcp.save`` with shardpoint's ``ShardpointWriter`` against DCP's own ``FileSystemWriter``
(at 1 and 8 threads, the better median counting as DCP's best; both through DCP's planner with
plan caching on) and against ``sp.save`` itself,
on real gloo ranks, same run: interleaved rounds, the page cache written back and dropped by
rank 0 before every timed save (cold), each save to a fresh directory removed afterwards.
Prints the median and min-max per method and the median of per-round ratios of the writer
to ``sp.save`` (the writer must stay within 5% of it) and to DCP's best.

    python benchmarks/bench_dcp_plugin.py --world 2 --mib 512 --rounds 5
    python benchmarks/bench_dcp_plugin.py --phases     # where the writer's time goes

``--phases`` times each part of ``dcp.save`` with the writer instead (DCP's planning, the
writer's mapping of DCP's plan, its one all-reduce, the ``sp.save`` inside, DCP's finish),
from timers around the writer's hooks; warm cache, medians with min-max per rank.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _state(world: int, rank: int, mib: float, n: int) -> dict:
    """``n`` float32 DTensors (rows split over the ranks) of ``mib`` MiB in all, and a step."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    cols = 1024
    rows = max(world, int(mib * (1 << 20) / 4 / cols / n))
    rows -= rows % world
    out = {}
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        local = torch.randn(rows // world, cols, generator=g)
        out[f"layers.{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return {"model": out, "step": 100}


def _methods(state: dict, root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    import shardpoint as sp
    from shardpoint.dcp import ShardpointWriter

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    def planner() -> DefaultSavePlanner:  # DCP's best: local plans cached between saves
        return DefaultSavePlanner(enable_plan_caching=True)

    def fs(threads: int):
        return lambda p: dcp.save(
            state,
            planner=planner(),
            storage_writer=dcp.FileSystemWriter(
                p, thread_count=threads, single_file_per_rank=True, sync_files=True
            ),
        )

    def sp_save(p: str) -> None:
        tree = {
            "model": {
                k: sp.ShardedTensor(
                    v.to_local(), tuple(v.shape), (v.to_local().shape[0] * _rank(), 0)
                )
                for k, v in state["model"].items()
            },
            "step": state["step"],
        }
        sp.save(tree, p)

    return {
        "dcp FileSystemWriter t=1": fs(1),
        "dcp FileSystemWriter t=8": fs(8),
        "dcp ShardpointWriter": lambda p: dcp.save(
            state, planner=planner(), storage_writer=ShardpointWriter(p)
        ),
        "sp.save": sp_save,
    }


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _job(rank: int, world: int, root: str, mib: float, n: int, rounds: int) -> dict:
    import warnings

    warnings.simplefilter("ignore")
    import torch.distributed as dist
    from bench_tools import drop_caches

    state = _state(world, rank, mib, n)
    methods = _methods(state, root)
    times: dict = {k: [] for k in methods}
    cold = True
    for r in range(rounds + 1):  # round 0 warms imports and plan caches, untimed
        names = list(methods)
        names = names[r % len(names) :] + names[: r % len(names)]  # rotate the order
        for name in names:
            p = os.path.join(root, f"r{r}_{name.replace(' ', '_').replace('=', '')}")
            dist.barrier()
            if rank == 0:
                cold = drop_caches() and cold
            dist.barrier()
            t = time.perf_counter()
            methods[name](p)
            dist.barrier()
            dt = time.perf_counter() - t
            if r:
                times[name].append(dt)
            if rank == 0:
                shutil.rmtree(p, ignore_errors=True)
    return {"times": times, "cold": cold}


def _phases_job(rank: int, world: int, root: str, mib: float, n: int, rounds: int) -> dict:
    """Median (min, max) ms per part of ``dcp.save`` with the writer (see ``--phases``)."""
    import warnings

    warnings.simplefilter("ignore")
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    import shardpoint.integrations.dcp as mod

    state = _state(world, rank, mib, n)
    at: dict = {}

    class Timed(mod.ShardpointWriter):
        def set_up_storage_writer(self, *a, **k):
            at["setup"] = time.perf_counter()
            return super().set_up_storage_writer(*a, **k)

        def plan_tree(self, *a, **k):
            t = time.perf_counter()
            out = super().plan_tree(*a, **k)
            at["map"] = time.perf_counter() - t
            return out

        def write_data(self, *a, **k):
            at["write0"] = time.perf_counter()
            out = super().write_data(*a, **k)
            at["write1"] = time.perf_counter()
            return out

    real_save = mod.save

    def timed_save(*a, **k):
        t = time.perf_counter()
        out = real_save(*a, **k)
        at["save"] = time.perf_counter() - t
        return out

    mod.save = timed_save
    parts: dict = {
        k: []
        for k in (
            "DCP before the hooks",
            "DCP planning",
            "plan mapping (ours)",
            "agreement all-reduce (ours)",
            "sp.save inside",
            "DCP finish",
            "total",
        )
    }
    try:
        for r in range(rounds + 1):
            p = os.path.join(root, f"p{r}")
            dist.barrier()
            t0 = time.perf_counter()
            dcp.save(
                state, planner=DefaultSavePlanner(enable_plan_caching=True), storage_writer=Timed(p)
            )
            t1 = time.perf_counter()
            if r:
                w = at["write1"] - at["write0"]
                for k, v in (
                    ("DCP before the hooks", at["setup"] - t0),
                    ("DCP planning", at["write0"] - at["setup"]),
                    ("plan mapping (ours)", at["map"]),
                    ("agreement all-reduce (ours)", w - at["map"] - at["save"]),
                    ("sp.save inside", at["save"]),
                    ("DCP finish", t1 - at["write1"]),
                    ("total", t1 - t0),
                ):
                    parts[k].append(v * 1000)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(p, ignore_errors=True)
    finally:
        mod.save = real_save
    return {k: (statistics.median(v), min(v), max(v)) for k, v in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mib", type=float, default=256, help="total state size")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument(
        "--phases", action="store_true", help="time the parts of dcp.save with the writer instead"
    )
    a = ap.parse_args()
    from shardpoint_testing.launch import run_world

    root = tempfile.mkdtemp(prefix="bench_dcp_plugin_", dir=a.dir)
    if a.phases:
        try:
            per_rank = run_world(
                a.world,
                _phases_job,
                root,
                a.mib,
                a.tensors,
                a.rounds,
                timeout=3600,
                pg_timeout=1800,
            )
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(
            f"dcp.save with ShardpointWriter, {a.mib:.0f} MiB over {a.world} ranks, "
            f"{a.rounds} rounds (warm cache), ms median (min-max):"
        )
        for k in per_rank[0]:
            print(
                f"  {k:28s} "
                + "  ".join(
                    f"rank {r}: {v[k][0]:8.1f} ({v[k][1]:.1f}-{v[k][2]:.1f})"
                    for r, v in enumerate(per_rank)
                )
            )
        return
    try:
        res = run_world(
            a.world, _job, root, a.mib, a.tensors, a.rounds, timeout=3600, pg_timeout=1800
        )[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    times = res["times"]
    print(
        f"dcp.save of {a.mib:.0f} MiB ({a.tensors} DTensors, rows over {a.world} gloo "
        f"ranks), {a.rounds} interleaved rounds, page cache "
        f"{'dropped before each save' if res['cold'] else 'NOT dropped (not root)'}:"
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(
            f"  {k:28s} median {med[k]:6.3f} s  (min {min(v):6.3f}, max {max(v):6.3f})  "
            f"{a.mib / med[k]:7.0f} MiB/s"
        )
    best = min(("dcp FileSystemWriter t=1", "dcp FileSystemWriter t=8"), key=med.get)
    w = times["dcp ShardpointWriter"]
    per_sp = [a / b for a, b in zip(w, times["sp.save"])]
    per_fs = [a / b for a, b in zip(w, times[best])]
    print(
        f"  ShardpointWriter / sp.save: median of per-round ratios "
        f"{statistics.median(per_sp):.3f} (min {min(per_sp):.3f}, max {max(per_sp):.3f}; "
        f"limit 1.05)"
    )
    print(
        f"  ShardpointWriter / {best} (DCP's best): {statistics.median(per_fs):.3f} "
        f"(min {min(per_fs):.3f}, max {max(per_fs):.3f})"
    )


if __name__ == "__main__":
    main()
