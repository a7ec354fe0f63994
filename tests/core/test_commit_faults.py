"""A save paused for longer than recovery's patience ([SP-COMMIT-16]) on a real S3 server
(moto): the lease, the window between the check and the marker PUT, a real SIGSTOP. Lost
replies, lost races and user objects named like save prefixes are the conformance suite's
scenarios (shardpoint_conformance.commit_faults), run on S3 and GCS by
tests/conformance/test_object_store_faults.py."""

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")

from shardpoint_core.commit.lease import LEASE_NAME, stop_lease  # noqa: E402
from shardpoint_core.commit.object_store import ObjectStoreCommitter  # noqa: E402
from shardpoint_core.format.errors import SaveFailedError  # noqa: E402
from shardpoint_core.stores.s3 import S3Options, S3Store  # noqa: E402
from shardpoint_testing.probes import pause_lease  # noqa: E402
from shardpoint_testing.s3 import FaultProxy  # noqa: E402

from .test_s3_commit import keys, read, stage  # noqa: E402

LATER = 3600.0  # seconds: every lease written in a test has long expired by then


def marker_put(target):
    """A fault rule's test: the marker PUT of ``target``'s commit."""
    return lambda method, path, n: (
        method == "PUT" and path.split("?")[0].endswith(f"/{target}/manifest.msgpack")
    )


def once(test, fault):
    """A rule answering ``fault`` to the first request ``test`` accepts, forwarding the rest."""
    fired = []

    def rule(method, path, n):
        if not fired and test(method, path, n):
            fired.append(n)
            return fault
        return None

    return rule


def test_a_paused_save_whose_prefix_recovery_removed_takes_its_marker_back(s3_env):
    """A save stalls past its lease (its renewals stop: a paused process), recovery reclaims
    its lease and removes its prefix, then the save goes on to publish. Before 1.3 recovery
    removed it by age alone and the save's marker then named deleted objects, with the
    previous checkpoint deleted by the overwrite. Now the save finds its lease gone after the
    PUT, puts the previous marker back and fails; the previous checkpoint reads whole."""
    store = S3Store.from_url(s3_env.url(s3_env.fresh_prefix("pause")))
    c = ObjectStoreCommitter(store, lease_s=30)
    c.publish(stage(store, c, "t", "old"), "t", overwrite=False)
    staging = stage(store, c, "t", "paused")
    pause_lease(store, staging)  # paused: no renewal from now on
    observer = ObjectStoreCommitter(S3Store.from_url(store.url))
    found = observer.leftovers("", now=time.time() + LATER)
    assert [lo.path for lo in found] == [staging] and found[0].in_use is False
    assert observer.discard(staging, now=time.time() + LATER)
    with pytest.raises(SaveFailedError, match="SP-COMMIT-16"):
        c.publish(staging, "t", overwrite=True)
    assert read(store, "t") == "old"


def test_recovery_between_the_check_and_the_marker_put_is_undone(s3_env):
    """The narrowest window: recovery reclaims and removes a paused save's prefix after the
    save checked its lease and before its marker PUT reaches the server (the fault proxy runs
    recovery right there). The save finds its lease gone after the PUT, puts the previous
    marker back (If-Match its own) and fails; the previous checkpoint reads whole."""
    prefix = s3_env.fresh_prefix("window")
    direct = S3Store.from_url(s3_env.url(prefix))
    c0 = ObjectStoreCommitter(direct)
    c0.publish(stage(direct, c0, "t", "old"), "t", overwrite=False)
    observer = ObjectStoreCommitter(S3Store.from_url(direct.url))
    removed = []

    def rule(method, path, n):
        if marker_put("t")(method, path, n) and not removed:
            removed.extend(
                lo.path
                for lo in observer.leftovers("", now=time.time() + LATER)
                if observer.discard(lo.path, now=time.time() + LATER)
            )
        return None

    with FaultProxy(s3_env, rule) as proxy:
        store = S3Store.from_url(direct.url, S3Options(endpoint_url=proxy.endpoint))
        c = ObjectStoreCommitter(store)
        staging = stage(direct, c, "t", "paused")
        with pytest.raises(SaveFailedError, match="SP-COMMIT-16"):
            c.publish(staging, "t", overwrite=True)
    assert removed == [staging]
    assert read(direct, "t") == "old"


