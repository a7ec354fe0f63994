"""Checkpoint save/load benchmark: shardpoint against the disk's limits and its peers.

    python benchmarks/bench.py              # full: ~1.2 GB mixed + 1 GiB uniform state, 3 runs
    python benchmarks/bench.py --quick      # tiny sizes, one run (the test suite's smoke test)

In one run on one machine: raw write (one file + fsync) and raw read (4 threads of preadv
into preallocated buffers) as the limits; shardpoint sync save, async save (blocking part and
total), load and resharded load (1 process, and 2-4 gloo ranks); PyTorch DCP at its best
settings (``FileSystemWriter(thread_count=best of 1/2/4/8, sync_files=True)``, and
``dcp.async_save``) and DCP load; ``torch.save``/``torch.load``; safetensors. Every save is
fsync'd; the page cache is dropped before every timed step (root only: the output says so
when it cannot); tools are interleaved run by run; the table gives medians with min-max,
peak extra memory, files per checkpoint, and ratios to raw and to DCP from the same run.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import bench_reshard as rs  # noqa: E402
import bench_tools as bt  # noqa: E402
from shardpoint_conformance.launch import run_world  # noqa: E402


class Results:
    def __init__(self) -> None:
        self.t: dict = {}      # row -> [seconds]
        self.mem: dict = {}    # row -> [bytes]
        self.files: dict = {}  # row -> files per checkpoint

    def add(self, row: str, seconds: float, mem: int = None) -> None:
        self.t.setdefault(row, []).append(seconds)
        if mem is not None:
            self.mem.setdefault(row, []).append(mem)

    def med(self, row: str):
        v = self.t.get(row)
        return statistics.median(v) if v else None


def step(res: Results, row: str, fn, drop: bool, *args):
    if drop:
        bt.drop_caches()
    with bt.PeakRSS() as m:
        t = time.perf_counter()
        out = fn(*args)
        dt = time.perf_counter() - t
    if isinstance(out, tuple):       # async: (blocking, total)
        res.add(row + " (blocking)", out[0], m.extra)
        res.add(row + " (total)", out[1])
    else:
        res.add(row, dt, m.extra)


def tune_dcp_threads(state, base: str, drop: bool, candidates=(1, 2, 4, 8)) -> int:
    """DCP's best ``thread_count`` on this machine: one timed sync save each."""
    best, best_t = 1, float("inf")
    for k in candidates:
        p = f"{base}/dcp-tune{k}"
        if drop:
            bt.drop_caches()
        t = time.perf_counter()
        bt.dcp_save(state, p, k)
        dt = time.perf_counter() - t
        bt.rm(p)
        if dt < best_t:
            best, best_t = k, dt
    return best


def bench_state(name: str, state: dict, base: str, repeat: int, drop: bool) -> tuple:
    res = Results()
    fl = bt.flat(state)
    k = tune_dcp_threads(fl, base, drop) if repeat > 1 or drop else 2
    bufs = [torch.empty_like(t) for t in fl.values()]
    like = bt.empty_like_tree(state)
    dlike = {k_: torch.empty_like(v) for k_, v in fl.items()}
    paths = {"raw": f"{base}/raw.bin", "sp": f"{base}/sp", "spa": f"{base}/spa",
             "dcp": f"{base}/dcp", "dcpa": f"{base}/dcpa", "torch": f"{base}/t.pt",
             "st": f"{base}/s.safetensors"}
    saves = [("raw write (1 file + fsync)", bt.raw_write, state, "raw"),
             ("shardpoint save", bt.sp_save, state, "sp"),
             ("shardpoint async save", bt.sp_async_save if bt.HAS_ASYNC else None, state, "spa"),
             (f"DCP save (thread_count={k}, sync_files)", lambda s, p: bt.dcp_save(s, p, k),
              fl, "dcp"),
             (f"DCP async_save (thread_count={k})", lambda s, p: bt.dcp_async_save(s, p, k),
              fl, "dcpa"),
             ("torch.save (+fsync)", bt.torch_save, fl, "torch"),
             ("safetensors save (+fsync)", bt.st_save, fl, "st")]
    loads = [("raw read (4 threads preadv)", lambda: bt.raw_read(bufs, paths["raw"])),
             ("shardpoint load", lambda: bt.sp_load(like, paths["sp"])),
             ("DCP load", lambda: bt.dcp_load(dlike, paths["dcp"])),
             ("torch.load", lambda: bt.torch_load(paths["torch"])),
             ("safetensors load", lambda: bt.st_load(paths["st"]))]
    for _ in range(repeat):
        for p in paths.values():
            bt.rm(p)
        for row, fn, st, key in saves:
            if fn is not None:
                step(res, row, fn, drop, st, paths[key])
                res.files[row] = bt.count_files(paths[key])
        for row, fn in loads:
            step(res, row, fn, drop)
        assert all(torch.equal(a, b) for a, b in zip(bt.flat(like).values(), fl.values()))
    for p in paths.values():
        bt.rm(p)
    return res, k


def fmt_row(res: Results, row: str, ref: dict) -> str:
    """One table line: median, min-max, ratios to ``ref['raw']`` and ``ref['dcp']``."""
    v = res.t.get(row)
    if not v:
        return f"| {row} | n/a | | | | | |"
    med = statistics.median(v)
    mem = res.mem.get(row)
    cells = [row, f"{med:.3f}", f"{min(v):.3f}-{max(v):.3f}",
             f"{med / ref['raw']:.2f}x" if ref.get("raw") else "",
             f"{med / ref['dcp']:.2f}x" if ref.get("dcp") else "",
             f"{statistics.median(mem) / 2**20:.0f} MiB" if mem else "",
             str(res.files.get(row.replace(" (blocking)", "").replace(" (total)", ""), ""))]
    return "| " + " | ".join(cells) + " |"


