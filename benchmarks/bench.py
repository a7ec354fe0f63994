"""Checkpoint save/load benchmark: shardpoint against the disk's limits and its peers.

    python benchmarks/bench.py              # full: ~1.2 GB mixed + 1 GiB uniform state, 3 runs
    python benchmarks/bench.py --quick      # tiny sizes, one run (the test suite's smoke test)
    python benchmarks/bench.py --saves-only --ts-writes --repeat 5   # saves, before vs after
    python benchmarks/bench.py --json benchmarks/results/bench.json  # + the figures as data

In one run on one machine: the limits, raw write (one file + fsync; the best of 1-16
threads of ``pwrite``, with and without early writeback) and raw read (the best of 1-16
threads of ``preadv`` into preallocated buffers); the floor of shardpoint's layout (its own
files, same paths and sizes, written and read raw: what the file system costs before any
checksum, plan or metadata of ours); shardpoint sync save, async save (blocking
part and total), load and resharded load (1 process, and 2-4 gloo ranks); PyTorch DCP at its
best settings (``FileSystemWriter(thread_count=best of 1/2/4/8/16, sync_files=True)``, every
setting run in every round; ``dcp.async_save`` with the setting that won one timed trial) and
DCP load; ``torch.save``/``torch.load``; safetensors. A limit or a peer run at several
settings is the one with the lowest median, and the table says which won. Every save is
fsync'd; every tool first runs once untimed on a tiny state (imports, thread pools: costs a
process pays once, not per checkpoint); the page cache is dropped before every timed step (root only: the output says so
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
import bench_results as br  # noqa: E402
import bench_targets as tg  # noqa: E402
import bench_tools as bt  # noqa: E402
from shardpoint_testing.launch import run_world  # noqa: E402


class Results:
    def __init__(self) -> None:
        self.t: dict = {}  # row -> [seconds]
        self.mem: dict = {}  # row -> [bytes]
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
    if isinstance(out, tuple):  # async: (blocking, total)
        res.add(row + " (blocking)", out[0], m.extra)
        res.add(row + " (total)", out[1])
    else:
        res.add(row, dt, m.extra)


def tune_dcp_threads(state, base: str, drop: bool, candidates=(1, 2, 4, 8, 16)) -> int:
    """DCP's ``thread_count`` for its async save (one timed sync save each; the sync row
    itself is the best of every candidate, run by run)."""
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


# Each limit and each peer at its best: every setting runs in every round, and the one with
# the lowest median is the reference (the table prints which one won).
RAW_WRITES = [(1, False), (1, True), (4, True), (8, True), (16, True), (8, False)]
RAW_READS = [1, 4, 8, 16]
DCP_THREADS = [1, 2, 4, 8, 16]
# The floor of a file-per-chunk layout: shardpoint's own files written/read with no
# checksums, planning or metadata (not a reference for the ratios, which stay to raw).
FILES_WRITE = "floor: shardpoint's files, raw (16 threads, early writeback, syncfs)"
FILES_READS = [1, 8]
# Loads take ~1 s against ~2-3 s per save, and their cold times are the noisier on this disk:
# every round runs the load steps this many times, so their ratios rest on more rounds.
LOAD_PASSES = 2
# What an async save's blocking part must at least do: copy the state once.
COPY = "copy into reused buffers (the staging limit)"


def raw_write_row(t: int, early: bool) -> str:
    return f"raw write ({t} thread{'s' if t > 1 else ''}, 1 file + fsync" + (
        ", early writeback)" if early else ")"
    )


def raw_read_row(t: int) -> str:
    return f"raw read ({t} thread{'s' if t > 1 else ''} preadv)"


def files_read_row(t: int) -> str:
    return f"floor: shardpoint's files, raw read ({t} thread{'s' if t > 1 else ''} preadv)"


def dcp_row(t: int) -> str:
    return f"DCP save (thread_count={t}, sync_files)"


def best(res: "Results", rows: list) -> tuple:
    """(row, median) of the fastest of ``rows``."""
    meds = [(res.med(r), r) for r in rows if res.med(r) is not None]
    m, r = min(meds)
    return r, m


def bench_state(
    name: str,
    state: dict,
    base: str,
    repeat: int,
    drop: bool,
    ts_writes: bool = False,
    loads: bool = True,
    load_passes: int = LOAD_PASSES,
) -> tuple:
    res = Results()
    fl = bt.flat(state)
    k = tune_dcp_threads(fl, base, drop) if repeat > 1 or drop else 2
    bufs = [t.clone() for t in fl.values()]  # touched: reused buffers, no page faults
    like = bt.empty_like_tree(state)
    dlike = {k_: torch.empty_like(v) for k_, v in fl.items()}
    paths = {
        "raw": f"{base}/raw.bin",
        "sp": f"{base}/sp",
        "spts": f"{base}/spts",
        "spa": f"{base}/spa",
        "dcpa": f"{base}/dcpa",
        "torch": f"{base}/t.pt",
        "st": f"{base}/s.safetensors",
        "rawf": f"{base}/rawf",
        "copy": f"{base}/copy",
    }
    paths.update({f"dcp{t}": f"{base}/dcp{t}" for t in DCP_THREADS})
    saves = [
        (raw_write_row(t, e), lambda s, p, t=t, e=e: bt.raw_write(s, p, t, e), state, "raw")
        for t, e in RAW_WRITES
    ]
    saves += [("shardpoint save", bt.sp_save, state, "sp")]
    layout: list = []  # shardpoint's files, from its first save

    def files_write(st, p):
        layout[:] = layout or bt.file_layout(paths["sp"])
        return bt.raw_write_files(st, layout, p)

    saves += [(FILES_WRITE, files_write, state, "rawf")]
    if ts_writes:
        from shardpoint_core.transactions.backend import ZarrBackend

        be = ZarrBackend(direct_writes=False)
        saves += [
            (
                "shardpoint save, TensorStore writes (before)",
                lambda s, p: bt.sp_save(s, p, be),
                state,
                "spts",
            )
        ]
    saves += [(COPY, lambda s, p: bt.copy_state(bufs, s), fl, "copy")]
    saves += [("shardpoint async save", bt.sp_async_save if bt.HAS_ASYNC else None, state, "spa")]
    saves += [
        (dcp_row(t), lambda s, p, t=t: bt.dcp_save(s, p, t), fl, f"dcp{t}") for t in DCP_THREADS
    ]
    saves += [
        (f"DCP async_save (thread_count={k})", lambda s, p: bt.dcp_async_save(s, p, k), fl, "dcpa"),
        ("torch.save (+fsync)", bt.torch_save, fl, "torch"),
        ("safetensors save (+fsync)", bt.st_save, fl, "st"),
    ]
    load_steps = [
        (raw_read_row(t), lambda t=t: bt.raw_read(bufs, paths["raw"], t)) for t in RAW_READS
    ]
    load_steps += [
        (
            files_read_row(t),
            lambda t=t: bt.raw_read_files(
                bufs, layout or bt.file_layout(paths["sp"]), paths["sp"], t
            ),
        )
        for t in FILES_READS
    ]
    load_steps += [
        ("shardpoint load", lambda: bt.sp_load(like, paths["sp"])),
        ("DCP load", lambda: bt.dcp_load(dlike, paths[f"dcp{DCP_THREADS[-1]}"])),
        ("torch.load", lambda: bt.torch_load(paths["torch"])),
        ("safetensors load", lambda: bt.st_load(paths["st"])),
    ]
    for _ in range(repeat):
        for p in paths.values():
            bt.rm(p)
        for row, fn, st, key in saves:
            if fn is not None:
                bt.rm(paths[key])
                step(res, row, fn, drop, st, paths[key])
                res.files[row] = bt.count_files(paths[key])
        for _pass in range(load_passes if loads else 0):
            for row, fn in load_steps:
                step(res, row, fn, drop)
            assert all(torch.equal(a, b) for a, b in zip(bt.flat(like).values(), fl.values()))
    for p in paths.values():
        bt.rm(p)
    return res, k


def fmt_row(res: Results, row: str, ref: dict, mark: str = "") -> str:
    """One table line: median, min-max, ratios to ``ref['raw']`` and ``ref['dcp']``."""
    v = res.t.get(row)
    if not v:
        return f"| {row} | n/a | | | | | |"
    med = statistics.median(v)
    mem = res.mem.get(row)
    cells = [
        row + mark,
        f"{med:.3f}",
        f"{min(v):.3f}-{max(v):.3f}",
        f"{med / ref['raw']:.2f}x" if ref.get("raw") else "",
        f"{med / ref['dcp']:.2f}x" if ref.get("dcp") else "",
        f"{statistics.median(mem) / 2**20:.0f} MiB" if mem else "",
        str(res.files.get(row.replace(" (blocking)", "").replace(" (total)", ""), "")),
    ]
    return "| " + " | ".join(cells) + " |"


def state_run(name: str, res: Results, size: int) -> "tg.StateRun":
    """What the targets table needs of one state's results."""
    reads = [r for r in map(raw_read_row, RAW_READS) if res.med(r) is not None]
    return tg.StateRun(
        name,
        size,
        best(res, [raw_write_row(t, e) for t, e in RAW_WRITES])[0],
        best(res, reads)[0] if reads else None,
        best(res, list(map(dcp_row, DCP_THREADS)))[0],
        lambda row: res.t.get(row, []),
        lambda row: statistics.median(res.mem[row]) if res.mem.get(row) else None,
    )


