"""Start a multi-process JAX job on this machine (CPU, gloo collectives): ``n`` processes of
``python -c CODE`` with ``devices`` host devices each, joined by ``jax.distributed``. The
code runs after ``jax.distributed.initialize``; used by the tests and the README example."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Optional

PRELUDE = """\
import os, jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_enable_x64", True)
jax.distributed.initialize(os.environ["SPJ_COORDINATOR"], int(os.environ["SPJ_WORLD"]),
                           int(os.environ["SPJ_RANK"]), initialization_timeout=60)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(
    code: str,
    n: int,
    devices: int,
    *,
    cwd: Optional[str] = None,
    timeout: float = 120.0,
    env: Optional[dict] = None,
) -> list:
    """Run ``code`` in ``n`` JAX processes; returns their stdouts, raises with every
    process's stderr tail if one fails or the job outlives ``timeout`` seconds."""
    port = free_port()
    procs = []
    for r in range(n):
        e = dict(os.environ, **(env or {}))
        e.update(
            SPJ_COORDINATOR=f"127.0.0.1:{port}",
            SPJ_WORLD=str(n),
            SPJ_RANK=str(r),
            JAX_PLATFORMS="cpu",
            XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", PRELUDE + code],
                cwd=cwd,
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
            )
        )
    outs, failed = [], False
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            err += f"\n(timed out after {timeout:.0f}s)"
        failed |= p.returncode != 0
        outs.append((p.returncode, out, err))
    if failed:
        raise RuntimeError(
            "JAX job failed:\n"
            + "\n".join(
                f"--- process {r} exit {rc}\n{err[-3000:]}" for r, (rc, _, err) in enumerate(outs)
            )
        )
    return [out for _, out, _ in outs]
