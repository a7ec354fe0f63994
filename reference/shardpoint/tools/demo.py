"""``shardpoint demo``: train, get SIGKILLed after a checkpoint, resume in three layouts.

A tiny GPT (:mod:`shardpoint.tools.demo_train`) is trained on CPU by 4 gloo ranks in a TP=2 x DP=2
layout with a distributed optimizer, checkpointing every few steps through the
:class:`CheckpointManager` (asynchronously where ``sp.save`` supports it). An uninterrupted
run gives the reference loss curve. A second run is SIGKILLed mid-training after a
checkpoint and resumed (a) on 4 ranks, TP=2 x DP=2: the losses after the resume must be
bitwise equal to the reference; (b) on 2 ranks, TP=1 x DP=2, and (c) on 1 rank: the state at
the resume point must be bitwise equal (a digest of the full global state) and the losses
within float tolerance. Prints a summary table; exit code 1 on any mismatch.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
from datetime import timedelta
from typing import Optional

from shardpoint import api
from shardpoint.tools import demo_train
from shardpoint.api.manager import CheckpointManager

STEPS, EVERY, KILL_AFTER = 12, 4, 6
RTOL = 1e-4


def _rank_main(rank: int, world: int, tp: int, rendezvous: str, root: str, q, gate) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=rendezvous,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
        lay = demo_train.make_layout(rank, world, tp)

        def report(*msg):
            q.put(msg)
            if gate is not None and msg[0] == "step":
                gate.get(timeout=120)  # the killed run: wait for the parent's go-ahead

        out = demo_train.run(lay, root, STEPS, EVERY, _async(), report)
        q.put(("result", rank, out))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        q.put(("error", rank, f"{type(e).__name__}: {e}"))


def _async() -> bool:
    return hasattr(api, "AsyncSave")


def _launch(
    name: str,
    world: int,
    tp: int,
    root: str,
    kill_after: Optional[int] = None,
    timeout: float = 120.0,
) -> dict:
    """Run the job on ``world`` forked gloo ranks, printing a line per step; with
    ``kill_after``, SIGKILL every rank once that step is done and a checkpoint committed."""
    ctx = mp.get_context("fork")  # the ranks start from this process: no re-import
    q, gate = ctx.Queue(), (ctx.Queue() if kill_after else None)
    # the ranks meet through a file of a fresh directory, not a port found free beforehand
    # (another job could take that port before rank 0 binds it)
    where = tempfile.mkdtemp(prefix="shardpoint-demo-world-")
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, world, tp, f"file://{where}/store", root, q, gate),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    res: dict = {"losses": {}, "start": None, "killed_at": None}
    done, deadline = 0, time.monotonic() + timeout
    try:
        while done < world:
            try:
                msg = q.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"run {name}: a rank died or timed out") from None
                continue
            kind = msg[0]
            if kind == "error":
                raise RuntimeError(f"run {name}: rank {msg[1]}: {msg[2]}")
            if kind == "resumed":
                print(f"  [{name}] resumed from step {msg[1]}")
            elif kind == "step":
                _, step, loss, saved = msg
                print(
                    f"  [{name}] step {step:2d}  loss {loss:.6f}"
                    + ("  checkpoint saved" if saved else ""),
                    flush=True,
                )
                # an observer's manager only reads: it never cleans the job's staging
                if (
                    kill_after
                    and step >= kill_after
                    and (CheckpointManager(root).latest_step() or 0) > 0
                ):
                    for p in procs:
                        p.kill()  # SIGKILL, as a crash would end them
                    print(
                        f"  [{name}] SIGKILL to all {world} ranks after step {step} "
                        f"(latest complete checkpoint: step "
                        f"{CheckpointManager(root).latest_step()})"
                    )
                    res["killed_at"] = step
                    return res
                if gate is not None:
                    gate.put(True)
            elif kind == "result":
                done += 1
                if msg[1] == 0:
                    res.update(msg[2])
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(where, ignore_errors=True)
    return res


def _in_process(name: str, root: str) -> dict:
    """The 1-rank resume, here: no process group at all."""

    def report(*msg):
        if msg[0] == "resumed":
            print(f"  [{name}] resumed from step {msg[1]}")
        elif msg[0] == "step":
            print(
                f"  [{name}] step {msg[1]:2d}  loss {msg[2]:.6f}"
                + ("  checkpoint saved" if msg[3] else ""),
                flush=True,
            )

    lay = demo_train.make_layout(0, 1, 1)
    return demo_train.run(lay, root, STEPS, EVERY, _async(), report)


def run_demo(base: Optional[str] = None, *, keep: bool = False) -> int:
    """Run the demo; returns a process exit code (0: every check passed)."""
    own = base is None
    base = base or tempfile.mkdtemp(prefix="shardpoint-demo-")
    os.makedirs(base, exist_ok=True)
    print(
        f"shardpoint demo: a tiny GPT trained by 4 gloo ranks (TP=2 x DP=2, distributed "
        f"AdamW), {STEPS} steps, a checkpoint every {EVERY} "
        f"({'async' if _async() else 'sync'} saves) under {base}"
    )
    rows, ok = [], True
    t0 = time.perf_counter()
    try:
        print("reference: uninterrupted run")
        ref = _launch("reference", 4, 2, os.path.join(base, "reference"))
        print(f"crash: a run SIGKILLed mid-training after step {KILL_AFTER}")
        killed_root = os.path.join(base, "killed")
        _launch("killed", 4, 2, killed_root, kill_after=KILL_AFTER)
        resumes = [("a", 4, 2), ("b", 2, 1), ("c", 1, 1)]
        for name, world, tp in resumes:
            root = os.path.join(base, f"resume_{name}")
            shutil.copytree(killed_root, root, dirs_exist_ok=True)
            print(f"resume ({name}): {world} rank(s), TP={tp} x DP={world // tp}")
            out = _in_process(name, root) if world == 1 else _launch(name, world, tp, root)
            start = out["start"]
            state_ok = start is not None and out["resume_digest"] == ref["digests"].get(start)
            diffs = [
                abs(out["losses"][s] - ref["losses"][s]) / abs(ref["losses"][s])
                for s in out["losses"]
            ]
            exact = all(out["losses"][s] == ref["losses"][s] for s in out["losses"])
            worst = max(diffs, default=0.0)
            good = (
                state_ok
                and len(out["losses"]) == STEPS - (start or 0)
                and (exact if name == "a" else worst <= RTOL)
            )
            ok &= good
            rows.append(
                (
                    f"({name})",
                    f"TP={tp} x DP={world // tp}",
                    str(start),
                    "bitwise equal" if state_ok else "MISMATCH",
                    "bitwise equal" if exact else f"max rel diff {worst:.1e}",
                    "PASS" if good else "FAIL",
                )
            )
    except (RuntimeError, OSError, KeyError) as e:
        print(f"demo: a step failed: {type(e).__name__}: {e}")
        ok = False
    finally:
        if own and not keep:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print(f"checkpoints kept under {base}")
    if rows:
        head = ("resume", "layout", "from step", "state at resume", "losses after resume", "result")
        widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
        print()
        for r in [head] + rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print(f"demo: {'PASSED' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f}s")
    return 0 if ok else 1
