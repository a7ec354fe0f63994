"""Save and load across hosts of a test cluster (hosts as network namespaces, links shaped
with ``tc``; ``shardpoint_testing.cluster``): shardpoint against DCP on the same cluster, and
the load cost model's choice against each strategy forced, in the same rounds.

The state is the benchmark's mixed state (``bench_tools.mixed_state``) as DTensors over all
ranks (2-D tensors split by rows, ``Shard(0)``, 1-D ones replicated), the same for both tools.
Each round saves it with shardpoint and with DCP, then loads it in full on every rank (a
resume where each rank needs every byte: read dedup sends what one host read to the others
over the links, direct has each host read everything): shardpoint as the cost model picks,
dedup forced, direct forced, and DCP. Rounds interleave the tools; figures are medians with
min-max over rounds, times from a barrier before to a barrier after on rank 0.

What crosses the shaped links: the process group's traffic (plans, the dedup exchange, DCP's
collectives). Files go to a shared directory on this machine's disk, not over the links, and
all hosts share one page cache (a second host's reads of a file are memory copies): the
"sum of links" column is the limit for traffic between hosts, not for storage.

``--s3`` adds two rows: shardpoint's save and (cost model's) load on ``s3://`` against the
S3-compatible server (moto) running on the cluster's storage host, so every byte crosses the
rank's host link and the storage host's link (shaped alike): their limit is the storage
link, printed beside them. moto is one Python process answering every request on this
machine's shared CPUs, so these rows measure the server's CPU more than the links (real S3
spreads requests over many servers). DCP has no S3 writer of its own: no DCP row.
Needs root. Run:

    python benchmarks/bench_cluster.py                     # 2 and 4 hosts x 2 ranks, 1 Gbit/s
    python benchmarks/bench_cluster.py --hosts 2 --scale 0.0625 --rounds 2 --link-mbit 500
    python benchmarks/bench_cluster.py --hosts 2,4 --s3        # with the s3:// rows
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TOOLS = ("sp save", "dcp save", "sp load auto", "sp load dedup", "sp load direct", "dcp load")
S3_TOOLS = ("sp save s3", "sp load s3 auto", "sp load s3 dedup", "sp load s3 direct")


def _dtensors(state: dict, mesh, world: int, rank: int) -> dict:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = _dtensors(v, mesh, world, rank)
        elif v.dim() >= 2 and v.shape[0] >= world:
            parts = v.chunk(world, 0)
            out[k] = DTensor.from_local(
                parts[rank].clone(),
                mesh,
                [Shard(0)],
                run_check=False,
                shape=v.shape,
                stride=v.stride(),
            )
        else:
            out[k] = DTensor.from_local(v.clone(), mesh, [Replicate()], run_check=False)
    return out


def _zeros(state: dict) -> dict:
    import torch

    return {k: _zeros(v) if isinstance(v, dict) else torch.zeros_like(v) for k, v in state.items()}


def _job(rank, world, root, scale, rounds, link_gbps, s3_url=None, only_s3=False):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    import shardpoint as sp
    import bench_tools as bt

    mesh = init_device_mesh("cpu", (world,))
    full = bt.mixed_state(scale)
    state = _dtensors(full, mesh, world, rank)
    nbytes = bt.nbytes(full)
    tools = (() if only_s3 else TOOLS) + (S3_TOOLS if s3_url else ())
    times: dict = {t: [] for t in tools}
    choice = []
    ok = True

    def timed(name, fn):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        dist.barrier()
        times[name].append(time.perf_counter() - t0)
        return out

    def rm(p):
        dist.barrier()
        if rank == 0:
            shutil.rmtree(p, ignore_errors=True)
        dist.barrier()

    for i in range(rounds):
        sp_path, dcp_path = f"{root}/sp{i}", f"{root}/dcp{i}"
        if not only_s3:
            timed("sp save", lambda: sp.save(state, sp_path))
            timed("dcp save", lambda: dcp.save(state, checkpoint_id=dcp_path))
            for strat in ("auto", "dedup", "direct"):
                like = _zeros(full)
                rep = sp.LoadReport()
                opts = sp.LoadOptions(strategy=strat, link_gbps=link_gbps)
                timed(
                    f"sp load {strat}",
                    lambda: sp.load(sp_path, like=like, report=rep, options=opts),
                )
                if strat == "auto":
                    choice.append(rep.choice())
                ok &= all(
                    torch.equal(a, b)
                    for a, b in zip(bt.flat(like).values(), bt.flat(full).values())
                )
            like = _zeros(full)
            timed("dcp load", lambda: dcp.load(like, checkpoint_id=dcp_path))
            ok &= all(
                torch.equal(a, b) for a, b in zip(bt.flat(like).values(), bt.flat(full).values())
            )
            rm(sp_path)
            rm(dcp_path)
        if s3_url:  # a new prefix each round: the server keeps what it was given
            url = f"{s3_url}/round{i}"
            timed("sp save s3", lambda: sp.save(state, url))
            for strat in ("auto", "dedup", "direct"):
                like = _zeros(full)
                rep = sp.LoadReport()
                # the object store sits behind one link like the hosts': its total is that
                opts = sp.LoadOptions(
                    strategy=strat, link_gbps=link_gbps, storage_total_gbps=link_gbps
                )
                timed(
                    f"sp load s3 {strat}", lambda: sp.load(url, like=like, report=rep, options=opts)
                )
                if strat == "auto":
                    choice.append("s3: " + rep.choice())
                ok &= all(
                    torch.equal(a, b)
                    for a, b in zip(bt.flat(like).values(), bt.flat(full).values())
                )
    return {"times": times, "choice": choice, "ok": ok, "bytes": nbytes, "tools": tools}


def _fmt(xs: list) -> str:
    return f"{statistics.median(xs):6.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", default="2,4", help="host counts to run, e.g. 2,4")
    ap.add_argument("--ranks-per-host", type=int, default=2)
    ap.add_argument("--link-mbit", type=float, default=1000.0)
    ap.add_argument(
        "--scale", type=float, default=0.125, help="mixed state scale (1.0: ~1.2 GB; 0.125: ~20 MB)"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument(
        "--s3",
        action="store_true",
        help="add save/load rows on s3:// through the storage host's S3 server",
    )
    ap.add_argument("--only-s3", action="store_true", help="the s3:// rows alone")
    a = ap.parse_args()
    from shardpoint_testing.cluster import Cluster, Link, unavailable_reason

    why = unavailable_reason()
    if why:
        sys.exit(f"bench_cluster: {why}")
    link_gbps = a.link_mbit / 8000
    print(
        f"bench_cluster: mixed state x{a.scale}, {a.ranks_per_host} ranks per host, links "
        f"{a.link_mbit:g} Mbit/s each way (tc tbf), {a.rounds} interleaved rounds; medians "
        "(min-max), warm page cache (one cache for all hosts)"
    )
    for hosts in [int(h) for h in a.hosts.split(",")]:
        with Cluster(hosts, a.ranks_per_host, Link(mbit=a.link_mbit)) as c:
            s3 = c.s3_server() if a.s3 or a.only_s3 else None
            res = c.run(
                _job,
                c.shared_dir,
                a.scale,
                a.rounds,
                link_gbps,
                s3.url("bench") if s3 else None,
                a.only_s3,
                timeout=a.timeout,
                pg_timeout=600,
                env=s3.env() if s3 else None,
            )[0]
        mb = res["bytes"] / 1e6
        limit = hosts * a.link_mbit / 8
        print(
            f"\n{hosts} hosts x {a.ranks_per_host} ranks: {mb:.1f} MB state, sum of links "
            f"{limit:.0f} MB/s each way, round trips exact: {res['ok']}"
        )
        print(f"  {'':16} {'time':>22}  {'MB/s':>8}  {'x sum of links':>14}")
        for t in res["tools"]:
            xs = res["times"][t]
            rate = res["bytes"] / statistics.median(xs) / 1e6
            lim = a.link_mbit / 8 if t in S3_TOOLS else limit  # one storage link
            print(
                f"  {t:16} {_fmt(xs):>22}  {rate:8.1f}  {rate / lim:14.2f}"
                + ("  (x the storage link)" if t in S3_TOOLS else "")
            )
        print(f"  cost model: {sorted(set(res['choice']))}")


if __name__ == "__main__":
    main()
