"""Training steps while an async save drains: how much an async save slows the trainer.

    python benchmarks/bench_async_train.py                       # default modes, 3 rounds
    python benchmarks/bench_async_train.py --rounds 5 --json benchmarks/results/bench_async_train.json
    python benchmarks/bench_async_train.py --modes none,sp,sp-nice,dcp-thread --rounds 3

An 8-layer MLP (``--layers`` x ``--width``^2 fp32, Adam) trains on one torch thread; its state
(weights + both Adam moments, ~0.4 GB at the defaults) is saved asynchronously and the trainer
keeps stepping until the save has committed. Per mode and round: the blocking time of the save
call, the median step time while the save drains (every step that started before the save
finished), the drain (call return to commit) and the training time lost to the save (sum over
those steps of step - the round's no-save median). Modes run interleaved, rotated each round;
the table gives medians over rounds with min-max, and the CPU the save took in the
trainer's process beyond the training thread (``writer cpu``; a child process's is not
counted).

Each step also records where its wall time went (Linux ``/proc/thread-self/schedstat``): CPU
time of the training thread, time it sat runnable waiting for a core (``runq``), and the rest
(``other``: blocked, i.e. waiting for the GIL or memory/page faults). That is what tells
contention for the cores from contention for the GIL.

Modes: ``none`` (no save), ``sp`` (``sp.save(async_save=True)`` with the default options),
``sp-normal`` / ``sp-low`` / ``sp-idle`` (``SaveOptions(async_priority=...)``: the writer at
the trainer's priority, as before issue 31, at nice 19, at ``SCHED_IDLE``), any of them with
``-wtK`` (``write_threads=K``, 16 by default) and ``-pa`` (the per-array layout, a
``ZarrBackend``; without it the default packed one, a ``PackedBackend``), ``sp-child[-nice]`` (an
experiment: a child process at normal priority or nice 19 saves a copy of the state that the
trainer puts in shared memory, the ceiling of a writer process), ``dcp-thread`` /
``dcp-process`` (``torch.distributed.checkpoint.async_save`` with ``FileSystemWriter(
thread_count=--dcp-threads, sync_files=True)``, ``AsyncCheckpointerType.THREAD`` / ``PROCESS``;
the process one with ``DefaultStager(StagingOptions(use_pinned_memory=cuda,
use_shared_memory=True, use_async_staging=False))``, its documented zero-overhead staging).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import logging  # noqa: E402

import torch  # noqa: E402

import bench_results as br  # noqa: E402
import shardpoint as sp  # noqa: E402

DEFAULT_MODES = "none,sp-normal,sp-low,sp-idle,dcp-thread,dcp-process"


# ----------------------------------------------------------------------------- the trainer
class Trainer:
    def __init__(self, layers: int, width: int, batch: int) -> None:
        torch.manual_seed(0)
        mods = []
        for _ in range(layers):
            mods += [torch.nn.Linear(width, width, bias=False), torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*mods)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-5)
        self.x = torch.randn(batch, width)
        self.y = torch.randn(batch, width)
        self.step()  # Adam's moments exist from here on

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()

    def state(self) -> dict:
        """Live tensors (the save must copy them before the next step changes them)."""
        out = {}
        for i, p in enumerate(self.model.parameters()):
            st = self.opt.state[p]
            out[f"w{i}"] = p.data
            out[f"m{i}"] = st["exp_avg"]
            out[f"v{i}"] = st["exp_avg_sq"]
        return out


def schedstat() -> tuple:
    """(cpu ns, runqueue-wait ns) of the calling thread, or (0, 0) off Linux."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            a, b, _ = f.read().split()
        return int(a), int(b)
    except OSError:
        return 0, 0


def timed_step(tr: Trainer) -> dict:
    c0, r0 = schedstat()
    t = time.perf_counter()
    tr.step()
    wall = time.perf_counter() - t
    c1, r1 = schedstat()
    cpu, runq = (c1 - c0) / 1e9, (r1 - r0) / 1e9
    return {"wall": wall, "cpu": cpu, "runq": runq, "other": max(0.0, wall - cpu - runq)}


