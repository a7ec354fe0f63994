"""A rank that never calls ``save``: the others raise ``RankLostError`` once the group's
timeout passes (while that rank is still alive, so it is the timeout and not a dropped
connection that ends it), and every process then exits cleanly.

The survivors used to die at exit now and then with SIGABRT after printing the error: the
process group's worker thread still held the failed collective's tensors when the error was
raised, dropped them while the interpreter was exiting, and aborted inside torch's destructor.
The abort needs the real interpreter exit, so the ranks here are fresh ``python`` processes
joined by a file rendezvous, not the launcher's forked ranks (which leave by ``os._exit``).
"""

import os
import subprocess
import sys
import time

import pytest
import torch

from shardpoint_testing.launch import run_world

RANK = r"""
import datetime, os, sys, time, torch
import torch.distributed as dist
import shardpoint as sp
rank, world, root, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank,
                        world_size=world, timeout=datetime.timedelta(seconds=2))
if rank == world - 1:           # never calls save; stays alive until the others gave up
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
            os.path.exists(f"{root}/failed{r}") for r in range(world - 1)):
        time.sleep(0.05)
    print("alive until the others failed:", all(
        os.path.exists(f"{root}/failed{r}") for r in range(world - 1)))
    sys.exit(0)
state = {"w": sp.ShardedTensor(torch.ones(3), (3 * world,), (3 * rank,)), "x": torch.ones(5)}
try:
    h = sp.save(state, f"{root}/ckpt", async_save=mode == "async")
    if mode == "async":
        h.wait()
    print("saved")
except sp.RankLostError as e:
    print("RankLostError:", e)
open(f"{root}/failed{rank}", "w").close()
"""


def run_ranks(tmp_path, world: int, mode: str) -> list:
    """One run: ``world`` fresh interpreters; ``[(exit code, stdout, stderr)]`` per rank."""
    root = tmp_path / f"{mode}-{len(os.listdir(tmp_path))}"
    root.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), str(world), str(root), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        for r in range(world)
    ]
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=120)
            out.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def check(outcomes: list) -> None:
    *survivors, hung = outcomes
    for r, (rc, _out, err) in enumerate(outcomes):
        assert rc == 0 and "terminate called" not in err, (r, rc, err[-1500:])
    for _rc, out, err in survivors:
        assert out.startswith("RankLostError: "), (out, err[-1500:])
        assert "group's timeout (2 s)" in out and "restart every rank" in out, out
    assert "alive until the others failed: True" in hung[1], hung


def test_a_rank_that_never_saves_fails_the_others_cleanly(tmp_path):
    check(run_ranks(tmp_path, 2, "sync"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_rank_that_never_saves_fails_the_others_cleanly_every_time(tmp_path, mode):
    """Before the fix about one run in four ended with a survivor's SIGABRT."""
    for _ in range(10):
        check(run_ranks(tmp_path, 3, mode))


def _stay_alive_until(flag: str) -> bool:
    """Never join; stay alive (so that the others' failure is the group's 2 s timeout, not a
    dropped connection) until ``flag`` exists: True if it came within 60 s."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not os.path.exists(flag):
        time.sleep(0.05)
    return os.path.exists(flag)


def _failed_collective_lets_go(rank, world, root):
    import torch.distributed as dist
    from shardpoint.exchange.comm import Comm
    import shardpoint as sp

    if rank == 1:
        return _stay_alive_until(f"{root}/failed0")
    t = torch.ones(4)
    try:
        Comm()._run("all_reduce", dist.all_reduce, t)
    except sp.RankLostError as e:
        # what the caller holds when the error reaches it: the tensor is no longer held by
        # the backend's work (which a worker thread might otherwise drop during exit)
        return type(e).__name__, t._use_count()
    finally:
        open(f"{root}/failed0", "w").close()
    return "no error", None


def test_a_failed_collective_lets_go_of_its_tensors_before_raising(tmp_path):
    got = run_world(2, _failed_collective_lets_go, str(tmp_path), timeout=60, pg_timeout=2)
    assert got == [("RankLostError", 1), True], got


def _names_the_peer(rank, world, root):
    from shardpoint.exchange.comm import Comm
    import shardpoint as sp

    if rank == 2:  # offers its size, then never sends its bytes
        Comm()._sizes(10)
        return _stay_alive_until(f"{root}/failed0")
    try:
        Comm().gather_bytes(b"x" * 10)  # rank 0 waits for each rank's bytes, point to point
    except sp.RankLostError as e:
        return str(e)
    finally:
        if rank == 0:
            open(f"{root}/failed0", "w").close()
    return "no error"


@pytest.mark.slow
def test_a_point_to_point_wait_names_the_rank_it_waited_on(tmp_path):
    got = run_world(3, _names_the_peer, str(tmp_path), timeout=60, pg_timeout=2)
    assert "rank 0 of 3" in got[0] and "rank 2, which this rank waited on" in got[0], got[0]