TARGET_ROWS = {
    "save": "shardpoint save",
    "load": "shardpoint load",
    "DCP load": "DCP load",
    "async blocking": "shardpoint async save (blocking)",
    "async total": "shardpoint async save (total)",
    "copy": COPY,
    "floor write": FILES_WRITE,
    "floor reads": [files_read_row(t) for t in FILES_READS],
}


def print_state_table(title: str, res: Results, size: int, k: int) -> None:
    print(f"\n### {title}: {size / 1e9:.3f} GB\n")
    raw_rows = [raw_write_row(t, e) for t, e in RAW_WRITES]
    read_rows = [raw_read_row(t) for t in RAW_READS]
    dcp_rows = [dcp_row(t) for t in DCP_THREADS]
    raw_best, raw_w = best(res, raw_rows)
    dcp_best, dcp_s = best(res, dcp_rows)
    have_reads = any(res.med(r) is not None for r in read_rows)
    read_best, raw_r = best(res, read_rows) if have_reads else ("", None)
    print(
        f"references (lowest median of each family, marked *): write limit = {raw_best}; "
        f"DCP = {dcp_best}" + (f"; read limit = {read_best}" if have_reads else "")
    )
    print("\n| step | median s | min-max s | x raw | x DCP | peak extra mem | files / dirs |")
    print("|---|---|---|---|---|---|---|")
    dcp_ab = res.med(f"DCP async_save (thread_count={k}) (blocking)")
    dcp_l = res.med("DCP load")
    star = {raw_best: " *", dcp_best: " *", read_best: " *"}
    for row in raw_rows:
        print(fmt_row(res, row, {"raw": raw_w}, star.get(row, "")))
    save_rows = [FILES_WRITE, "shardpoint save", "shardpoint save, TensorStore writes (before)"]
    if bt.HAS_ASYNC:
        save_rows += ["shardpoint async save (blocking)", "shardpoint async save (total)"]
    copy = res.med(COPY)
    for row in save_rows:
        if row == save_rows[-2] and bt.HAS_ASYNC:
            print(fmt_row(res, COPY, {"raw": copy}, " †"))
        if row in res.t:
            blocking = "blocking" in row
            ref = {"raw": copy if blocking else raw_w, "dcp": dcp_ab if blocking else dcp_s}
            print(fmt_row(res, row, ref, " †" if blocking else ""))
    if not bt.HAS_ASYNC:
        print("| shardpoint async save | n/a (no async_save) | | | | | |")
    for row in dcp_rows:
        print(fmt_row(res, row, {"raw": raw_w, "dcp": dcp_s}, star.get(row, "")))
    print(fmt_row(res, f"DCP async_save (thread_count={k}) (blocking)", {"raw": copy}, " †"))
    for row in [
        f"DCP async_save (thread_count={k}) (total)",
        "torch.save (+fsync)",
        "safetensors save (+fsync)",
    ]:
        print(fmt_row(res, row, {"raw": raw_w}))
    if have_reads:
        for row in read_rows + [files_read_row(t) for t in FILES_READS]:
            print(fmt_row(res, row, {"raw": raw_r}, star.get(row, "")))
        for row in ["shardpoint load", "DCP load", "torch.load", "safetensors load"]:
            print(
                fmt_row(
                    res, row, {"raw": raw_r, "dcp": dcp_l if row == "shardpoint load" else None}
                )
            )
    print(
        "\n† x raw of these rows is to the copy of the state into reused buffers (what an "
        "async save's blocking part cannot do without), not to the write limit."
    )