# ----------------------------------------------------------------------------- the savers
class SpSaver:
    """``sp-PRIORITY[-wtK][-pa]``: ``async_save=True`` with
    ``SaveOptions(async_priority=PRIORITY)`` through a fresh ``PackedBackend(write_threads=K)``
    (the default layout; 16 threads by default), or with ``-pa`` a per-array
    ``ZarrBackend(write_threads=K)``; ``sp``: the defaults."""

    def __init__(self, mode: str) -> None:
        from shardpoint.api.checkpointer import Checkpointer
        from shardpoint_core.transactions.backend import ZarrBackend
        from shardpoint_core.transactions.packed import PackedBackend

        parts = mode.split("-")
        threads = next((int(p[2:]) for p in parts if p.startswith("wt")), 16)
        prio = next((p for p in parts[1:] if not p.startswith("wt") and p != "pa"), None)
        opts = sp.SaveOptions() if prio is None else sp.SaveOptions(async_priority=prio)
        layout = ZarrBackend if "pa" in parts[1:] else PackedBackend
        self.cp = Checkpointer(backend=layout(write_threads=threads), save_options=opts)

    def start(self, state: dict, path: str):
        return self.cp.save(state, path, overwrite=True, async_save=True).wait

    def close(self) -> None:
        pass


def _child_main(conn, shared: dict, nice: bool) -> None:
    """The experiment's writer process: saves ``shared`` (the trainer's copy in shared memory)
    synchronously at each path it is sent."""
    if nice:
        os.setpriority(os.PRIO_PROCESS, 0, 19)
    torch.set_num_threads(1)
    while True:
        path = conn.recv()
        if path is None:
            return
        try:
            sp.save(shared, path, overwrite=True)
            conn.send("")
        except Exception as e:  # noqa: BLE001 - sent to the trainer
            conn.send(f"{type(e).__name__}: {e}")


class ChildSaver:
    """``sp-child[-nice]``: the trainer copies its state into shared memory and a child
    process writes it (an experiment: what a writer process could at best give)."""

    def __init__(self, mode: str) -> None:
        self.nice = mode.endswith("-nice")
        self.proc = self.conn = self.shared = None

    def start(self, state: dict, path: str):
        from shardpoint.tree.views import copy_into

        if self.proc is None:
            import torch.multiprocessing as mp

            ctx = mp.get_context("spawn")
            self.shared = {k: torch.empty_like(v).share_memory_() for k, v in state.items()}
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=_child_main, args=(child, self.shared, self.nice))
            self.proc.start()
        for k, v in state.items():
            copy_into(self.shared[k], v)
        self.conn.send(path)

        def wait() -> None:
            err = self.conn.recv()
            if err:
                raise RuntimeError(err)

        return wait

    def close(self) -> None:
        if self.proc is not None:
            self.conn.send(None)
            self.proc.join(30)


class DcpSaver:
    def __init__(self, mode: str, threads: int) -> None:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.kind = (
            AsyncCheckpointerType.PROCESS if mode == "dcp-process" else AsyncCheckpointerType.THREAD
        )
        self.threads = threads
        self.stager = None
        if mode == "dcp-process":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=torch.cuda.is_available(),
                    use_shared_memory=True,
                    use_async_staging=False,
                    use_non_blocking_copy=False,
                )
            )

    def start(self, state: dict, path: str):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        w = FileSystemWriter(path, thread_count=self.threads, sync_files=True)
        kw = {"async_checkpointer_type": self.kind}
        if self.stager is not None:
            kw["async_stager"] = self.stager
        out = dcp.async_save(state, storage_writer=w, **kw)
        fut = getattr(out, "upload_completion", out)
        return fut.result

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


# ----------------------------------------------------------------------------- one run
def run_mode(tr: Trainer, saver, path: str, base_steps: int, max_steps: int) -> dict:
    if saver is None:
        steps = [timed_step(tr) for _ in range(base_steps)]
        return {"steps": steps}
    shutil.rmtree(path, ignore_errors=True)
    proc0, mine0 = time.process_time(), schedstat()[0]
    t = time.perf_counter()
    wait = saver.start(tr.state(), path)
    blocking = time.perf_counter() - t
    done = threading.Event()
    end = [0.0]
    err: list = []

    def waiter() -> None:
        try:
            wait()
        except BaseException as e:  # noqa: BLE001 - reported below
            err.append(e)
        end[0] = time.perf_counter()
        done.set()

    threading.Thread(target=waiter, daemon=True).start()
    t1 = time.perf_counter()
    steps = []
    while not done.is_set() and len(steps) < max_steps:
        steps.append(timed_step(tr))
    done.wait()
    if err:
        raise err[0]
    # CPU the save took in this process beyond the trainer's thread (its writer threads; a
    # child process's is not counted): what it takes from the cores the trainer could use
    writer_cpu = time.process_time() - proc0 - (schedstat()[0] - mine0) / 1e9
    return {"blocking": blocking, "drain": end[0] - t1, "steps": steps, "writer_cpu": writer_cpu}


