"""A signal's exception landing inside ``WritePool.submit`` while the executor starts a worker
thread (before it records the thread) must not leave that thread waiting forever: the
interpreter's exit joins it, so the process would hang after a SIGTERM or Ctrl-C during a
save (seen under load with the packed default)."""

import threading

import pytest

from shardpoint_core.arrays.direct_write import WritePool


def test_an_interrupt_while_a_worker_starts_leaves_no_thread_waiting(monkeypatch):
    pool = WritePool(2, "sp-interrupt-test")
    go = threading.Event()
    busy = pool.submit(go.wait, 10)  # the executor's one thread busy: the next submit starts one
    real_start = threading.Thread.start
    started = []

    def start_then_interrupt(self, *a, **k):
        real_start(self, *a, **k)
        started.append(self)
        raise KeyboardInterrupt  # after the thread runs, before the executor records it

    monkeypatch.setattr(threading.Thread, "start", start_then_interrupt)
    executor = pool._pools["normal"]
    with pytest.raises(KeyboardInterrupt):
        pool.submit(lambda: 2)
    monkeypatch.setattr(threading.Thread, "start", real_start)
    go.set()
    assert busy.result(timeout=10) is True  # work queued before the interrupt still ran
    (t,) = started
    t.join(timeout=10)
    alive = t.is_alive()
    if alive:  # the defect: wake it here, or this test process would hang at exit
        executor.shutdown(wait=False)
        t.join(timeout=10)
    assert not alive, "the unrecorded worker thread still waits for work"
    assert pool.submit(lambda: 3).result(timeout=10) == 3  # a fresh executor serves on
