"""shardpoint_jax against Orbax on the same JAX trees, one process, in one run.

    python benchmarks/bench_jax.py                # ~1.2 GB mixed + 1 GiB uniform, 5 rounds
    python benchmarks/bench_jax.py --quick        # tiny trees, one round (a smoke test)
    python benchmarks/bench_jax.py --loads 20     # only shardpoint_jax loads: wall and CPU
    python benchmarks/bench_jax.py --json benchmarks/results/bench_jax.json   # + as data

Each round runs, interleaved and in turn: the raw write of the same bytes (one file, one
fsync: one thread of writes, and 8 threads of ``pwrite`` with early writeback) and their raw
read (1 and 4 threads of ``preadv`` into preallocated buffers), each limit counting at its
better median; ``shardpoint_jax.save`` / ``load``; Orbax's ``StandardCheckpointer`` save (waited
for with ``wait_until_finished``) and ``restore``, with OCDBT (its default) and without, the
better median counting; then both asynchronous saves, the time the call blocks and the time
until the checkpoint is in (the first round includes each pool's first allocation). The page cache is dropped before every timed step (root only: the
output says when it cannot). Every save is followed by ``os.sync()`` inside its timing:
shardpoint_jax syncs what it wrote, Orbax's TensorStore writes sync its data files but not
all its metadata, and a checkpoint counts once it is on disk. Orbax compresses its chunks
(zstd level 1 by default: the mixed tree takes 1.07 GB on disk against 1.20 GB raw);
shardpoint's format stores the bytes as they are. Loads build new jax.Arrays
from an abstract tree (``jax.ShapeDtypeStruct`` with a sharding), the same for both. The
table gives medians with min-max and per-round ratios (the disk here moves up to 2x between
runs; only ratios from one run count).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import bench_results as br  # noqa: E402
import bench_tools as bt  # noqa: E402


def jax_tree(state: dict) -> dict:
    """The torch benchmark state as jax.Arrays (bf16 through ml_dtypes, bit for bit)."""
    import jax.numpy as jnp
    import ml_dtypes

    def one(t: torch.Tensor):
        if t.dtype == torch.bfloat16:
            return jnp.asarray(t.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
        return jnp.asarray(t.numpy())

    return {k: jax_tree(v) if isinstance(v, dict) else one(v) for k, v in state.items()}


def leaves(tree: dict) -> list:
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# The limits, each at several settings (the best median counts), as bench.py measures them.
RAW_SAVE = {"raw write (1 thread)": (1, False), "raw write (8 threads, early writeback)": (8, True)}
RAW_LOAD = {"raw read (1 thread)": 1, "raw read (4 threads)": 4}


class Tools:
    """The steps of one round, each a callable timed by the caller."""

    def __init__(self, tree: dict, base: str, drop: bool) -> None:
        import jax
        import orbax.checkpoint as ocp

        self.jax, self.ocp, self.tree, self.base, self.drop = jax, ocp, tree, base, drop
        self.abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree
        )
        self.arrays = leaves(tree)
        self.raw_state = {
            str(i): torch.from_numpy(a.reshape(-1).view(np.uint8))
            for i, a in enumerate(self.arrays)
        }
        self.bufs = [torch.empty(a.nbytes, dtype=torch.uint8) for a in self.arrays]
        self.orbax = {
            "orbax (ocdbt)": ocp.StandardCheckpointer(),
            "orbax (no ocdbt)": ocp.Checkpointer(ocp.StandardCheckpointHandler(use_ocdbt=False)),
        }
        self.orbax_async = {
            "orbax (ocdbt)": self.orbax["orbax (ocdbt)"],
            "orbax (no ocdbt)": ocp.AsyncCheckpointer(
                ocp.StandardCheckpointHandler(use_ocdbt=False)
            ),
        }

    def path(self, name: str) -> str:
        if name in RAW_SAVE or name in RAW_LOAD:
            name = "raw"
        return os.path.join(self.base, re.sub(r"[^a-z0-9_]+", "_", name))

    def async_save(self, name: str) -> tuple:
        """``(seconds the call blocked, seconds until committed and synced)``."""
        p = self.path(name)
        shutil.rmtree(p, ignore_errors=True)
        if self.drop:
            bt.drop_caches()
        t = time.perf_counter()
        if name == "shardpoint_jax":
            import shardpoint_jax as spj

            h = spj.save(p, self.tree, async_save=True)
            blocked = time.perf_counter() - t
            h.result()
        else:
            ck = self.orbax_async[name]
            ck.save(p, self.tree)
            blocked = time.perf_counter() - t
            ck.wait_until_finished()
        os.sync()
        return blocked, time.perf_counter() - t

    def save(self, name: str) -> None:
        p = self.path(name)
        shutil.rmtree(p, ignore_errors=True)
        if os.path.exists(p + ".bin"):
            os.unlink(p + ".bin")
        if self.drop:
            bt.drop_caches()
        t = time.perf_counter()
        if name in RAW_SAVE:
            threads, early = RAW_SAVE[name]
            bt.raw_write(self.raw_state, p + ".bin", threads=threads, early=early)
        elif name == "shardpoint_jax":
            import shardpoint_jax as spj

            spj.save(p, self.tree)
        else:
            ck = self.orbax[name]
            ck.save(p, self.tree)
            if hasattr(ck, "wait_until_finished"):
                ck.wait_until_finished()
        os.sync()
        return time.perf_counter() - t

    def load(self, name: str) -> float:
        p = self.path(name)
        if self.drop:
            bt.drop_caches()
        t = time.perf_counter()
        if name in RAW_LOAD:
            bt.raw_read(self.bufs, p + ".bin", threads=RAW_LOAD[name])
            out = None
        elif name == "shardpoint_jax":
            import shardpoint_jax as spj

            out = spj.load(p, self.abstract)
        else:
            out = self.orbax[name].restore(p, self.abstract)
        self.jax.block_until_ready(out)
        dt = time.perf_counter() - t
        if out is not None:  # checked after the timed part: bit for bit
            for a, b in zip(self.arrays, leaves(out)):
                if not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
                    raise SystemExit(f"{name}: a loaded leaf differs from the saved one")
        return dt


TOOLS = ("shardpoint_jax", "orbax (ocdbt)", "orbax (no ocdbt)")
ASYNC = ("shardpoint_jax", "orbax (ocdbt)", "orbax (no ocdbt)")  # Orbax saves asynchronously


def async_pool_mb() -> float:
    from shardpoint_jax import async_save

    return async_save.POOL.nbytes / 2**20


def run_state(
    title: str,
    tree: dict,
    base: str,
    rounds: int,
    drop: bool,
    show: bool = True,
    rec: Optional["br.Record"] = None,
) -> None:
    tools = Tools(tree, base, drop)
    t: dict = {}
    for _ in range(rounds):
        for name in (*RAW_SAVE, *TOOLS):
            t.setdefault(("save", name), []).append(tools.save(name))
        for name in ASYNC:
            blocked, total = tools.async_save(name)
            t.setdefault(("async blocking", name), []).append(blocked)
            t.setdefault(("async total", name), []).append(total)
        for name in (*RAW_LOAD, *TOOLS):
            t.setdefault(("load", name), []).append(tools.load(name))
    size = sum(a.nbytes for a in tools.arrays)
    if not show:
        return
    if rec is not None:
        record_state(rec, title, t, size, len(tools.arrays), rounds, tools)
    print(f"\n### {title}: {size / 1e9:.2f} GB in {len(tools.arrays)} arrays, {rounds} round(s)\n")
    print("| step | tool | median s | min-max | x raw (per round) | GB/s | files / dirs |")
    print("|---|---|---|---|---|---|---|")
    raw = {}
    for op, limits in (("save", RAW_SAVE), ("load", RAW_LOAD)):
        best_raw = min(limits, key=lambda n: statistics.median(t[(op, n)]))
        raw[op] = t[(op, best_raw)]
        orbax_best = min(
            ("orbax (ocdbt)", "orbax (no ocdbt)"), key=lambda n: statistics.median(t[(op, n)])
        )
        for name in (*limits, *TOOLS):
            v = t[(op, name)]
            ratio = statistics.median([a / b for a, b in zip(v, raw[op])])
            files = "" if name in limits else bt.count_files(tools.path(name))
            mark = " (best)" if name in (best_raw, orbax_best) else ""
            print(
                f"| {op} | {name}{mark} | {statistics.median(v):.3f} | {min(v):.3f}-"
                f"{max(v):.3f} | {ratio:.2f}x | {size / statistics.median(v) / 1e9:.2f} | "
                f"{files} |"
            )
        ours, best = t[(op, "shardpoint_jax")], t[(op, orbax_best)]
        r = statistics.median([b / a for a, b in zip(ours, best)])
        print(f"| {op} | **shardpoint_jax vs best Orbax** | | | {r:.2f}x faster (per round) | | |")
    for op in ("async blocking", "async total"):
        for name in ASYNC:
            v = t[(op, name)]
            print(
                f"| {op} | {name} | {statistics.median(v):.3f} | {min(v):.3f}-{max(v):.3f} "
                f"| {statistics.median([a / b for a, b in zip(v, raw['save'])]):.2f}x "
                f"| | |"
            )
        best = min(ASYNC[1:], key=lambda n: statistics.median(t[(op, n)]))
        ours, theirs = t[(op, "shardpoint_jax")], t[(op, best)]
        r = statistics.median([b / a for a, b in zip(ours, theirs)])
        print(
            f"| {op} | **shardpoint_jax vs best Orbax ({best[7:-1]})** | | | {r:.2f}x "
            "faster (per round) | | |"
        )
    print(f"\nshardpoint_jax's async save keeps a host pool of {async_pool_mb():.0f} MiB.")


def record_state(
    rec: "br.Record", title: str, t: dict, size: int, arrays: int, rounds: int, tools: "Tools"
) -> None:
    """The state's table as data: each step and tool with its per-round ratio to the raw
    limit (the better limit), and shardpoint_jax against the better Orbax, as printed."""
    name = title.split(" ")[0]
    tab = rec.table(
        name, f"{title}: {size / 1e9:.2f} GB in {arrays} arrays, {rounds} round(s)", "s", size
    )
    raw = {}
    for op, limits in (("save", RAW_SAVE), ("load", RAW_LOAD)):
        best_raw = min(limits, key=lambda n: statistics.median(t[(op, n)]))
        raw[op] = t[(op, best_raw)]
        orbax_best = min(
            ("orbax (ocdbt)", "orbax (no ocdbt)"), key=lambda n: statistics.median(t[(op, n)])
        )
        for n in (*limits, *TOOLS):
            v = t[(op, n)]
            ours = n == "shardpoint_jax"
            br.Record.row(
                tab,
                f"{op}: {n}",
                v,
                {
                    "x raw": br.ratio(v, raw[op]),
                    "x faster than best Orbax": br.ratio(v, t[(op, orbax_best)], invert=True)
                    if ours
                    else None,
                },
                step=op,
                tool=n,
                reference=n in (best_raw, orbax_best),
                files=None if n in limits else bt.count_files(tools.path(n)) or None,
            )
    for op in ("async blocking", "async total"):
        best = min(ASYNC[1:], key=lambda n: statistics.median(t[(op, n)]))
        for n in ASYNC:
            v = t[(op, n)]
            br.Record.row(
                tab,
                f"{op}: {n}",
                v,
                {
                    "x raw": br.ratio(v, raw["save"]),
                    "x faster than best Orbax": br.ratio(v, t[(op, best)], invert=True)
                    if n == "shardpoint_jax"
                    else None,
                },
                step=op,
                tool=n,
                reference=n == best,
            )


def time_loads(
    n: int, scale: float, where: Optional[str], s3_latency_ms: Optional[float] = None
) -> None:
    """Save the mixed tree at ``scale`` once with shardpoint_jax, then load it ``n`` times
    (warm page cache, the first load untimed) into new jax.Arrays; print the medians of wall
    and CPU time (``time.process_time``: every thread of this process) of one load. With
    ``s3_latency_ms``: on a local S3 server, each request delayed that long, with the
    requests and round trips in sequence of one load."""
    server = counter = None
    if s3_latency_ms is not None:
        from shardpoint_testing.s3 import S3Server

        server = S3Server().start()
        os.environ.update(server.env())
    import jax
    import shardpoint_jax as spj

    tree = jax_tree(bt.mixed_state(scale, layers=2) if scale < 1 / 16 else bt.mixed_state(scale))
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree
    )
    nbytes = sum(x.nbytes for x in jax.tree.leaves(tree))
    base = tempfile.mkdtemp(prefix="spjload-", dir=where)
    try:
        p = os.path.join(base, "ck")
        if server is not None:
            from bench_s3 import Counter, add_latency
            from shardpoint_core.stores.location import locate

            p = server.url("spjload/ck")
            client = locate(p).store.client
            counter = Counter(client)
            add_latency(client, s3_latency_ms / 1000)
        spj.save(p, tree)
        wall, cpu, reqs, depth = [], [], [], []
        for i in range(n + 1):
            if counter is not None:
                r0, s0 = counter.snap()[0], counter.snap()[3]
            t, c = time.perf_counter(), time.process_time()
            out = spj.load(p, abstract)
            jax.block_until_ready(out)
            if i:
                wall.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
                if counter is not None:
                    reqs.append(counter.snap()[0] - r0)
                    depth.append(counter.depth(s0, counter.snap()[3]))
            del out
        where_ = "files" if server is None else f"S3 +{s3_latency_ms:g} ms/request"
        print(
            f"{spj.__file__} | {where_} | {nbytes / 1e6:.1f} MB, "
            f"{len(jax.tree.leaves(tree))} arrays "
            f"| load wall {statistics.median(wall) * 1e3:.1f} ms "
            f"({min(wall) * 1e3:.1f}-{max(wall) * 1e3:.1f}) | CPU "
            f"{statistics.median(cpu) * 1e3:.1f} ms ({min(cpu) * 1e3:.1f}-"
            f"{max(cpu) * 1e3:.1f}) | {n} loads"
            + (f" | {max(reqs)} requests, {max(depth)} round trips in sequence" if reqs else "")
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if server is not None:
            server.stop()


def main(argv: Optional[list] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="tiny trees, one round, warm cache (a smoke test)"
    )
    ap.add_argument("--repeat", type=int, default=5, help="rounds (default 5)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument(
        "--loads",
        type=int,
        default=0,
        help="only time N shardpoint_jax loads of one saved mixed tree (wall and "
        "CPU time of this process; run it against two source trees in turn to "
        "compare them)",
    )
    ap.add_argument(
        "--scale",
        type=float,
        default=1 / 32,
        help="mixed tree scale for --loads (default 1/32, --quick's)",
    )
    ap.add_argument(
        "--s3-latency-ms",
        type=float,
        default=None,
        help="--loads from a local S3 server (moto, loopback) with this latency "
        "added to every request; also counts requests and round trips",
    )
    ap.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write every step's measurements, medians, min-max and ratios, "
        "with the run's parameters and machine, to PATH (for the docs)",
    )
    a = ap.parse_args(argv)
    if a.loads:
        return time_loads(a.loads, a.scale, a.dir, a.s3_latency_ms)
    warnings.filterwarnings("ignore")
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.ERROR)  # Orbax logs every save at WARNING
    import jax
    import orbax.checkpoint as ocp

    base = tempfile.mkdtemp(prefix="spjbench-", dir=a.dir)
    try:
        drop = not a.quick and bt.drop_caches()
        print(
            f"{platform.node()} | {os.cpu_count()} cores | jax {jax.__version__} | "
            f"orbax-checkpoint {getattr(ocp, '__version__', '?')} | page cache: "
            f"{'dropped before every timed step' if drop else 'NOT dropped'}"
            f"{' (--quick)' if a.quick else '' if drop else ' (not root): cold steps are warm'}"
        )
        rounds = 1 if a.quick else a.repeat
        rec = (
            br.Record(
                "bench_jax.py",
                "shardpoint_jax against Orbax's StandardCheckpointer, on files",
                argv,
                {"quick": a.quick, "rounds": rounds, "cold_cache": bool(drop)},
                {"jax": jax.__version__, "orbax-checkpoint": getattr(ocp, "__version__", "?")},
            )
            if a.json
            else None
        )
        if not a.quick:  # one untimed round of every tool (imports, pools), as bench.py
            run_state("warm-up", jax_tree(bt.mixed_state(1 / 64)), base, 1, False, show=False)
        run_state(
            "mixed (transformer-like, fp32 + bf16)",
            jax_tree(bt.mixed_state(1 / 32, layers=2) if a.quick else bt.mixed_state(1.0)),
            base,
            rounds,
            drop,
            rec=rec,
        )
        run_state(
            "uniform (fp32)",
            jax_tree(bt.uniform_state(8 if a.quick else 32, 1 if a.quick else 32)),
            base,
            rounds,
            drop,
            rec=rec,
        )
        if rec is not None:
            rec.data["config"]["async_pool_mib"] = round(async_pool_mb(), 1)
            rec.write(a.json)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