def test_a_live_save_is_never_removed_however_old_its_objects(s3_env):
    """A save whose objects are all old (a stalled chunk PUT) but whose lease is renewed is
    live: recovery's minimum age alone does not remove it ([SP-COMMIT-16])."""
    store = S3Store.from_url(s3_env.url(s3_env.fresh_prefix("live")))
    c = ObjectStoreCommitter(store, lease_s=2.5)  # S3 times are whole seconds
    staging = stage(store, c, "t", "slow")
    time.sleep(3.0)  # renewed (every 0.6 s) meanwhile
    observer = ObjectStoreCommitter(S3Store.from_url(store.url))
    [lo] = observer.leftovers("")
    assert lo.in_use is True
    assert observer.discard(staging) is False
    c.publish(staging, "t", overwrite=False)
    assert read(store, "t") == "slow"


PAUSED = textwrap.dedent("""
    import sys, time
    sys.path[:0] = {paths!r}
    from shardpoint_core.commit.object_store import ObjectStoreCommitter
    from shardpoint_core.format.errors import SaveFailedError
    from shardpoint_core.stores.s3 import S3Store
    from test_s3_commit import stage
    store = S3Store.from_url({url!r})
    c = ObjectStoreCommitter(store, lease_s=1.0)
    staging = stage(store, c, "t", "paused")
    print(staging, flush=True)
    sys.stdin.readline()                     # the test stops us (SIGSTOP) meanwhile
    time.sleep(0.5)                          # the renewer runs once more: the lease is gone
    try:
        c.publish(staging, "t", overwrite=True)
        print("committed", flush=True)
    except SaveFailedError as e:
        print("refused", e, flush=True)
""")


def test_sigstop_past_the_lease_then_recovery_then_resume(s3_env):
    """The real pause: a saving process is stopped with SIGSTOP, its lease expires, the
    manager's clean-up (recovery) removes its prefix, the process is continued and tries to
    publish over the previous checkpoint: it is refused, and the previous one reads whole."""
    url = s3_env.url(s3_env.fresh_prefix("sigstop"))
    store = S3Store.from_url(url)
    c = ObjectStoreCommitter(store)
    c.publish(stage(store, c, "t", "old"), "t", overwrite=False)
    here = os.path.dirname(__file__)
    proc = subprocess.Popen(
        [sys.executable, "-c", PAUSED.format(paths=[here] + sys.path, url=url)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        staging = proc.stdout.readline().strip()
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(2.5)  # past its 1 s lease, no renewal
        done = [lo.path for lo in c.leftovers("") if lo.in_use is False and c.discard(lo.path)]
        assert done == [staging]
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate("go\n", timeout=60)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
    assert out.startswith("refused") and "SP-COMMIT-16" in out, out
    assert read(store, "t") == "old"


def test_a_lease_is_the_first_object_and_a_fresh_token_is_required(s3_env):
    """The lease claims the prefix ([SP-COMMIT-16]): it is written by begin, before any rank
    writes, and a token already used is refused rather than shared."""
    store = S3Store.from_url(s3_env.url(s3_env.fresh_prefix("claim")))
    c = ObjectStoreCommitter(store)
    token = uuid.uuid4().hex
    staging = c.begin("t", token)
    assert keys(store, "t") == [f"save-{token}/{LEASE_NAME}"]
    with pytest.raises(SaveFailedError):
        c.begin("t", token)
    stop_lease(store, staging)
    c.abort(staging)
    assert keys(store, "t") == []