def med(v: list):
    return statistics.median(v) if v else None


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--base-steps", type=int, default=5, help="steps of the no-save mode")
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--modes", default=DEFAULT_MODES)
    ap.add_argument("--dcp-threads", type=int, default=8)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round (smoke test)")
    a = ap.parse_args(argv)
    if a.quick:
        a.rounds, a.layers, a.width, a.batch, a.base_steps = 1, 2, 256, 32, 2
    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.WARNING)
    torch.set_num_threads(1)
    modes = a.modes.split(",")
    if any(m.startswith("dcp") for m in modes):
        import torch.distributed as dist

        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
            dist.init_process_group("gloo", rank=0, world_size=1)
    tr = Trainer(a.layers, a.width, a.batch)
    nbytes = sum(t.numel() * t.element_size() for t in tr.state().values())
    root = tempfile.mkdtemp(prefix="sp_async_train_", dir=a.dir)
    savers = {}
    for m in modes:
        if m == "none":
            savers[m] = None
        elif m.startswith("dcp"):
            savers[m] = DcpSaver(m, a.dcp_threads)
        elif m.startswith("sp-child"):
            savers[m] = ChildSaver(m)
        else:
            savers[m] = SpSaver(m)
    print(
        f"# {a.layers}-layer MLP {a.width}x{a.width} fp32 + Adam, batch {a.batch}: state "
        f"{nbytes / 1e9:.3f} GB; torch threads 1; {os.cpu_count()} cores; "
        f"{platform.platform()}; torch {torch.__version__}",
        flush=True,
    )
    for m in modes:  # warm-up: imports, pools, the writer process, staging buffers
        if savers[m] is not None:
            run_mode(tr, savers[m], os.path.join(root, m), a.base_steps, a.max_steps)
    raw: dict = {m: [] for m in modes}
    # The floor of any save's blocking part: a copy of the state into staging buffers that
    # are already allocated and touched (issue 31: blocking at most 1.1x this).
    staging = {k: torch.empty_like(t) for k, t in tr.state().items()}
    memcpy: list = []
    try:
        for r in range(a.rounds):
            t = time.perf_counter()
            for k, v in tr.state().items():
                staging[k].copy_(v)
            memcpy.append(time.perf_counter() - t)
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            base = run_mode(tr, None, "", a.base_steps, a.max_steps)
            base_med = med([s["wall"] for s in base["steps"]])
            for m in order:
                out = (
                    base
                    if m == "none"
                    else run_mode(tr, savers[m], os.path.join(root, m), a.base_steps, a.max_steps)
                )
                walls = [s["wall"] for s in out["steps"]]
                rec = {
                    "load1": os.getloadavg()[0],
                    "step": med(walls),
                    "cpu": med([s["cpu"] for s in out["steps"]]),
                    "runq": med([s["runq"] for s in out["steps"]]),
                    "other": med([s["other"] for s in out["steps"]]),
                    "n_steps": len(walls),
                    "base": base_med,
                }
                if m != "none":
                    rec.update(
                        blocking=out["blocking"],
                        drain=out["drain"],
                        writer_cpu=out["writer_cpu"],
                        lost=sum(w - base_med for w in walls),
                    )
                raw[m].append(rec)
                print(
                    f"round {r} {m:16s} "
                    + " ".join(
                        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in rec.items()
                    ),
                    flush=True,
                )
    finally:
        for s in savers.values():
            if s is not None:
                s.close()
        shutil.rmtree(root, ignore_errors=True)
    base_all = med([x["base"] for m in modes for x in raw[m]])
    print(
        f"\n### Training steps while an async save drains ({a.rounds} interleaved rounds, "
        f"median (min-max))\n"
    )
    print(
        "| mode | step s | min-max s | x no save | cpu / runq / other s | blocking s "
        "| drain s | lost s per save | steps in drain | writer cpu s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")

    def mm(vals: list, f: str = "{:.3f}") -> str:
        vals = [v for v in vals if v is not None]
        if not vals:
            return ""
        return f"{f.format(med(vals))} ({f.format(min(vals))}-{f.format(max(vals))})"

    summary = {}
    for m in modes:
        rs = raw[m]
        ratio = [x["step"] / x["base"] for x in rs]
        row = {
            k: [x.get(k) for x in rs]
            for k in (
                "step",
                "cpu",
                "runq",
                "other",
                "blocking",
                "drain",
                "lost",
                "n_steps",
                "writer_cpu",
            )
        }
        summary[m] = {
            k: med([v for v in vals if v is not None]) if any(v is not None for v in vals) else None
            for k, vals in row.items()
        }
        summary[m]["x_no_save"] = med(ratio)
        st = row["step"]
        print(
            f"| {m} | {med(st):.3f} | {min(st):.3f}-{max(st):.3f} | "
            f"{mm(ratio, '{:.2f}x')} | "
            f"{summary[m]['cpu']:.3f} / {summary[m]['runq']:.3f} / "
            f"{summary[m]['other']:.3f} | {mm(row['blocking'])} | {mm(row['drain'])} | "
            f"{mm(row['lost'])} | {mm(row['n_steps'], '{:.0f}')} | "
            f"{mm(row['writer_cpu']) if not m.startswith('sp-child') else 'n/a'} |"
        )
    print(f"\nno-save step median over all rounds: {base_all:.3f} s")
    floor = med(memcpy)
    print(
        f"memcpy of the state into reused staging buffers: {floor:.3f} s "
        f"({min(memcpy):.3f}-{max(memcpy):.3f}); blocking part / memcpy: "
        + ", ".join(
            f"{m} {summary[m]['blocking'] / floor:.2f}x"
            for m in modes
            if summary[m].get("blocking") is not None
        )
    )
    rec = record(a, argv, raw, modes, nbytes)
    for t in rec.data["tables"][1:]:  # the figures above, one table each (as in the file)
        print(f"\n**{t['title']}**\n\n| mode | median s | min-max s |\n|---|---|---|")
        for r in t["rows"]:
            print(f"| {r['label']} | {r['median']:.3f} | {r['min']:.3f}-{r['max']:.3f} |")
    if a.json:
        rec.write(a.json)


