"""Restore after a host loss: from peer memory (the memory tier) against from storage (files).

    python benchmarks/bench_memory_tier.py                 # ~1 GiB, 4 ranks on 2 hosts, 3 rounds
    python benchmarks/bench_memory_tier.py --quick         # tiny, one round (a smoke run)
    python benchmarks/bench_memory_tier.py --json out.json # + the figures as data

One machine, hosts simulated: ``--ranks`` gloo ranks, split evenly over ``--hosts`` host
names, each host with its own shared-memory directory below ``--shm-dir`` (a tmpfs) and the
side channel on the loopback. The state (``--gib`` in all, rows of ``--tensors`` float32
tensors split over the ranks) is saved once to the memory tier (k=1) and once to files below
``--dir`` (fsync'd), each save timed. Then the last host is lost (its shared memory deleted)
and, each round, a restarted job with a replacement host (empty memory) restores the state:
``MemoryTier.restore`` (start of the tier included: what a restart pays) and ``sp.load`` of
the durable copy with the page cache dropped first (root only: the output says when it
could not), interleaved, every restore checked bit for bit after its timed part. The
replacement host's memory is emptied before every round, so each round restores what a
fresh replacement would. The table gives medians (min-max) of the slowest rank, the ratio,
and the bytes the side channel carried.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import bench_results as br  # noqa: E402
from bench_tools import drop_caches  # noqa: E402
from shardpoint_testing.launch import run_world  # noqa: E402

JOB = "bench"


def _block(i: int, rank: int, world: int, rows: int, cols: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * i + rank)
    return torch.randn(rows // world, cols, generator=g)


def _state(rank: int, world: int, n: int, rows: int, cols: int, zeros: bool = False) -> dict:
    import shardpoint as sp

    per = rows // world
    out = {}
    for i in range(n):
        b = torch.zeros(per, cols) if zeros else _block(i, rank, world, rows, cols)
        out[f"w{i}"] = sp.ShardedTensor(b, (rows, cols), (rank * per, 0))
    out["step"] = 0 if zeros else 7
    return out


def _tier(rank: int, hosts: list, shm: str):
    import shardpoint as sp

    h = hosts[rank]
    return sp.MemoryTier(
        JOB, k=1, host_id=h, shm_dir=os.path.join(shm, h), advertise="127.0.0.1", timeout_s=300
    )


def _timed(fn, rank: int, drop: bool = False):
    dist.barrier()
    if drop and rank == 0:
        drop_caches()
    dist.barrier()
    t = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t
    dist.barrier()
    return out, dt


def save_job(rank, world, hosts, shm, durable, n, rows, cols):
    import shardpoint as sp

    state = _state(rank, world, n, rows, cols)
    tier = _tier(rank, hosts, shm)
    _res, t_mem = _timed(lambda: tier.save(state, 7), rank)
    _res, t_dur = _timed(lambda: sp.save(state, durable), rank)
    sent = tier.store.counters["replica_bytes_sent"]
    tier.close()
    return {"memory": t_mem, "storage": t_dur, "replica_bytes": sent}


def restore_job(rank, world, hosts, shm, durable, n, rows, cols):
    import shardpoint as sp

    def check(tree):
        for i in range(n):
            assert torch.equal(tree[f"w{i}"], _block(i, rank, world, rows, cols)), i
        assert tree["step"] == 7

    like = _state(rank, world, n, rows, cols, zeros=True)
    got = {}

    import shardpoint.api.memory_tier  # noqa: F401  (imported before: not a restore's time)

    def from_memory():
        t = time.perf_counter()
        tier = _tier(rank, hosts, shm)
        started = time.perf_counter() - t
        r = tier.restore(like)
        r.timings["start"] = started
        return tier, r

    (tier, r), got["memory"] = _timed(from_memory, rank)
    assert set(r.sources.values()) == {"memory"}, r.sources
    check(r.tree)
    got["fetched_bytes"] = tier.store.counters["fetched_bytes"]
    got["phases"] = dict(r.timings)
    tier.close()
    like = _state(rank, world, n, rows, cols, zeros=True)
    tree, got["storage"] = _timed(lambda: sp.load(durable, like), rank, drop=True)
    check(tree)
    return got


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="durable checkpoints go here (files)")
    ap.add_argument("--shm-dir", default="/dev/shm/shardpoint-bench")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.quick:
        a.gib, a.repeat = 1 / 256, 1
    cols = 1024
    rows = max(a.ranks, int(a.gib * (1 << 30) / 4 / cols / a.tensors) // a.ranks * a.ranks)
    total = rows * cols * 4 * a.tensors
    per_host = a.ranks // a.hosts
    hosts = [f"h{r // per_host}" for r in range(a.ranks)]
    lost = hosts[-1]
    replacement = [h if h != lost else "spare" for h in hosts]
    work = a.dir or tempfile.mkdtemp(prefix="sp-bench-mem-")
    durable = os.path.join(work, "durable", "step_7")
    shm = os.path.join(a.shm_dir, f"run{os.getpid()}")
    cold = drop_caches()
    rec = br.Record(
        "bench_memory_tier.py",
        "Restore after a host loss: peer memory vs storage",
        argv,
        {
            "bytes": total,
            "ranks": a.ranks,
            "hosts": a.hosts,
            "k": 1,
            "tensors": a.tensors,
            "repeat": a.repeat,
            "quick": a.quick,
            "cold_cache": cold,
            "storage": "files (fsync'd)",
        },
    )
    try:
        s = run_world(
            a.ranks,
            save_job,
            hosts,
            shm,
            durable,
            a.tensors,
            rows,
            cols,
            timeout=1800,
            pg_timeout=600,
        )
        shutil.rmtree(os.path.join(shm, lost))  # the host is lost
        rounds = []
        for _ in range(a.repeat):
            shutil.rmtree(os.path.join(shm, "spare"), ignore_errors=True)  # a fresh spare
            rounds.append(
                run_world(
                    a.ranks,
                    restore_job,
                    replacement,
                    shm,
                    durable,
                    a.tensors,
                    rows,
                    cols,
                    timeout=1800,
                    pg_timeout=600,
                )
            )
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    mem = [max(r["memory"] for r in rr) for rr in rounds]
    sto = [max(r["storage"] for r in rr) for rr in rounds]
    fetched = sum(r["fetched_bytes"] for r in rounds[-1])
    phases = {
        k: max(r["phases"].get(k, 0.0) for r in rounds[-1])
        for k in ("start", "decide", "gather", "load")
    }
    gib = total / (1 << 30)
    print(
        f"state {gib:.3f} GiB, {a.ranks} ranks on {a.hosts} hosts, k=1; host {lost} lost, "
        f"restored by a job with a replacement host; page cache: "
        f"{'dropped' if cold else 'NOT dropped (not root)'} before each storage load"
    )
    t = rec.table("save", "Save once (slowest rank)", nbytes=total)
    rec.row(
        t,
        "memory tier (k=1, replicated)",
        [max(r["memory"] for r in s)],
        replica_bytes=sum(r["replica_bytes"] for r in s),
    )
    rec.row(t, "files (fsync'd)", [max(r["storage"] for r in s)])
    print(
        f"save: memory tier {max(r['memory'] for r in s):.3f} s (replicas sent "
        f"{sum(r['replica_bytes'] for r in s) / (1 << 20):.0f} MiB), files "
        f"{max(r['storage'] for r in s):.3f} s"
    )
    t = rec.table("restore", "Restore after the loss of one host (slowest rank)", nbytes=total)
    rec.row(
        t,
        "from peer memory (restart of the tier included)",
        mem,
        ratios={"faster than storage": br.ratio(mem, sto, invert=True)},
        fetched_bytes=fetched,
        phases=phases,
    )
    rec.row(t, "from storage (files)", sto)
    print(
        f"restore: peer memory {statistics.median(mem):.3f} s ({min(mem):.3f}-{max(mem):.3f}),"
        f" storage {statistics.median(sto):.3f} s ({min(sto):.3f}-{max(sto):.3f}); "
        f"{statistics.median(sto) / statistics.median(mem):.2f}x; the side channel carried "
        f"{fetched / (1 << 20):.0f} MiB to the replacement host; phases of the last round "
        f"(slowest rank): " + ", ".join(f"{k} {v:.3f} s" for k, v in phases.items())
    )
    if a.json:
        rec.write(a.json)
    return rec.data


if __name__ == "__main__":
    main()
