"""Conversion with one process against several: ``convert(SRC, DST, procs=N)``.

    python benchmarks/bench_convert.py                 # ~1.0 GB, procs 1 and 2, 3 runs
    python benchmarks/bench_convert.py --scale 0.3 --runs 1 --procs 1 2 4

The source is the transformer-like mixed state of ``bench_tools`` (fp32 embedding, bf16
head and layers, fp32 Adam moments), written by its own libraries as a Hugging Face directory
of safetensors shards (2 GB shards, as ``save_pretrained`` cuts them) and as a one-process DCP
checkpoint. Each timed step converts one source to a shardpoint checkpoint (fsync'd, committed)
with the page cache dropped first (root only: the output says when it cannot); runs are
interleaved (every source and process count in turn, run by run); the table gives medians
with min-max and each count's speedup over one process (time with 1 / time with N, run by
run: the median and the range). The time counted is
``convert``'s own, and for N > 1 includes starting the workers (the fork server imports
torch once per process; library mode starts it before the timed steps and says how long
that took). "peak RSS+" (library mode) is the peak resident-memory growth of the converting
process (N = 1) or of the largest worker (N > 1); it counts the pages of memory-mapped sources
(safetensors, ``torch.save``) that were read, which are page cache the kernel can reclaim.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import bench_tools as bt  # noqa: E402


def write_sources(root: str, scale: float) -> tuple:
    """The mixed state as an HF safetensors directory and as a DCP checkpoint."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    flat = bt.flat(bt.mixed_state(scale))
    hf = os.path.join(root, "hf")
    os.makedirs(hf)
    shards, cur, size = [], {}, 0
    for k, v in flat.items():
        n = v.numel() * v.element_size()
        if cur and size + n > 2_000_000_000:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = v
        size += n
    shards.append(cur)
    wm = {}
    for i, part in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, os.path.join(hf, fn), metadata={"format": "pt"})
        wm.update({k: fn for k in part})
    import json

    with open(os.path.join(hf, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": bt.nbytes(flat)}, "weight_map": wm}, f)
    dcp_dir = os.path.join(root, "dcp")
    dcp.save(flat, checkpoint_id=dcp_dir, no_dist=True)
    return {"safetensors": hf, "dcp": dcp_dir}, bt.nbytes(flat), len(flat)


def reset_peak_rss() -> int:
    """Reset this process's peak RSS to now (``clear_refs``); the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS:")


def peak_rss() -> int:
    return _status("VmHWM:")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(ln for ln in f if ln.startswith(field)).split()[1]) * 1024


def main(argv: list = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=0.91, help="source size (0.91: ~1.0 GB)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument(
        "--cli",
        action="store_true",
        help="time `python -m shardpoint convert` "
        "in a fresh process per step (interpreter, imports and, for N > 1, the "
        "fork server's start included) instead of the library call",
    )
    a = ap.parse_args(argv)
    from shardpoint.tools.convert import convert
    from shardpoint.tools.convert.base import limit_heap_growth

    limit_heap_growth()
    with tempfile.TemporaryDirectory(dir=a.dir) as root:
        srcs, total, n = write_sources(root, a.scale)
        warm = ""
        if not a.cli and max(a.procs) > 1:
            # Library mode measures conversion with a running fork server; its start (once
            # per process: importing torch and the readers) is timed here on its own.
            import shardpoint as sp

            sp.save({"t": torch.ones(4)}, os.path.join(root, "tiny"))
            t = time.perf_counter()
            convert(
                os.path.join(root, "tiny"),
                os.path.join(root, "tiny.safetensors"),
                procs=max(a.procs),
            )
            warm = f"; fork server start + a tiny conversion: {time.perf_counter() - t:.1f} s"
        dropped = bt.drop_caches()
        times: dict = {}
        peaks: dict = {}  # (source, procs) -> workers' peak RSS growth (library mode)
        for _ in range(a.runs):
            for fmt, src in srcs.items():
                for p in a.procs:
                    dst = os.path.join(root, f"out_{fmt}_{p}")
                    bt.rm(dst)
                    bt.drop_caches()
                    base_rss = reset_peak_rss()
                    t = time.perf_counter()
                    if a.cli:
                        subprocess.run(
                            [
                                sys.executable,
                                "-m",
                                "shardpoint",
                                "convert",
                                src,
                                dst,
                                "--procs",
                                str(p),
                                "--trust-pickle",
                            ],  # our own DCP
                            check=True,
                            stdout=subprocess.DEVNULL,
                        )
                    else:
                        rep = convert(src, dst, procs=p, trust_pickle=True)  # our own DCP
                        peaks.setdefault((fmt, p), []).extend(
                            rep.worker_peak_bytes if p > 1 else [peak_rss() - base_rss]
                        )
                    times.setdefault((fmt, p), []).append(time.perf_counter() - t)
                    bt.rm(dst)
        how = "CLI, fresh process per step" if a.cli else "library call, fork server running" + warm
        print(
            f"{how}; per-step seconds: "
            + ", ".join(
                f"{f}/{p}: " + " ".join(f"{x:.1f}" for x in ts) for (f, p), ts in times.items()
            )
        )
        print(
            f"convert to shardpoint: {total / 1e9:.2f} GB in {n} tensors, "
            f"{a.runs} interleaved runs, {os.cpu_count()} CPUs, load average "
            f"{os.getloadavg()[0]:.1f}, torch {torch.__version__}, page cache: "
            f"{'dropped before each step' if dropped else 'NOT dropped (not root)'}"
        )
        print(
            f"{'source':<12} {'procs':>5} {'median s':>9} {'min-max s':>13} {'GB/s':>6} "
            f"{'speedup (per-run range)':>24} {'peak RSS+':>10}"
        )
        for fmt in srcs:
            base = times.get((fmt, 1))
            for p in a.procs:
                ts = times[(fmt, p)]
                med = statistics.median(ts)
                rs = [b / t for b, t in zip(base or [], ts)]
                ratio = (
                    "" if not rs else f"{statistics.median(rs):.2f}x ({min(rs):.2f}-{max(rs):.2f})"
                )
                pk = peaks.get((fmt, p))
                mem = f"{max(pk) / 2**20:.0f} MiB" if pk else ""
                print(
                    f"{fmt:<12} {p:>5} {med:>9.2f} {min(ts):>6.2f}-{max(ts):<6.2f} "
                    f"{total / 1e9 / med:>6.2f} {ratio:>24} {mem:>10}"
                )


if __name__ == "__main__":
    main()
