"""The byte stores pass the store contract (shardpoint_core.stores.testing), the stateful model
test against a dict included; FileStore's own behaviour on disk."""

from __future__ import annotations

import itertools
import os
import tempfile

import pytest
from hypothesis import settings

from shardpoint_core.stores import FileStore, MemoryStore
from shardpoint_core.stores.testing import StoreStateMachine, StoreTests


class TestFileStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path):
        return FileStore(str(tmp_path / "root"), create=True)


class TestFileStoreFsyncEach(StoreTests):
    @pytest.fixture
    def store(self, tmp_path):
        return FileStore(str(tmp_path), sync_method="fsync")


class TestMemoryStore(StoreTests):
    @pytest.fixture
    def store(self):
        return MemoryStore()


class TestNamedMemoryStoreView(StoreTests):
    @pytest.fixture
    def store(self):
        yield MemoryStore.named("contract", prefix="run/step_1")
        MemoryStore.drop("contract")


_TMP = tempfile.TemporaryDirectory(prefix="sp-store-model-")
_N = itertools.count()

TestFileStoreModel = StoreStateMachine.for_store(
    lambda: FileStore(os.path.join(_TMP.name, str(next(_N))), create=True)
).TestCase
TestFileStoreModel.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)
TestMemoryStoreModel = StoreStateMachine.for_store(MemoryStore).TestCase
TestMemoryStoreModel.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


def test_file_store_keys_are_files_below_root(tmp_path):
    s = FileStore(str(tmp_path))
    s.put("tensors/w/c/0/1", [b"ab", b"cd"])
    assert (tmp_path / "tensors" / "w" / "c" / "0" / "1").read_bytes() == b"abcd"
    assert s.path("a/b") == os.path.join(str(tmp_path), "a", "b")
    assert s.url == "file://" + str(tmp_path)


def test_file_store_never_recreates_its_root(tmp_path):
    """A writer outliving an aborted save fails instead of bringing its staging back."""
    s = FileStore(str(tmp_path / "staging"), create=True)
    s.put("a/b", b"1")
    import shutil

    shutil.rmtree(tmp_path / "staging")
    with pytest.raises(FileNotFoundError):
        s.put("c/d", b"2")
    assert not (tmp_path / "staging").exists()


def test_file_store_delete_prunes_empty_directories(tmp_path):
    s = FileStore(str(tmp_path))
    s.put("x/y/z", b"1")
    s.delete(["x/y/z"])
    assert os.listdir(tmp_path) == []


def test_file_store_lists_regular_files_only(tmp_path):
    s = FileStore(str(tmp_path))
    s.put("a/f", b"1")
    os.symlink("/etc/passwd", tmp_path / "a" / "link")
    assert [i.key for i in s.list()] == ["a/f"]
    assert s.head("a/link") is None
    with pytest.raises(FileNotFoundError):
        s.get("a/link")


def test_file_store_make_durable_without_fsync_is_free(tmp_path):
    s = FileStore(str(tmp_path), fsync=False)
    s.put("a", b"1")
    s.make_durable()
    assert s.get("a") == b"1"


def test_file_store_make_durable_below_syncs_the_trees_and_their_parents(tmp_path):
    """What a fast path wrote itself below a key (an array's chunk files) is fsync'd, with
    every directory up to the root: here 2 files, their 3 directories, ``t`` and the root."""
    s = FileStore(str(tmp_path), sync_method="fsync")
    s.put("t/a/c/0", b"x")
    s.put("t/a/c/1/0", b"y")
    assert s.make_durable_below(["t/a"]) == 2 + 3 + 2
    assert FileStore(str(tmp_path), fsync=False).make_durable_below(["t/a"]) == 0


def test_file_store_full_disk_names_the_file(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    s = FileStore(str(tmp_path))
    os.symlink("/dev/full", tmp_path / "full")
    with pytest.raises(OSError) as e:
        s.put("full", b"x" * 10)
    assert e.value.filename and "full" in e.value.filename


def test_memory_named_views_share_objects():
    try:
        a = MemoryStore.named("shared", prefix="run")
        b = MemoryStore.named("shared")
        a.put("step/k", b"1")
        assert b.get("run/step/k") == b"1"
        assert [i.key for i in a.child("step").list()] == ["k"]
        assert a.url == "memory://shared/run"
    finally:
        MemoryStore.drop("shared")
    assert MemoryStore.named("shared").head("run/step/k") is None
    MemoryStore.drop("shared")
