"""The tests' S3-compatible server (``shardpoint_testing.s3``) and GCS emulator die with the process that
started it: a test run that is SIGKILLed cannot stop its servers, and before this they
outlived it, holding their ports and memory."""

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("moto")
pytest.importorskip("boto3")

PARENT = """
import subprocess, sys
from shardpoint_testing.s3 import S3Server, free_port
a = S3Server().start()                                  # moto's server, on loopback
b = S3Server(host="127.0.0.1", port=free_port(),        # a launched one, as on the cluster
             launch=subprocess.Popen).start()
procs = [a._proc.pid, b._proc.pid]
try:
    from shardpoint_testing.gcs import GcsServer
    procs.append(GcsServer().start()._proc.pid)         # the GCS emulator, where installed
except ImportError:
    pass
print(*procs, flush=True)
sys.stdin.read()
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is gone
    except FileNotFoundError:
        return False


def test_servers_die_when_their_parent_is_sigkilled():
    """A parent starts both kinds of S3 server (moto's own on loopback, and the launched one
    the cluster's storage host runs) and the GCS emulator, then is killed with SIGKILL: both servers are gone
    within a few seconds."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    pids: list = []
    try:
        line = parent.stdout.readline()
        pids = [int(x) for x in line.split()]
        assert len(pids) >= 2 and all(_alive(p) for p in pids), line
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "a server outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)
        for p in pids:  # only if the test failed: do not leave them behind
            if _alive(p):
                os.kill(p, signal.SIGKILL)