def print_state_table(title: str, res: Results, size: int, k: int) -> None:
    print(f"\n### {title}: {size / 1e9:.3f} GB\n")
    print("| step | median s | min-max s | x raw | x DCP | peak extra mem | files |")
    print("|---|---|---|---|---|---|---|")
    raw_w, raw_r = res.med("raw write (1 file + fsync)"), res.med("raw read (4 threads preadv)")
    dcp_s = res.med(f"DCP save (thread_count={k}, sync_files)")
    dcp_ab = res.med(f"DCP async_save (thread_count={k}) (blocking)")
    dcp_l = res.med("DCP load")
    save_rows = ["raw write (1 file + fsync)", "shardpoint save"]
    if bt.HAS_ASYNC:
        save_rows += ["shardpoint async save (blocking)", "shardpoint async save (total)"]
    for row in save_rows:
        ref = {"raw": raw_w, "dcp": dcp_ab if "blocking" in row else dcp_s}
        print(fmt_row(res, row, ref))
    if not bt.HAS_ASYNC:
        print("| shardpoint async save | n/a (no async_save) | | | | | |")
    for row in [f"DCP save (thread_count={k}, sync_files)",
                f"DCP async_save (thread_count={k}) (blocking)",
                f"DCP async_save (thread_count={k}) (total)",
                "torch.save (+fsync)", "safetensors save (+fsync)"]:
        print(fmt_row(res, row, {"raw": raw_w}))
    for row in ["raw read (4 threads preadv)", "shardpoint load", "DCP load", "torch.load",
                "safetensors load"]:
        print(fmt_row(res, row, {"raw": raw_r, "dcp": dcp_l if row == "shardpoint load" else None}))


def bench_reshard(base: str, quick: bool, repeat: int, drop: bool) -> None:
    n, rows, cols = (4, 64, 32) if quick else (16, 8192, 1024)
    save_world, load_worlds = (2, (2,)) if quick else (4, (4, 3, 2))
    base = f"{base}/reshard"
    first = run_world(save_world, rs.save_and_load_job, base, n, rows, cols, repeat, drop,
                      timeout=900)[0]
    size = n * rows * cols * 4
    print(f"\n### Resharded load: {n} tensors {rows}x{cols} fp32 ({size / 2**20:.0f} MiB) "
          f"saved by {save_world} ranks by rows\n")
    print("| load | median s | min-max s | x same-layout | x DCP |")
    print("|---|---|---|---|---|")
    one = rs.single_process(base, n, rows, cols, repeat, drop)

    def line(label, v, same=None, dcp=None):
        med = statistics.median(v)
        print(f"| {label} | {med:.3f} | {min(v):.3f}-{max(v):.3f} | "
              f"{f'{med / same:.2f}x' if same else ''} | {f'{med / dcp:.2f}x' if dcp else ''} |")
    d1 = statistics.median(one["dcp full"])
    line("1 process, whole tensors: shardpoint", one["sp full"], dcp=d1)
    line("1 process, whole tensors: DCP", one["dcp full"])
    same_ref = None
    for w in load_worlds:
        r = first if w == save_world else run_world(
            w, rs.load_job, base, n, rows, cols, repeat, drop, False, timeout=900)[0]
        if "sp rows" in r:
            same_ref = statistics.median(r["sp rows"])
            line(f"{w} ranks, rows (same layout): shardpoint", r["sp rows"],
                 dcp=statistics.median(r["dcp rows"]))
            line(f"{w} ranks, rows (same layout): DCP", r["dcp rows"])
        dc = statistics.median(r["dcp cols"])
        line(f"{w} ranks, by columns: shardpoint (auto)", r["sp cols"], same_ref, dc)
        line(f"{w} ranks, by columns: shardpoint (dedup + exchange)", r["sp cols dedup"],
             same_ref, dc)
        line(f"{w} ranks, by columns: DCP", r["dcp cols"], same_ref)
        x = r["exchange GB/s per rank"]
        print(f"| {w} ranks: exchange rate (dedup), GB/s per rank | {statistics.median(x):.2f}"
              f" | {min(x):.2f}-{max(x):.2f} | | |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one run (smoke test)")
    ap.add_argument("--repeat", type=int, default=None, help="runs per step (default 3)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--no-reshard", action="store_true", help="skip the multi-process part")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    repeat = a.repeat or (1 if a.quick else 3)
    base = tempfile.mkdtemp(prefix="sp-bench-", dir=a.dir)
    drop = not a.quick and bt.drop_caches()
    print(f"## shardpoint benchmark ({'quick' if a.quick else 'full'}, median of {repeat})\n")
    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs, {platform.machine()}, "
          f"torch {torch.__version__}; dir {base}")
    if drop:
        print("page cache: dropped before every timed step")
    else:
        why = "--quick" if a.quick else "writing /proc/sys/vm/drop_caches needs root"
        print(f"page cache: NOT dropped ({why}): loads below are WARM-cache numbers")
    try:
        states = [("mixed (transformer-like, fp32 + bf16)",
                   bt.mixed_state(1 / 32 if a.quick else 1.0)),
                  ("uniform (fp32)", bt.uniform_state(4, 1 / 16) if a.quick
                   else bt.uniform_state(32, 32))]
        for title, state in states:
            n = len(bt.flat(state))
            res, k = bench_state(title, state, base, repeat, drop)
            print_state_table(f"{title}, {n} tensors", res, bt.nbytes(state), k)
            del state
        if not a.no_reshard:
            bench_reshard(base, a.quick, repeat, drop)
    finally:
        bt.rm(base)


if __name__ == "__main__":
    main()
