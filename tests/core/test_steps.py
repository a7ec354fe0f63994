"""StepRoot (shardpoint_core.commit.steps), what both managers do to their root, on an
object store without a server (memory://, the object-store commit of format.md 9.1): committed
steps listed through the store, removal through the committer (marker first, then the objects
it named), and the clean-up's age rule for unnamed save prefixes ([SP-COMMIT-15])."""

import time
import uuid

import pytest

from shardpoint_core.commit.object_store import ObjectStoreCommitter
from shardpoint_core.commit.steps import StepRoot
from shardpoint_core.format.errors import UnsupportedStoreError
from shardpoint_core.format.manifest import Manifest, TensorEntry, encode_manifest
from shardpoint_core.stores.memory import MemoryStore
from shardpoint_testing.probes import crashed_save


def commit_step(store, step, token):
    """A save of ``step`` staged and published, as a save job does (one tensor)."""
    c = ObjectStoreCommitter(store)
    target = f"run/step_{step:08d}"
    staging = c.begin(target, token)
    store.put(f"{staging}/tensors/w/zarr.json", b"{}")
    store.put(f"{staging}/tensors/w/c/0", b"x")
    m = Manifest(
        wire_tree={"dict": [["w", {"tensor": "w"}]]},
        objects={},
        tensors={"w": TensorEntry("w", "tensors/w", (1,), "uint8", (1,))},
    )
    store.put(f"{staging}/manifest.msgpack", encode_manifest(m))
    c.publish(staging, target, overwrite=False)


def test_steps_on_an_object_store():
    name = f"steps{uuid.uuid4().hex[:8]}"
    store = MemoryStore.named(name)
    for step, token in ((1, "a" * 12), (2, "b" * 12), (3, "c" * 12)):
        commit_step(store, step, token)
    crashed_save(
        store, "run/step_00000004/save-dddddddddddd", {"tensors/w/c/0": b"running"}, lease_s=120
    )  # a live save: its lease is fresh
    store.put("run/notes.txt", b"not a step")
    root = StepRoot(f"memory://{name}/run")
    assert root.path(4) == f"memory://{name}/run/step_00000004"
    assert root.all_steps() == [1, 2, 3]
    assert root.remove(1) and not root.remove(1)  # gone: nothing to do
    assert root.all_steps() == [2, 3]
    assert not [i.key for i in store.list("run/step_00000001/")]  # marker and objects
    assert root.clean_leftovers() == []  # the live save is recent
    assert root.clean_leftovers(min_age_s=0) == []  # and its lease is live
    later = time.time() + 3600
    assert root.clean_leftovers(now=later) == [
        f"memory://{name}/run/step_00000004/save-dddddddddddd"
    ]
    assert root.all_steps() == [2, 3] and store.get("run/notes.txt") == b"not a step"
    assert {i.key.split("/")[1] for i in store.list("run/step")} == {
        "step_00000002",
        "step_00000003",
    }


def test_unregistered_scheme_refused():
    with pytest.raises(UnsupportedStoreError):
        StepRoot("nostore://b/run")


def test_local_root_with_its_own_committer(tmp_path):
    from shardpoint_core.commit.posix import PosixCommitter

    c = PosixCommitter()
    root = StepRoot(str(tmp_path / "run"), local_committer=c)
    assert root.committer is c and root.all_steps() == [] and root.clean_leftovers() == []
    assert root.path(3) == str(tmp_path / "run" / "step_00000003")