def record(a, argv, raw: dict, modes: list, nbytes: int) -> "br.Record":
    """The run in ``bench_results``' schema: a table per figure, one row per mode, one value
    per round (the no-save median of the same round as the reference of each ratio)."""
    cfg = {k: getattr(a, k) for k in ("rounds", "layers", "width", "batch", "dcp_threads", "quick")}
    cfg["state_bytes"] = nbytes
    rec = br.Record(
        "bench_async_train.py",
        "Training steps while an async save drains: an "
        f"MLP of {a.layers} layers on one torch thread, its weights and Adam state "
        "saved asynchronously",
        argv,
        cfg,
        {"torch": torch.__version__},
    )
    saves = [m for m in modes if m != "none"]
    t = rec.table(
        "step",
        "Median training step while the save drains (no save: the round's steps without one)",
    )
    for m in modes:
        rs = raw[m]
        br.Record.row(
            t,
            m,
            [x["step"] for x in rs],
            {"x no save": br.ratio([x["step"] for x in rs], [x["base"] for x in rs])},
            cpu=med([x["cpu"] for x in rs]),
            runq=med([x["runq"] for x in rs]),
            other=med([x["other"] for x in rs]),
        )
    for name, title in (
        (
            "runq",
            "Per step: time the training thread waited runnable for a "
            "core (median step of each round)",
        ),
        (
            "other",
            "Per step: time the training thread was blocked (waiting "
            "for the GIL, a lock, I/O; median step of each round)",
        ),
    ):
        t = rec.table(f"step_{name}", title)
        for m in modes:
            br.Record.row(t, m, [x[name] for x in raw[m]])
    for name, title in (
        (
            "lost",
            "Training time lost per save (sum over the steps in the drain "
            "of step minus the no-save median)",
        ),
        ("drain", "Drain: from the save call's return to the commit"),
        ("blocking", "Blocking part of the save call"),
        (
            "writer_cpu",
            "CPU the save took in the trainer's process beyond the "
            "training thread (not counted for a child process)",
        ),
    ):
        t = rec.table(name, title)
        for m in saves:
            if name == "writer_cpu" and m.startswith("sp-child"):
                continue
            br.Record.row(t, m, [x[name] for x in raw[m]])
    return rec


if __name__ == "__main__":
    main()
