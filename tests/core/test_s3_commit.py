"""The object-store commit protocol (format.md 9.1, [SP-COMMIT-10..15]) on a real S3 server:
fresh commits, refusals, replacement, two saves racing for one path, removal, leftovers and
recovery, and kill -9 of a saving process during save and overwrite (old or new, never a mix).

A "save" here writes what a save job writes below the save prefix (a zarr.json and chunk
objects per tensor, then the staged manifest) with payloads that name the save, so a reader
can tell whether a checkpoint mixes the objects of two saves."""

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

from shardpoint_core.commit.base import Committer  # noqa: E402
from shardpoint_core.commit.lease import stop_lease  # noqa: E402
from shardpoint_core.commit.object_store import ObjectStoreCommitter  # noqa: E402
from shardpoint_core.format.errors import (
    CheckpointExistsError,  # noqa: E402
    CheckpointNotFoundError,
    IncompleteCheckpointError,
)
from shardpoint_core.format.manifest import Manifest, TensorEntry, decode_manifest  # noqa: E402
from shardpoint_core.format.manifest import encode_manifest  # noqa: E402
from shardpoint_core.stores.s3 import S3Options, S3Store  # noqa: E402

KEYS = ("a", "b", "c")


def stage(store, committer, target, label, *, token=None, tensors=KEYS):
    """Write a save's objects below its prefix, as a save job does; returns the staging key."""
    staging = committer.begin(target, token or uuid.uuid4().hex)
    for k in tensors:
        store.put(f"{staging}/tensors/{k}/zarr.json", f'{{"save": "{label}"}}'.encode())
        for c in range(2):
            store.put(f"{staging}/tensors/{k}/c/{c}", f"{label}:{k}:{c}".encode())
    tree = {"dict": [[k, {"tensor": k}] for k in tensors]}
    m = Manifest(
        wire_tree=tree,
        tensors={k: TensorEntry(k, f"tensors/{k}", (2,), "uint8", (1,)) for k in tensors},
        objects={},
    )
    store.put(f"{staging}/manifest.msgpack", encode_manifest(m))
    return staging


def read(store, target):
    """What a reader sees at ``target``: the label every object names (asserting that they
    all name the same save), following the manifest's array paths."""
    m = decode_manifest(store.get(f"{target}/manifest.msgpack"))
    labels = set()
    for e in m.tensors.values():
        labels.add(store.get(f"{target}/{e.array}/zarr.json").decode().split('"')[3])
        for c in range(2):
            labels.add(store.get(f"{target}/{e.array}/c/{c}").decode().split(":")[0])
    assert len(labels) == 1, f"checkpoint mixes saves: {labels}"
    return labels.pop()


def keys(store, target):
    return sorted(i.key[len(target) + 1 :] for i in store.list(target + "/"))


@pytest.fixture
def store(s3_env):
    return S3Store.from_url(s3_env.url(s3_env.fresh_prefix("commit")))


@pytest.fixture
def committer(store):
    return ObjectStoreCommitter(store)


def test_fresh_commit_then_refused_without_overwrite(store, committer):
    assert isinstance(committer, Committer)
    assert committer.state("step_1") == "missing"
    committer.check_target("step_1", overwrite=False)
    staging = stage(store, committer, "step_1", "one")
    assert committer.state("step_1") == "incomplete"  # [SP-COMMIT-3]: no marker yet
    committer.publish(staging, "step_1", overwrite=False)
    assert committer.state("step_1") == "committed"
    assert read(store, "step_1") == "one"
    m = decode_manifest(store.get("step_1/manifest.msgpack"))
    assert m.tensors["a"].array == f"{staging.split('/')[-1]}/tensors/a"  # [SP-COMMIT-11]
    assert m.format_version == (1, 1)  # [SP-VER-1]
    assert "manifest.msgpack" in keys(store, "step_1")
    assert f"{staging.split('/')[-1]}/manifest.msgpack" not in keys(store, "step_1")
    with pytest.raises(CheckpointExistsError, match="SP-COMMIT-5"):
        committer.check_target("step_1", overwrite=False)
    late = stage(store, committer, "step_1", "two")
    with pytest.raises(CheckpointExistsError, match="SP-COMMIT-12"):
        committer.publish(late, "step_1", overwrite=False)
    committer.abort(late)
    assert read(store, "step_1") == "one"
    assert committer.leftovers("") == []


