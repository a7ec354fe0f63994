"""Restore after a host loss on the test cluster: from peer memory against from the storage
host (S3), over shaped links (``shardpoint_testing.cluster``: hosts are network namespaces).

    python benchmarks/bench_memory_tier_cluster.py                  # 2 hosts x 2 ranks, 0.25 GiB
    python benchmarks/bench_memory_tier_cluster.py --hosts 4 --gib 1 --link-mbit 1000
    python benchmarks/bench_memory_tier_cluster.py --quick --json out.json

The state (rows of ``--tensors`` float32 tensors split over the ranks) is saved to the
memory tier (k=1; each host's shared memory below a directory of its own, since the
namespaces share this machine's /dev/shm) and to ``s3://`` on the S3-compatible server that
runs on the cluster's storage host. Then the last host is lost: its processes are gone (the
save's run ended) and its memory is deleted; the same namespace comes back empty, as a
replacement host would. A restarted job restores, timed from the start of its processes'
work to the restored state (the memory tier's start included), once from peer memory and
once from storage, each checked bit for bit after its timed part; the bytes each host's link
and the storage host's link carried are counted at the switch. Needs root.

What the cluster models and what not: see ``shardpoint_testing/cluster.py``. The storage
server (moto) is one Python process on this machine's shared CPUs, so the storage row
measures that server as much as its link; the memory rows are bounded by the links and by
this machine's memory bandwidth (the hosts share it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_results as br  # noqa: E402

JOB = "clbench"
SHM = "/dev/shm/sp-cluster-bench"


def _block(i, rank, world, rows, cols):
    import torch

    g = torch.Generator().manual_seed(7919 * i + rank)
    return torch.randn(rows // world, cols, generator=g)


def _state(rank, world, n, rows, cols, zeros=False):
    import torch
    import shardpoint as sp

    per = rows // world
    return {
        **{
            f"w{i}": sp.ShardedTensor(
                torch.zeros(per, cols) if zeros else _block(i, rank, world, rows, cols),
                (rows, cols),
                (rank * per, 0),
            )
            for i in range(n)
        },
        "step": 0 if zeros else 9,
    }


def _tier():
    import shardpoint as sp
    from shardpoint.exchange.topology import host_identity

    return sp.MemoryTier(JOB, k=1, shm_dir=os.path.join(SHM, host_identity()), timeout_s=600)


def _check(tree, rank, world, n, rows, cols):
    import torch

    for i in range(n):
        assert torch.equal(tree[f"w{i}"], _block(i, rank, world, rows, cols)), i
    assert tree["step"] == 9


def save_job(rank, world, url, n, rows, cols):
    import shardpoint as sp

    state = _state(rank, world, n, rows, cols)
    tier = _tier()
    tier.save(state, 9)
    sp.save(state, url)
    tier.close()
    return True


def _imports():
    """What a job imports before it restores (not part of a restore's time)."""
    import shardpoint.api  # noqa: F401
    import shardpoint.api.memory_tier  # noqa: F401
    from shardpoint_core.stores import s3, shm  # noqa: F401


def memory_job(rank, world, n, rows, cols):
    import torch.distributed as dist

    _imports()
    like = _state(rank, world, n, rows, cols, zeros=True)
    dist.barrier()
    t = time.perf_counter()
    tier = _tier()
    started = time.perf_counter() - t
    r = tier.restore(like)
    dt = time.perf_counter() - t
    dist.barrier()
    _check(r.tree, rank, world, n, rows, cols)
    assert set(r.sources.values()) == {"memory"}, r.sources
    tier.close()
    return dt, dict(r.timings, start=started)


def storage_job(rank, world, url, n, rows, cols):
    import torch.distributed as dist
    import shardpoint as sp

    _imports()
    like = _state(rank, world, n, rows, cols, zeros=True)
    dist.barrier()
    t = time.perf_counter()
    tree = sp.load(url, like)
    dt = time.perf_counter() - t
    dist.barrier()
    _check(tree, rank, world, n, rows, cols)
    return dt


def main(argv=None) -> dict:
    from shardpoint_testing import cluster as cl

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--ranks-per-host", type=int, default=2)
    ap.add_argument("--gib", type=float, default=0.25)
    ap.add_argument("--tensors", type=int, default=4)
    ap.add_argument("--link-mbit", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    why = cl.unavailable_reason()
    if why:
        raise SystemExit(f"no test cluster here: {why}")
    if a.quick:
        a.gib, a.rounds = 1 / 64, 1
    world = a.hosts * a.ranks_per_host
    cols = 1024
    rows = max(world, int(a.gib * (1 << 30) / 4 / cols / a.tensors) // world * world)
    total = rows * cols * 4 * a.tensors
    rec = br.Record(
        "bench_memory_tier_cluster.py",
        "Restore after a host loss on the test cluster: peer memory vs storage host",
        argv,
        {
            "bytes": total,
            "hosts": a.hosts,
            "ranks_per_host": a.ranks_per_host,
            "k": 1,
            "link_mbit": a.link_mbit,
            "rounds": a.rounds,
            "quick": a.quick,
            "storage": "s3:// (moto) on the storage host",
        },
    )
    mem, sto, mem_links, sto_links, phases = [], [], [], [], []
    shutil.rmtree(SHM, ignore_errors=True)
    try:
        with cl.Cluster(a.hosts, a.ranks_per_host, cl.Link(mbit=a.link_mbit)) as c:
            s3 = c.s3_server()
            env = s3.env()
            url = f"s3://{s3.bucket}/durable/step_9"
            c.run(save_job, url, a.tensors, rows, cols, timeout=3600, pg_timeout=1200, env=env)
            lost = a.hosts - 1
            names = sorted(os.listdir(SHM))
            gone = [n for n in names if n.endswith(f"#node{lost}")]
            assert len(gone) == 1, names
            for _round in range(a.rounds):
                shutil.rmtree(os.path.join(SHM, gone[0]))  # the host is lost (again)
                before = [c.link_bytes(h) for h in range(-1, a.hosts)]
                got = c.run(
                    memory_job, a.tensors, rows, cols, timeout=3600, pg_timeout=1200, env=env
                )
                after = [c.link_bytes(h) for h in range(-1, a.hosts)]
                mem.append(max(g[0] for g in got))
                phases.append(
                    {
                        k: max(g[1].get(k, 0.0) for g in got)
                        for k in ("start", "decide", "gather", "load")
                    }
                )
                mem_links.append([y - x for x, y in zip(before, after)])
                before = after
                got = c.run(
                    storage_job, url, a.tensors, rows, cols, timeout=3600, pg_timeout=1200, env=env
                )
                after = [c.link_bytes(h) for h in range(-1, a.hosts)]
                sto.append(max(got))
                sto_links.append([y - x for x, y in zip(before, after)])
    finally:
        shutil.rmtree(SHM, ignore_errors=True)
    mib = 1 << 20

    def links(v):
        return {"storage_link_bytes": v[0], "host_link_bytes": v[1:]}

    print(
        f"state {total / (1 << 30):.3f} GiB, {a.hosts} hosts x {a.ranks_per_host} ranks, "
        f"links {a.link_mbit} Mbit/s, k=1; host {a.hosts - 1} lost and replaced empty"
    )
    t = rec.table("restore", "Restore after the loss of one host (slowest rank)", nbytes=total)
    rec.row(
        t,
        "from peer memory (tier start included)",
        mem,
        ratios={"faster than storage": br.ratio(mem, sto, invert=True)},
        phases=phases[-1],
        **links(mem_links[-1]),
    )
    rec.row(t, "from the storage host (s3://)", sto, **links(sto_links[-1]))
    print(
        f"restore: peer memory {statistics.median(mem):.2f} s ({min(mem):.2f}-{max(mem):.2f})"
        f", storage host {statistics.median(sto):.2f} s ({min(sto):.2f}-{max(sto):.2f}); "
        f"{statistics.median(sto) / statistics.median(mem):.2f}x; phases (last round) "
        + ", ".join(f"{k} {v:.2f} s" for k, v in phases[-1].items())
    )
    print(
        "bytes on the links (last round), MiB: memory: storage "
        f"{mem_links[-1][0] / mib:.0f}, hosts {[round(x / mib) for x in mem_links[-1][1:]]}; "
        f"storage: storage {sto_links[-1][0] / mib:.0f}, hosts "
        f"{[round(x / mib) for x in sto_links[-1][1:]]}"
    )
    if a.json:
        rec.write(a.json)
    return rec.data


if __name__ == "__main__":
    main()
