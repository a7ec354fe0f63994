"""What the replica check (``SaveOptions(check_replicas=True)``, [SP-REPL-1]) costs a save.

Saves the same state with and without the check, interleaved, cold-ish (a fresh directory
each time, the files synced as in any save), and prints the median save time of each with
min-max and the check's share. Two layouts: one process holding everything, and 2 gloo
ranks holding full replicas (data parallel: each rank checksums its whole replica but
writes half of it, the worst case for the check's share).

    python benchmarks/bench_replica_check.py [--mib 256] [--runs 5]
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

import shardpoint as sp


def state(mib: int) -> dict:
    n = mib * (1 << 20) // 4 // 16
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}": torch.randn(n, generator=g) for i in range(16)}


_COUNT = [0]
_PHASE: list = []  # the check's own time in each checked save (SaveResult.timings)


def one_save(st: dict, root: str, check: bool) -> float:
    import torch.distributed as dist

    _COUNT[0] += 1
    path = os.path.join(root, f"ck_{_COUNT[0]}")  # the same name on every rank
    t = time.perf_counter()
    res = sp.save(st, path, options=sp.SaveOptions(check_replicas=check, cache_plan=False))
    dt = time.perf_counter() - t
    _PHASE.append(res.timings.get("replica_check", 0.0)) if check else None
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(path)
    return dt


def _ranks(rank, world, root, mib, runs):
    st = state(mib)  # the same values on both ranks: full replicas
    _COUNT[0] = 1000
    out = {True: [], False: []}
    for i in range(runs):
        for check in (False, True) if i % 2 == 0 else (True, False):
            out[check].append(one_save(st, root, check))
    out["phase"] = list(_PHASE)
    return out


def report(name: str, times: dict) -> None:
    def fmt(v):
        return f"{statistics.median(v):.3f} s ({min(v):.3f}-{max(v):.3f})"

    off, on = statistics.median(times[False]), statistics.median(times[True])
    ph = statistics.median(times["phase"])
    print(
        f"{name}: save {fmt(times[False])}, with check {fmt(times[True])} "
        f"(difference of medians {100 * (on - off) / off:+.1f}%); the check itself "
        f"{fmt(times['phase'])} = {100 * ph / off:.1f}% of the median save"
    )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--dir", default=None)
    a = p.parse_args()
    root = tempfile.mkdtemp(prefix="bench-replica-", dir=a.dir)
    try:
        st = state(a.mib)
        times = {True: [], False: []}
        one_save(st, root, False)  # warm up imports and the plan code
        for i in range(a.runs):
            for check in (False, True) if i % 2 == 0 else (True, False):
                times[check].append(one_save(st, root, check))
        times["phase"] = list(_PHASE)
        report(f"1 process, {a.mib} MiB", times)
        from shardpoint_testing.launch import run_world

        got = run_world(2, _ranks, root, a.mib, a.runs, timeout=1200)
        report(f"2 ranks, full {a.mib} MiB replicas (rank 0's times)", got[0])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