def test_overwrite_replaces_and_deletes_only_what_it_replaced(store, committer):
    first = stage(store, committer, "s", "one")
    committer.publish(first, "s", overwrite=False)
    running = stage(store, committer, "s", "running")  # another save, not committed
    second = stage(store, committer, "s", "two")
    committer.check_target("s", overwrite=True)
    committer.publish(second, "s", overwrite=True)
    assert read(store, "s") == "two"
    left = keys(store, "s")
    assert not any(k.startswith(first.split("/")[-1]) for k in left)  # [SP-COMMIT-14]
    assert any(k.startswith(running.split("/")[-1]) for k in left)  # not ours to delete
    assert [lo.path for lo in committer.leftovers("")] == [running]


def test_two_fresh_saves_racing_one_wins(store, committer):
    """Both staged, both publish: If-None-Match lets exactly one commit ([SP-COMMIT-12])."""
    a = stage(store, committer, "r", "A")
    b = stage(store, committer, "r", "B")
    committer.publish(a, "r", overwrite=False)
    with pytest.raises(CheckpointExistsError, match="another save"):
        ObjectStoreCommitter(store).publish(b, "r", overwrite=False)
    assert read(store, "r") == "A"


def test_two_overwrites_racing_the_loser_fails(store, committer):
    """Both read the same old marker; If-Match lets the first replace it and refuses the
    second, which would otherwise orphan the first's data."""
    committer.publish(stage(store, committer, "o", "old"), "o", overwrite=False)
    a = stage(store, committer, "o", "A")
    b = stage(store, committer, "o", "B")
    real_put = store.put
    raced = []

    def put_after_a_wins(key, data, **kw):
        if key == "o/manifest.msgpack" and kw.get("if_match") and not raced:
            raced.append(1)
            committer.publish(a, "o", overwrite=True)  # A wins between B's read and PUT
        return real_put(key, data, **kw)

    store.put = put_after_a_wins
    try:
        with pytest.raises(CheckpointExistsError, match="SP-COMMIT-12"):
            committer.publish(b, "o", overwrite=True)
    finally:
        del store.put
    assert read(store, "o") == "A"


def test_without_conditional_writes_the_last_wins_never_a_mix(store):
    plain = S3Store(store.bucket, store.prefix, S3Options(conditional_writes=False))
    c = ObjectStoreCommitter(plain)
    a = stage(plain, c, "n", "A")
    b = stage(plain, c, "n", "B")
    c.publish(a, "n", overwrite=False)
    c.publish(b, "n", overwrite=True)
    assert read(plain, "n") == "B"


def test_foreign_objects_are_never_replaced(store, committer):
    store.put("u/notes.txt", b"mine")
    for overwrite in (False, True):
        with pytest.raises(CheckpointExistsError, match="SP-COMMIT-13"):
            committer.check_target("u", overwrite=overwrite)
    assert store.get("u/notes.txt") == b"mine"


def test_remove_deletes_the_marker_first_and_keeps_live_saves(store, committer):
    committer.publish(stage(store, committer, "d", "one"), "d", overwrite=False)
    live = stage(store, committer, "d", "live")
    assert committer.remove("d") is True
    assert committer.state("d") == "incomplete"
    assert all(k.startswith(live.split("/")[-1]) for k in keys(store, "d"))
    assert committer.remove("d") is False  # only a live save there: nothing, as on files
    store.put("d/notes.txt", b"user data")
    with pytest.raises(CheckpointNotFoundError):  # not a checkpoint: refused
        committer.remove("d")
    assert store.get("d/notes.txt") == b"user data"
    assert committer.remove("never-there") is False  # gone already: nothing to do


