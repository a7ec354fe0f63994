"""How ranks run on the test cluster (:mod:`shardpoint_testing.cluster`): each rank's process
enters its host's network and UTS namespaces (:func:`enter_host`), joins a gloo group over
the shaped links and reports its outcome to a :class:`ClusterJob`, which collects every
rank's result or error, killing ranks that hang. Kept apart from the cluster's building and
teardown, which need root tools; this part runs inside the hosts."""

from __future__ import annotations

import ctypes
import os
import queue as queue_mod
import socket
import subprocess
import time
import traceback
from typing import Any

from shardpoint_testing.launch import RankFailure, init_gloo

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUTS = 0x04000000


class ClusterJob:
    """Ranks running on a cluster: :meth:`wait` for them (each rank's result or error)."""

    def __init__(self, cluster: Any, procs: list, q: Any):  # cluster: the Cluster
        self.cluster, self.procs, self.q = cluster, procs, q
        self.results: dict = {}
        self.errors: dict = {}
        self.finished_at: dict = {}  # rank -> time.monotonic() its outcome arrived

    def poll(self, timeout: float = 0.2) -> None:
        """Collect outcomes that arrived (and ranks whose process died) within ``timeout``."""
        try:
            rank, ok, val = self.q.get(timeout=timeout)
            (self.results if ok else self.errors)[rank] = val
            self.finished_at[rank] = time.monotonic()
        except queue_mod.Empty:
            pass
        for r, p in enumerate(self.procs):
            if p.exitcode not in (None, 0) and r not in self.results and r not in self.errors:
                self.errors[r] = f"process exited with code {p.exitcode}"
                self.finished_at[r] = time.monotonic()

    def outcomes(self, timeout: float) -> tuple:
        """``(results, errors)`` by rank once every rank finished, or when ``timeout`` runs
        out (ranks still running are then killed and listed under ``errors`` as hung)."""
        deadline = time.monotonic() + timeout
        while len(self.results) + len(self.errors) < len(self.procs):
            left = deadline - time.monotonic()
            if left <= 0:
                for r, p in enumerate(self.procs):
                    if r not in self.results and r not in self.errors:
                        self.errors[r] = f"hung: still running after {timeout:.0f} s"
                        _kill(p)
                break
            self.poll(min(left, 0.2))
        for p in self.procs:
            p.join(timeout=5)
            _kill(p)
        return self.results, self.errors

    def wait(self, timeout: float = 120.0) -> list:
        results, errors = self.outcomes(timeout)
        if errors:
            raise RankFailure("; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
        return [results[r] for r in range(len(self.procs))]


def _kill(p: Any) -> None:
    try:
        if isinstance(p, subprocess.Popen):
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        elif p.is_alive():
            p.kill()
            p.join(timeout=10)
    except (OSError, ValueError, subprocess.TimeoutExpired, AssertionError):
        pass


def enter_host(netns: str, hostname: str) -> None:
    """Move this (single-threaded) process into ``netns`` under a UTS namespace of its own
    named ``hostname``: from here on it sees the host's interface and name only."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns} failed")
    finally:
        os.close(fd)
    if libc.unshare(_CLONE_NEWUTS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUTS) failed")
    socket.sethostname(hostname)


def _entry(netns, hostname, env, fn, rank, world, args, q, pg_timeout):
    try:
        enter_host(netns, hostname)
        os.environ.clear()  # the caller's environment at the call, not the fork server's
        os.environ.update(env)
        import torch.distributed as dist

        init_gloo("env://", rank, world, pg_timeout)
        try:
            q.put((rank, True, fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        q.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