def record_state(rec: "br.Record", name: str, title: str, res: Results, size: int, k: int) -> None:
    """The state's table as data: every row that ran, with the references and ratios that
    :func:`print_state_table` prints (ratios of medians, and per-round ratios beside them)."""
    raw_rows = [raw_write_row(t, e) for t, e in RAW_WRITES]
    read_rows = [raw_read_row(t) for t in RAW_READS]
    dcp_rows = [dcp_row(t) for t in DCP_THREADS]
    raw_best, dcp_best = best(res, raw_rows)[0], best(res, dcp_rows)[0]
    have_reads = any(res.med(r) is not None for r in read_rows)
    read_best = best(res, read_rows)[0] if have_reads else None
    t = rec.table(
        name,
        title,
        "s",
        size,
        note=f"references: write limit = {raw_best}; DCP = "
        f"{dcp_best}" + (f"; read limit = {read_best}" if read_best else ""),
    )
    t["references"] = {"raw write": raw_best, "DCP save": dcp_best, "raw read": read_best}
    dab = f"DCP async_save (thread_count={k}) (blocking)"
    loads = (
        read_rows
        + [files_read_row(x) for x in FILES_READS]
        + ["shardpoint load", "DCP load", "torch.load", "safetensors load"]
    )
    for row, v in res.t.items():
        blocking = "blocking" in row
        note = ""
        if row in loads:
            ref = {"x raw": read_best, "x DCP": "DCP load" if row == "shardpoint load" else None}
        elif blocking or row == COPY:
            ref = {"x raw": COPY, "x DCP": dab if row.startswith("shardpoint") else None}
            note = (
                "x raw of this row is to the copy of the state into reused buffers (what "
                "an async save's blocking part cannot do without), not to the write limit"
            )
        else:
            ref = {
                "x raw": raw_best,
                "x DCP": dcp_best if row.startswith(("shardpoint", "DCP save")) else None,
            }
        ratios = {n: br.ratio(v, res.t.get(r, [])) for n, r in ref.items() if r}
        mem = res.mem.get(row)
        br.Record.row(
            t,
            row,
            v,
            ratios,
            note,
            reference=row in (raw_best, dcp_best, read_best),
            peak_extra_bytes=statistics.median(mem) if mem else None,
            files=res.files.get(row.replace(" (blocking)", "").replace(" (total)", "")) or None,
        )


