"""Run a function on N real processes joined in a gloo process group, with a hard timeout.

Used by the tests, the demo and ``shardpoint conformance run``: each rank runs ``fn(rank,
world, *args)``; results (picklable, test-side only, never checkpoint data) come back per
rank. A rank that raises fails the run with its traceback; a run that exceeds ``timeout`` is
killed, so a hung collective can never stall the caller.

Ranks are forked from a fork server that has imported torch and shardpoint once (the
``forkserver`` start method with a preload), not started from a fresh interpreter each:
importing torch costs each spawned rank about as much CPU as a small test's work. Each rank
gets the caller's environment as it is at the call (the server's is from its start).
``run_script`` / ``run_code`` run a script (the examples, the README's blocks) the same way,
as one process with no process group, its output captured.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import socket
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable


class RankFailure(RuntimeError):
    """One or more ranks raised, or the run timed out."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the fork server; every rank forked from it starts with them loaded
# (``_preload`` adds DTensor, the device mesh, DCP and Megatron-core: seconds per rank).
PRELOAD = [
    "torch",
    "torch.distributed",
    "numpy",
    "shardpoint.api",
    "shardpoint.tree.model",
    "shardpoint.exchange.comm",
    "shardpoint_testing._preload",
]
_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _CTX = ctx
    return _CTX


def process_context() -> Any:
    """The ``multiprocessing`` context whose processes fork from the preloaded fork server:
    for tests that need plain processes (no process group) without a fresh torch import."""
    return _context()


def init_gloo(init_method: str, rank: int, world: int, pg_timeout: float) -> None:
    """A rank's gloo process group, every rank connected on return (one thread for torch)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=pg_timeout),
    )
    # gloo's init returns on one rank while a peer may still be finishing its side of the
    # mesh: a rank whose function ends at once would close its sockets under that peer
    # ("Connection closed by peer" in connectFullMesh). One barrier: all connected.
    dist.barrier()


def _entry(fn, rank, world, rendezvous, args, q, pg_timeout, env):
    os.environ.clear()
    os.environ.update(env)
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        init_gloo(rendezvous, rank, world, pg_timeout)
        try:
            q.put((rank, True, fn(rank, world, *args)))
        finally:
            if dist.is_initialized():  # the function may have destroyed it itself
                dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        q.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_world(
    world: int, fn: Callable, *args: Any, timeout: float = 120.0, pg_timeout: float = 60.0
) -> list:
    """``[fn(0, world, *args), ..., fn(world-1, world, *args)]`` from real processes."""
    ctx = _context()
    q = ctx.Queue()
    # A file rendezvous, not a TCP port: a free port found here could be taken by another
    # world (another xdist worker) before rank 0 binds it, and ranks of two worlds met.
    where = tempfile.mkdtemp(prefix="sp-world-")
    rendezvous = f"file://{where}/store"
    env = dict(os.environ)
    procs = [
        ctx.Process(
            target=_entry, args=(fn, r, world, rendezvous, args, q, pg_timeout, env), daemon=True
        )
        for r in range(world)
    ]
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
                raise RankFailure(
                    f"timed out after {timeout:.0f}s; ranks still running: "
                    f"{sorted(set(range(world)) - set(results) - set(errors))}"
                    + (f"; failures: {errors}" if errors else "")
                )
            try:
                rank, ok, val = q.get(timeout=min(left, 1.0))
            except _q.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in results and r not in errors
                ]
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
        shutil.rmtree(where, ignore_errors=True)
    if errors:
        raise RankFailure("; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
    return [results[r] for r in range(world)]


class ScriptResult:
    """What ``run_script`` saw: the exit code and the script's whole stdout and stderr (its
    own forked processes' output included)."""

    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr

    def __repr__(self) -> str:
        return f"ScriptResult(returncode={self.returncode}, stderr={self.stderr[-2000:]!r})"


def _script_entry(path, code_, argv, cwd, env, out_path, err_path, tty=None):
    import atexit
    import runpy
    import sys
    import threading

    if tty is not None:  # stdin, stdout and stderr: the terminal's other end
        f = os.open(tty, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(f, fd)
        os.close(f)
    else:
        for fd, name in ((1, out_path), (2, err_path)):
            f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(f, fd)
            os.close(f)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    code: Any = 0
    try:
        if path is not None:  # a script file, as `python path argv...` runs it
            sys.argv = [path, *argv]
            sys.path.insert(0, os.path.dirname(path))
            runpy.run_path(path, run_name="__main__")
        else:  # a block of code, as `python -c code argv...` runs it
            sys.argv = ["-c", *argv]
            exec(compile(code_, "<string>", "exec"), {"__name__": "__main__"})
        threading._shutdown()  # what interpreter exit does: join threads, atexit
        atexit._run_exitfuncs()
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - reported like the interpreter does
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def run_script(
    path: str,
    *argv: Any,
    cwd: str = ".",
    env: dict | None = None,
    timeout: float = 240.0,
    terminal: bool = False,
) -> ScriptResult:
    """Run the script at ``path`` as ``__main__`` in a fresh process forked from the fork
    server, as ``python path argv...`` would (its folder first on ``sys.path``, threads joined
    and ``atexit`` run at the end), without paying for the torch import each time: no process
    group, its own working directory and environment (default: this process's), stdout and
    stderr captured, killed after ``timeout`` seconds. With ``terminal``, stdin, stdout and
    stderr are one pseudo-terminal (what a person at a terminal sees comes back as stdout)."""
    return _run_forked(os.path.abspath(path), None, argv, cwd, env, timeout, terminal)


def run_code(
    code: str,
    *argv: Any,
    cwd: str = ".",
    env: dict | None = None,
    timeout: float = 240.0,
    terminal: bool = False,
) -> ScriptResult:
    """``run_script`` for a block of code, as ``python -c code argv...`` runs it."""
    return _run_forked(None, code, argv, cwd, env, timeout, terminal)


def _read_terminal(master: int, p: Any, timeout: float) -> bytes:
    """Everything written to the terminal until ``p`` exits (or ``timeout`` passes)."""
    import select
    import time

    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = p.is_alive()
        while select.select([master], [], [], 0.05 if alive else 0)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: no writer left
                chunk = b""
            if not chunk:
                break
            out += chunk
        if not alive:
            break
    return out


def _run_forked(path, code, argv, cwd, env, timeout, terminal=False) -> ScriptResult:
    import tempfile

    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="shardpoint-script-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        master = slave = None
        if terminal:
            import pty

            master, slave = pty.openpty()
        try:
            p = ctx.Process(
                target=_script_entry,
                args=(
                    path,
                    code,
                    [str(a) for a in argv],
                    os.path.abspath(cwd),
                    dict(os.environ if env is None else env),
                    out,
                    err,
                    None if slave is None else os.ttyname(slave),
                ),
            )
            p.start()
            seen = _read_terminal(master, p, timeout) if master is not None else b""
            p.join(1 if terminal else timeout)  # the terminal's reader waited already
        finally:
            for fd in (master, slave):
                if fd is not None:
                    os.close(fd)
        if p.is_alive():
            p.kill()
            p.join()
            raise RankFailure(f"{path or 'code'} timed out after {timeout:.0f}s")
        if terminal:
            return ScriptResult(p.exitcode, seen.decode(errors="replace"), "")
        with open(out, errors="replace") as f, open(err, errors="replace") as g:
            return ScriptResult(p.exitcode, f.read(), g.read())
