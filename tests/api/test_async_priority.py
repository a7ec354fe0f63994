"""An async save's background part at a low CPU priority (``SaveOptions.async_priority``):
its writer threads run at nice 19 (or SCHED_IDLE) while the backend's own pools, which sync
saves and loads use, keep the caller's priority; the checkpoint is the same bits; a bad value
is refused before any save starts; a failed low-priority save is reported, not fatal."""

import os
import sys
import threading

import pytest
import torch

import shardpoint as sp
from shardpoint_core.format import errors
from shardpoint_core.transactions.backend import ZarrBackend
from shardpoint_testing.tensors import same_bits, seeded_randn

linux = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's"
)


def state():
    return {
        "w": seeded_randn("w", (64, 33)),
        "b": seeded_randn("b", (7,), torch.bfloat16),
        "step": 3,
    }


def named(prefix):
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.native_id]


def nice_of(t):
    return os.getpriority(os.PRIO_PROCESS, t.native_id)


@linux
def test_low_priority_writers_and_untouched_pools_for_sync_saves(tmp_path):
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    if mine >= 19:
        pytest.skip("this process already runs at nice 19")
    be = ZarrBackend(fsync=False)
    cp = sp.Checkpointer(backend=be, save_options=sp.SaveOptions(async_priority="low"))
    st = state()
    h = cp.save(st, str(tmp_path / "a"), async_save=True)
    h.wait(timeout=120)
    low = named("shardpoint-write-low_")
    assert low, "the async save wrote through no low-priority threads"
    assert {nice_of(t) for t in low} == {19}
    cp.save(st, str(tmp_path / "b"))  # sync: the backend's own pool
    own = named("shardpoint-write_")
    assert own and {nice_of(t) for t in own} == {mine}
    for p in ("a", "b"):
        got = cp.load(str(tmp_path / p)).tree
        assert same_bits(got["w"], st["w"]) and same_bits(got["b"], st["b"])
        assert got["step"] == 3
    # the next async save reuses the same low-priority pool (no new pool per save): its
    # threads are still there, the executor may start more lazily up to its size, never a
    # second set
    low_pool = be._write_pool._pools["low"]
    before = set(low_pool._threads)
    cp.save(st, str(tmp_path / "c"), async_save=True).wait(timeout=120)
    assert be._write_pool._pools["low"] is low_pool
    after = set(low_pool._threads)
    assert before <= after and len(after) <= be._write_pool.threads
    assert {nice_of(t) for t in after} == {19}
    assert set(be._write_pool._pools) == {"normal", "low"}


@linux
def test_idle_priority_is_inherited_by_the_threads_the_writer_starts():
    from shardpoint_core.stores.durable import lower_thread_priority

    seen = {}

    def child():
        seen["child"] = os.sched_getscheduler(threading.get_native_id())

    def writer():
        seen["lowered"] = lower_thread_priority("idle")
        seen["writer"] = os.sched_getscheduler(threading.get_native_id())
        t = threading.Thread(target=child)
        t.start()
        t.join()

    t = threading.Thread(target=writer)
    t.start()
    t.join()
    assert seen == {"lowered": True, "writer": os.SCHED_IDLE, "child": os.SCHED_IDLE}
    assert os.sched_getscheduler(threading.get_native_id()) != os.SCHED_IDLE  # caller's own


def test_a_pool_runs_each_task_at_its_submitters_priority():
    """The backend's pools choose threads by the submitting thread's priority: work a lowered
    thread submits (and the tasks those submit) runs at that priority, work from a normal
    thread on normal threads, from one pool object."""
    from shardpoint_core.arrays.direct_write import WritePool, run_at_priority

    pool = WritePool(2, "prio-test")

    def nice_here():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def nested():
        return pool.submit(nice_here).result()

    mine = nice_here()
    if mine >= 19:
        pytest.skip("this process already runs at nice 19")
    seen = {}

    def background():
        run_at_priority("low")
        seen["low"] = pool.submit(nice_here).result()
        seen["nested"] = pool.submit(nested).result()

    t = threading.Thread(target=background)
    t.start()
    t.join()
    seen["normal"] = pool.submit(nice_here).result()
    assert seen == {"low": 19, "nested": 19, "normal": mine}
    assert set(pool._pools) == {"low", "normal"}


@pytest.mark.parametrize("bad", ["high", "", None, 19])
def test_unknown_priority_is_refused_when_the_options_are_made(bad):
    with pytest.raises(errors.InvalidOptionError, match="async_priority"):
        sp.SaveOptions(async_priority=bad)


class FullDisk(ZarrBackend):
    """The real backend, except that once ``full`` is set every chunk write finds the disk
    full (a real exception raised where a real one would be); records the nice value of the
    threads that called ``write``."""

    def __init__(self):
        super().__init__(fsync=False)
        self.full, self.callers = False, []

    def write(self, handle, offset, data):
        self.callers.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        if self.full:
            raise OSError(28, "No space left on device (simulated)")
        return super().write(handle, offset, data)


@linux
def test_failed_low_priority_save_is_reported_and_the_previous_checkpoint_stays(tmp_path):
    be = FullDisk()
    cp = sp.Checkpointer(backend=be)  # the default priority: "low"
    st = state()
    path = str(tmp_path / "ckpt")
    cp.save(st, path, async_save=True).wait(timeout=120)
    be.full = True
    h = cp.save({**st, "w": st["w"] * 2}, path, overwrite=True, async_save=True)
    with pytest.raises(errors.SaveFailedError, match="No space left"):
        h.wait(timeout=120)
    assert set(be.callers) == {19}  # written from the low-priority thread
    # one not waited for comes out of the next save, once; that save then goes on
    cp.save(st, str(tmp_path / "lost"), async_save=True)
    with pytest.raises(errors.SaveFailedError, match="No space left"):
        cp.save(st, str(tmp_path / "next"))
    be.full = False
    cp.save(st, str(tmp_path / "next"))
    got = cp.load(path).tree
    assert same_bits(got["w"], st["w"])  # the previous checkpoint, intact
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "next"]