def bench_reshard(base: str, quick: bool, repeat: int, drop: bool, rec: "br.Record" = None) -> dict:
    """Prints the resharded-load table; returns, for the targets table, per world the seconds
    per round of shardpoint as ``auto`` picks ("cols"), its same-layout load ("same") and
    DCP ("dcp"), "paired" when the same-layout load ran in the same rounds."""
    n, rows, cols = (4, 64, 32) if quick else (16, 8192, 1024)
    save_world, load_worlds = (2, (2,)) if quick else (4, (4, 3, 2))
    base = f"{base}/reshard"
    first = run_world(
        save_world, rs.save_and_load_job, base, n, rows, cols, repeat, drop, timeout=900
    )[0]
    size = n * rows * cols * 4
    print(
        f"\n### Resharded load: {n} tensors {rows}x{cols} fp32 ({size / 2**20:.0f} MiB) "
        f"saved by {save_world} ranks by rows\n"
    )
    print("| load | median s | min-max s | x same-layout | x DCP |")
    print("|---|---|---|---|---|")
    one = rs.single_process(base, n, rows, cols, repeat, drop)
    tab = (
        rec.table(
            "reshard",
            f"Resharded load: {n} tensors {rows}x{cols} fp32 saved by {save_world} ranks by rows",
            "s",
            size,
        )
        if rec
        else None
    )

    def line(label, v, same=None, dcp=None, same_v=None, dcp_v=None):
        med = statistics.median(v)
        if tab is not None:  # the same-layout load ran in these rounds only at save_world
            paired = label.startswith(f"{save_world} ranks")
            br.Record.row(
                tab,
                label,
                v,
                {
                    "x same-layout": br.ratio(v, same_v, paired=paired) if same else None,
                    "x DCP": br.ratio(v, dcp_v) if dcp else None,
                },
            )
        print(
            f"| {label} | {med:.3f} | {min(v):.3f}-{max(v):.3f} | "
            f"{f'{med / same:.2f}x' if same else ''} | {f'{med / dcp:.2f}x' if dcp else ''} |"
        )

    d1 = statistics.median(one["dcp full"])
    line("1 process, whole tensors: shardpoint", one["sp full"], dcp=d1, dcp_v=one["dcp full"])
    line("1 process, whole tensors: DCP", one["dcp full"])
    same_ref, same_runs = None, []
    out: dict = {}
    for w in load_worlds:
        r = (
            first
            if w == save_world
            else run_world(w, rs.load_job, base, n, rows, cols, repeat, drop, False, timeout=900)[0]
        )
        line(
            f"{w} ranks: the checkpoint's files read raw, a share per rank "
            f"({rs.RAW_THREADS} threads preadv each)",
            r["raw files"],
        )
        if "sp rows" in r:
            same_ref, same_runs = statistics.median(r["sp rows"]), r["sp rows"]
            line(
                f"{w} ranks, rows (same layout): shardpoint",
                r["sp rows"],
                dcp=statistics.median(r["dcp rows"]),
                dcp_v=r["dcp rows"],
            )
            line(f"{w} ranks, rows (same layout): DCP", r["dcp rows"])
        dc = statistics.median(r["dcp cols"])
        chose = "/".join(sorted(set(r.get("auto chose", []))))
        line(
            f"{w} ranks, by columns: shardpoint (auto: {chose})",
            r["sp cols"],
            same_ref,
            dc,
            same_runs,
            r["dcp cols"],
        )
        line(
            f"{w} ranks, by columns: shardpoint (dedup + exchange)",
            r["sp cols dedup"],
            same_ref,
            dc,
            same_runs,
            r["dcp cols"],
        )
        line(f"{w} ranks, by columns: DCP", r["dcp cols"], same_ref, same_v=same_runs)
        out[w] = {
            "cols": r["sp cols"],
            "same": same_runs,
            "dcp": r["dcp cols"],
            "raw": r["raw files"],
            "paired": "sp rows" in r,
        }
        x = r["exchange GB/s per rank"]
        print(
            f"| {w} ranks: exchange rate (dedup), GB/s per rank | {statistics.median(x):.2f}"
            f" | {min(x):.2f}-{max(x):.2f} | | |"
        )
        if rec:
            xt = rec.table(
                f"reshard exchange {w}", f"{w} ranks: exchange rate (dedup) per rank", "GB/s"
            )
            br.Record.row(xt, f"{w} ranks: exchange rate (dedup), GB/s per rank", x)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one run (smoke test)")
    ap.add_argument("--repeat", type=int, default=None, help="runs per step (default 3)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--no-reshard", action="store_true", help="skip the multi-process part")
    ap.add_argument("--saves-only", action="store_true", help="time saves only (no loads)")
    ap.add_argument("--states", default="mixed,uniform", help="which states (mixed,uniform)")
    ap.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write every row's measurements, medians, min-max and ratios, "
        "with the run's parameters and machine, to PATH (for the docs)",
    )
    ap.add_argument(
        "--ts-writes",
        action="store_true",
        help="also time shardpoint's save through TensorStore's own writer (the "
        "write path before direct chunk writes), interleaved with the rest",
    )
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    repeat = a.repeat or (1 if a.quick else 3)
    passes = 1 if a.quick else LOAD_PASSES  # a smoke test: every load step once
    base = tempfile.mkdtemp(prefix="sp-bench-", dir=a.dir)
    drop = not a.quick and bt.drop_caches()
    rec = (
        br.Record(
            "bench.py",
            "shardpoint (PyTorch) against the disk's limits and DCP, on files",
            argv,
            {
                "quick": a.quick,
                "repeat": repeat,
                "load_passes": passes,
                "cold_cache": bool(drop),
                "states": a.states,
                "reshard": not (a.no_reshard or a.saves_only),
                "saves_only": a.saves_only,
                "ts_writes": a.ts_writes,
            },
            {"torch": torch.__version__},
        )
        if a.json
        else None
    )
    print(
        f"## shardpoint benchmark ({'quick' if a.quick else 'full'}, median of {repeat}; "
        f"single-process loads: of {repeat * passes})\n"
    )
    print(
        f"machine: {platform.node()}, {os.cpu_count()} CPUs, {platform.machine()}, "
        f"torch {torch.__version__}; dir {base}"
    )
    if drop:
        print("page cache: dropped before every timed step")
    else:
        why = "--quick" if a.quick else "writing /proc/sys/vm/drop_caches needs root"
        print(f"page cache: NOT dropped ({why}): loads below are WARM-cache numbers")
    try:
        states = [
            (
                "mixed (transformer-like, fp32 + bf16)",
                bt.mixed_state(1 / 32, layers=2) if a.quick else bt.mixed_state(1.0),
            ),
            (
                "uniform (fp32)",
                bt.uniform_state(4, 1 / 16) if a.quick else bt.uniform_state(32, 32),
            ),
        ]
        wanted = a.states.split(",")
        if not a.quick:  # one untimed round of every tool on a tiny state: imports, thread
            bench_state("warm-up", bt.mixed_state(1 / 32), base, 1, False)  # pools, caches
        runs, reshard = [], {}
        for title, state in states:
            if title.split(" ")[0] not in wanted:
                continue
            n = len(bt.flat(state))
            res, k = bench_state(
                title, state, base, repeat, drop, a.ts_writes, not a.saves_only, passes
            )
            print_state_table(f"{title}, {n} tensors", res, bt.nbytes(state), k)
            if rec:
                record_state(
                    rec,
                    title.split(" ")[0],
                    f"{title}, {n} tensors: {bt.nbytes(state) / 1e9:.3f} GB",
                    res,
                    bt.nbytes(state),
                    k,
                )
            runs.append(state_run(title.split(" ")[0], res, bt.nbytes(state)))
            del state
        if not (a.no_reshard or a.saves_only):
            reshard = bench_reshard(base, a.quick, repeat, drop, rec)
        tg.print_targets(
            runs,
            TARGET_ROWS,
            reshard,
            "--quick: tiny states, warm cache, one run: these verdicts mean nothing"
            if a.quick
            else "",
        )
        if rec:
            rec.data["targets"] = {
                "columns": [r.name for r in runs],
                "rows": [
                    {"label": t, "cells": c}
                    for t, c in (tg.state_rows(runs, TARGET_ROWS) if runs else [])
                ],
            }
            rec.write(a.json)
    finally:
        bt.rm(base)


if __name__ == "__main__":
    main()
