"""Small probes the tests share: what a call leaves in reference cycles, whether a call
finishes (a reader that blocks on a FIFO must not hang the suite), and uploading a directory
to a byte store (the spec vectors on ``memory://``)."""

from __future__ import annotations

import gc
import os
import threading
from typing import Any, Callable, Optional


def garbage_of(fn: Callable[[], Any]) -> list:
    """The objects ``fn`` leaves in reference cycles, found by one collection after a
    first, untracked call (imports and caches)."""
    fn()
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        fn()
        gc.collect()
        return list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was:
            gc.enable()


def error_within(
    fn: Callable[[], Any], timeout: float = 60.0, what: str = "the call"
) -> Optional[BaseException]:
    """Run ``fn`` in a daemon thread; fail if it has not returned within ``timeout``
    seconds, else return what it raised (None if nothing)."""
    box: dict = {}

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["err"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{what} blocked"
    return box.get("err")


def upload_dir(store: Any, key: str, directory: str) -> None:
    """Put every file under ``directory`` into ``store`` at ``key/<relative path>``."""
    for d, _dirs, files in os.walk(directory):
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), directory).replace(os.sep, "/")
            with open(os.path.join(d, f), "rb") as fh:
                store.put(f"{key}/{rel}", fh.read())


def vector_on_store(case_dir: str, url: str) -> dict:
    """Upload a spec vector's ``checkpoint/`` to the store of ``url`` (``memory://...``)
    and return its ``expected.json``: the reader rules checked on a store without files."""
    import json

    from shardpoint_core.stores.registry import bucket_store

    store, key = bucket_store(url, "tests")
    upload_dir(store, key, os.path.join(case_dir, "checkpoint"))
    with open(os.path.join(case_dir, "expected.json")) as f:
        return json.load(f)


def crashed_save(store: Any, prefix: str, objects: dict, lease_s: float = 1e-3) -> None:
    """What a save that died left on an object store: its lease ([SP-COMMIT-16]; by default
    one that expired long ago) and ``objects`` (key below ``prefix`` -> bytes) below its save
    prefix ``prefix`` (``.../save-<token>``)."""
    from shardpoint_core.commit.lease import LEASE_NAME, encode_lease

    token = prefix.rstrip("/").rpartition("/")[2][len("save-") :]
    store.put(f"{prefix}/{LEASE_NAME}", encode_lease(token, lease_s))
    for k, v in objects.items():
        store.put(f"{prefix}/{k}", v)


def pause_lease(store: Any, staging: str) -> None:
    """What SIGSTOP does to a save's lease in this process: its renewals stop, the save stays
    (publish still runs when called)."""
    from shardpoint_core.commit import lease

    st = lease._LIVE[lease._id(store, staging)]
    st.stop.set()
    if st.thread is not None:
        st.thread.join(30)
