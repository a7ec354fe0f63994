"""OpenAhead: a save's or load's arrays opened from a few threads ahead of their I/O."""

import threading

import pytest

from shardpoint_core.format.errors import CorruptCheckpointError
from shardpoint.api.open_ahead import OpenAhead


def test_every_key_opened_once_ahead_of_use_and_results_by_key():
    calls, lock = [], threading.Lock()

    def open_fn(key):
        with lock:
            calls.append(key)
        return key.upper()

    keys = ["a", "b", "a", "c"]
    with OpenAhead(open_fn, keys, threads=3) as opened:
        assert [opened(k) for k in ["c", "a", "b", "a"]] == ["C", "A", "B", "A"]
        assert opened("late") == "LATE"  # not given up front: opened on demand
    assert sorted(calls) == ["a", "b", "c", "late"]


def test_an_open_error_is_raised_to_the_caller_of_that_key_only():
    def open_fn(key):
        if key == "bad":
            raise CorruptCheckpointError(
                f"tensor {key!r}: zarr.json is not JSON", spec_id="SP-ARRAY-1"
            )
        return key

    with OpenAhead(open_fn, ["ok", "bad", "ok2"]) as opened:
        assert opened("ok") == "ok"
        with pytest.raises(CorruptCheckpointError, match="'bad'"):
            opened("bad")
        assert opened("ok2") == "ok2"


def test_leaving_waits_for_opens_in_flight_and_cancels_the_rest():
    started, release = threading.Event(), threading.Event()
    done = []

    def open_fn(key):
        started.set()
        release.wait(5)
        done.append(key)
        return key

    keys = [f"k{i}" for i in range(50)]
    opened = OpenAhead(open_fn, keys, threads=1)
    started.wait(5)
    closer = threading.Thread(target=opened.close)
    closer.start()  # cancels what has not started, waits for k0
    for _ in range(500):  # bounded: a close that never cancels fails here
        if opened._futs["k1"].cancelled():
            break
        threading.Event().wait(0.01)
    assert opened._futs["k1"].cancelled()
    assert closer.is_alive()  # still waiting for the open in flight
    release.set()
    closer.join(5)
    assert done == ["k0"]
