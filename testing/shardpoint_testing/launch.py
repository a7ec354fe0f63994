"""Run a function on N real processes joined in a gloo process group, with a hard timeout.

Used by the tests, the demo and ``shardpoint conformance run``: each rank runs ``fn(rank,
world, *args)``; results (picklable, test-side only, never checkpoint data) come back per
rank. A rank that raises fails the run with its traceback; a run that exceeds ``timeout`` is
killed, so a hung collective can never stall the caller.

Ranks are forked from a fork server that has imported torch and shardpoint once (the
``forkserver`` start method with a preload), not started from a fresh interpreter each:
importing torch costs each spawned rank about as much CPU as a small test's work. Each rank
gets the caller's environment as it is at the call (the server's is from its start).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable


class RankFailure(RuntimeError):
    """One or more ranks raised, or the run timed out."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the fork server; every rank forked from it starts with them loaded.
PRELOAD = ["torch", "torch.distributed", "numpy", "shardpoint.api", "shardpoint.tree.model",
           "shardpoint.exchange.comm"]
_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _CTX = ctx
    return _CTX


def _entry(fn, rank, world, port, args, q, pg_timeout, env):
    os.environ.clear()
    os.environ.update(env)
    import torch.distributed as dist
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=pg_timeout))
        try:
            q.put((rank, True, fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        q.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_world(world: int, fn: Callable, *args: Any, timeout: float = 120.0,
              pg_timeout: float = 60.0) -> list:
    """``[fn(0, world, *args), ..., fn(world-1, world, *args)]`` from real processes."""
    ctx = _context()
    q = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, q, pg_timeout, env),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict = {}
    errors: dict = {}
    import queue as _q
    import time
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankFailure(f"timed out after {timeout:.0f}s; ranks still running: "
                                  f"{sorted(set(range(world)) - set(results) - set(errors))}"
                                  + (f"; failures: {errors}" if errors else ""))
            try:
                rank, ok, val = q.get(timeout=min(left, 1.0))
            except _q.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in results and r not in errors]
                for r in dead:
                    errors[r] = f"process exited with code {procs[r].exitcode}"
                continue
            (results if ok else errors)[rank] = val
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RankFailure("; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
    return [results[r] for r in range(world)]
