"""Stores chosen from the path: plain paths and file:// are local files, memory://name a
memory store, other schemes whatever was registered; a scheme nobody registered is refused
by every entry point (sp.save sync and async, sp.load, sp.open, both managers,
shardpoint_jax, the CLI) before any I/O, and never becomes a local directory 'nostore:'."""

from __future__ import annotations

import os

import numpy as np
import pytest

from shardpoint_core.format.errors import ShardpointError, UnsupportedStoreError
from shardpoint_core.stores import (
    FileStore,
    MemoryStore,
    check_path,
    is_local,
    local_path,
    open_store,
    register_store,
    registered_schemes,
    unregister_store,
)
from shardpoint_core.stores.registry import split_url
from shardpoint_testing.launch import run_world

URL = "nostore://bucket/run/step_5"  # a scheme nobody registers


def _refused(excinfo, scheme="nostore://"):
    msg = str(excinfo.value)
    assert isinstance(excinfo.value, ShardpointError)
    assert repr(scheme) in msg and "registered: file://, gs://, memory://, s3://" in msg, msg


def test_split_url():
    assert split_url("gs://b/k") == ("gs", "b/k")
    assert split_url("GS://b/k") == ("gs", "b/k")
    assert split_url("/a/b") == (None, "/a/b")
    assert split_url("a:b/c") == (None, "a:b/c")  # a colon alone makes no URL
    assert split_url("file:///x") == ("file", "/x")


def test_local_paths_and_file_urls(tmp_path):
    assert local_path("rel/ck", "save") == "rel/ck"
    assert local_path(tmp_path, "save") == str(tmp_path)
    assert local_path(f"file://{tmp_path}/ck", "save") == f"{tmp_path}/ck"
    assert local_path("file://localhost/x/y", "save") == "/x/y"
    with pytest.raises(UnsupportedStoreError, match="absolute path"):
        local_path("file://rel/x", "save")
    assert is_local("x") and is_local("file:///x") and not is_local("memory://a/b")
    assert isinstance(open_store(str(tmp_path)), FileStore)
    assert open_store(f"file://{tmp_path}").root == str(tmp_path)


def test_unregistered_scheme_is_refused_naming_it_and_the_registered_ones():
    for call in (
        lambda: local_path(URL, "save"),
        lambda: open_store(URL),
        lambda: check_path(URL, "load"),
    ):
        with pytest.raises(UnsupportedStoreError) as e:
            call()
        _refused(e)
    assert isinstance(UnsupportedStoreError("x"), ValueError)


def test_registered_store_but_local_only_operation():
    with pytest.raises(UnsupportedStoreError, match="memory:// store.*local files"):
        local_path("memory://n/ck", "inspect")


def test_memory_urls_share_one_named_store():
    try:
        a = open_store("memory://reg/run/step_1")
        a.put("manifest.msgpack", b"m")
        assert isinstance(a, MemoryStore)
        assert open_store("memory://reg/run").get("step_1/manifest.msgpack") == b"m"
        with pytest.raises(UnsupportedStoreError):
            open_store("memory:///x")
    finally:
        MemoryStore.drop("reg")


def test_register_store():
    made = []

    def factory(url):
        made.append(url)
        return MemoryStore()

    register_store("Test+x", factory)
    try:
        assert "test+x" in registered_schemes()
        assert isinstance(open_store("test+x://b/k"), MemoryStore) and made == ["test+x://b/k"]
        check_path("TEST+X://b", "save")
        with pytest.raises(ValueError, match="already registered"):
            register_store("test+x", lambda url: MemoryStore())
        register_store("test+x", lambda url: MemoryStore(), replace=True)
        with pytest.raises(ValueError, match="built in"):
            register_store("file", factory)
        with pytest.raises(ValueError, match="not a URL scheme"):
            register_store("9p", factory)
    finally:
        unregister_store("test+x")
    with pytest.raises(UnsupportedStoreError):
        open_store("test+x://b/k")


def test_torch_entry_points_refuse(tmp_path, monkeypatch):
    import shardpoint as sp

    monkeypatch.chdir(tmp_path)
    state = {"w": np.arange(4, dtype=np.float32)}
    for call in (
        lambda: sp.save(state, URL),
        lambda: sp.load(URL),
        lambda: sp.open(URL),
        lambda: sp.read_metadata(URL),
        lambda: sp.CheckpointManager("nostore://b/run"),
        lambda: sp.recover(URL),
        lambda: sp.verify.verify_checkpoint(URL),
    ):
        with pytest.raises(sp.UnsupportedStoreError) as e:
            call()
        _refused(e)
    assert os.listdir(tmp_path) == []  # no local 'nostore:' directory
    sp.save(state, f"file://{tmp_path}/ck")  # file:// is a local path
    assert np.array_equal(sp.load(str(tmp_path / "ck"))["w"], state["w"])
    assert np.array_equal(sp.load(f"file://{tmp_path}/ck")["w"], state["w"])


def _save_s3_two_ranks(rank, world, cwd):
    import shardpoint as sp

    os.chdir(cwd)
    out = []
    for async_save in (False, True):
        try:
            sp.save({"w": np.ones(4, np.float32)}, URL, async_save=async_save)
            out.append("saved")
        except sp.UnsupportedStoreError as e:
            out.append(str(e))
    return out


@pytest.mark.slow  # two spawned torch processes: ~10 s idle, 30 s on a loaded machine
def test_two_rank_save_to_unregistered_scheme_writes_nothing(tmp_path):
    res = run_world(2, _save_s3_two_ranks, str(tmp_path), timeout=120)
    for per_rank in res:
        assert len(per_rank) == 2 and all("'nostore://'" in m for m in per_rank), per_rank
    assert os.listdir(tmp_path) == []


def test_jax_entry_points_refuse(tmp_path, monkeypatch):
    pytest.importorskip("jax")
    import shardpoint_jax as spj

    monkeypatch.chdir(tmp_path)
    for call in (
        lambda: spj.save(URL, {"w": np.zeros(2, np.float32)}),
        lambda: spj.load(URL),
        lambda: spj.CheckpointManager("nostore://b/run"),
    ):
        with pytest.raises(UnsupportedStoreError) as e:
            call()
        _refused(e)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "argv", [["inspect", URL], ["verify", URL], ["recover", URL], ["diff", URL, "/nonexistent"]]
)
def test_cli_refuses(argv, capsys, tmp_path, monkeypatch):
    from shardpoint.tools.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "UnsupportedStoreError" in err and "'nostore://'" in err and "registered" in err, err
    assert os.listdir(tmp_path) == []