def test_missing_staged_manifest_commits_nothing(store, committer):
    staging = stage(store, committer, "x", "one")
    store.delete([f"{staging}/manifest.msgpack"])
    with pytest.raises(IncompleteCheckpointError):
        committer.publish(staging, "x", overwrite=False)
    assert committer.state("x") == "incomplete"


def crash(store, staging):
    """What a save's process dying does to its lease: nobody renews it any more."""
    assert stop_lease(store, staging) is not None


def test_leftovers_and_discard(store, committer):
    committer.publish(stage(store, committer, "runs/1", "one"), "runs/1", overwrite=False)
    crashed = stage(store, committer, "runs/1", "crashed")
    other = stage(store, committer, "runs/2", "crashed")
    crash(store, crashed)
    crash(store, other)
    found = {lo.path: lo for lo in committer.leftovers("runs")}
    assert set(found) == {crashed, other}
    assert found[crashed].target == "runs/1" and found[crashed].has_manifest
    # [SP-COMMIT-16]: just written, the lease is live: a running save, never removed
    assert found[crashed].kind == "tmp" and found[crashed].in_use is True
    assert committer.discard(crashed) is False and read(store, crashed.rpartition("/")[0])
    later = time.time() + 3600  # the lease long expired
    found = {lo.path: lo for lo in committer.leftovers("runs", now=later)}
    assert found[crashed].in_use is False
    named = decode_manifest(store.get("runs/1/manifest.msgpack")).tensors["a"].array
    with pytest.raises(CheckpointExistsError, match="SP-COMMIT-15"):
        committer.discard("runs/1/" + named.split("/")[0], now=later)
    for lo in found.values():
        assert committer.discard(lo.path, now=later)
    assert committer.leftovers("runs", now=later) == []
    assert read(store, "runs/1") == "one"
    assert committer.state("runs/2") == "missing"


SAVER = textwrap.dedent("""
    import sys, uuid
    sys.path[:0] = {paths!r}
    from shardpoint_core.commit.object_store import ObjectStoreCommitter
    from shardpoint_core.stores.s3 import S3Store
    from test_s3_commit import stage
    store = S3Store.from_url({url!r})
    c = ObjectStoreCommitter(store)
    i = 0
    while True:
        i += 1
        staging = stage(store, c, "k", f"save{{i}}", tensors=[f"t{{j}}" for j in range(4)])
        c.publish(staging, "k", overwrite=True)
        print(i, flush=True)
""")


@pytest.mark.parametrize("rounds", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_kill_9_during_save_and_overwrite_leaves_old_or_new(s3_env, rounds):
    """A process saving over one target again and again is killed with SIGKILL at random
    moments (while writing chunks, during the marker's PUT, while deleting the replaced
    objects): every time, the target holds one complete checkpoint of a single save, and
    recovery removes what the dead save left."""
    url = s3_env.url(s3_env.fresh_prefix("kill"))
    store = S3Store.from_url(url)
    here = os.path.dirname(__file__)
    code = SAVER.format(paths=[here] + sys.path, url=url)
    seen = set()
    for r in range(rounds):
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=os.environ.copy()
        )
        try:
            proc.stdout.readline()  # at least one commit happened
            time.sleep(0.05 + 0.25 * r)  # then somewhere in a later save
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
        label = read(store, "k")  # one save's objects, never a mix
        seen.add(label)
        c = ObjectStoreCommitter(store)
        later = time.time() + 3600  # the dead save's lease expired
        for lo in c.leftovers("", now=later):
            c.discard(lo.path, now=later)
        assert read(store, "k") == label
        assert all(
            k == "manifest.msgpack"
            or k.startswith(
                decode_manifest(store.get("k/manifest.msgpack")).tensors["t0"].array.split("/")[0]
            )
            for k in keys(store, "k")
        )
    assert seen
