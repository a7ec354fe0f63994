"""The memory tier's store (``shm://``): the byte-store contract alone and replicated to a
peer host over the real side channel (two "hosts" are two shared-memory roots, each served
by a real TCP server), the crc32c check of every copy, the memory budget, and the errors a
lost peer gives."""

from __future__ import annotations

import os

import pytest

from shardpoint_core.format.errors import (
    InvalidOptionError,
    MemoryBudgetError,
    StoreUnavailableError,
)
from shardpoint_core.stores.peers import PeerClient, PeerServer
from shardpoint_core.stores.shm import SIDECAR, PeerHost, ShmStore
from shardpoint_core.stores.testing import StoreTests

TOKEN = "t" * 32


class _Pair:
    """Two hosts, each a ShmStore below its own root and a server; ``a`` replicates to ``b``
    (k=1) and ``b`` to ``a``."""

    def __init__(self, root: str, k: int = 1) -> None:
        self.a = ShmStore(os.path.join(root, "ha", "job"), name="job", host="ha")
        self.b = ShmStore(os.path.join(root, "hb", "job"), name="job", host="hb")
        self.sa = PeerServer(self.a.handle, TOKEN)
        self.sb = PeerServer(self.b.handle, TOKEN)
        self.a.set_peers([PeerHost("hb", [PeerClient(self.sb.address, TOKEN)])], k)
        self.b.set_peers([PeerHost("ha", [PeerClient(self.sa.address, TOKEN)])], k)

    def close(self) -> None:
        self.a.clear_peers()
        self.b.clear_peers()
        self.sa.close()
        self.sb.close()


class TestShmStoreContract(StoreTests):
    @pytest.fixture
    def store(self, tmp_path):
        return ShmStore(str(tmp_path / "job"), name="job")


class TestReplicatedShmStoreContract(StoreTests):
    """The whole contract through a store whose every put is replicated to another host."""

    @pytest.fixture
    def store(self, tmp_path):
        pair = _Pair(str(tmp_path))
        yield pair.a
        pair.close()


@pytest.fixture
def pair(tmp_path):
    p = _Pair(str(tmp_path))
    yield p
    p.close()


def test_put_is_on_both_hosts_and_survives_the_writer_host(pair):
    pair.a.put("step_1/x/c/0", [b"abc", bytearray(b"def")])
    assert pair.b.local_get("step_1/x/c/0") == (b"abcdef", pair.a.local_get("step_1/x/c/0")[1])
    pair.a.local_delete(["step_1/x/c/0"])  # host a lost its copy
    assert pair.a.get("step_1/x/c/0") == b"abcdef"  # read from b, kept here again
    assert pair.a.local_get("step_1/x/c/0")[0] == b"abcdef"
    assert pair.a.counters == {"replica_bytes_sent": 6, "fetched_bytes": 6}


def test_a_damaged_copy_is_never_returned_the_next_host_serves(pair):
    pair.a.put("k/obj", b"0123456789" * 100)
    path = pair.a.path("k/obj")
    with open(path, "r+b") as f:  # flip one byte of a's copy
        f.seek(500)
        b = f.read(1)
        f.seek(500)
        f.write(bytes([b[0] ^ 1]))
    assert pair.a.get("k/obj") == b"0123456789" * 100
    assert pair.a.get_range("k/obj", 10, 5) == b"01234"
    with open(pair.b.path("k/obj"), "r+b") as f:  # now b's copy too, and a's again
        f.seek(3)
        f.write(b"X")
    with open(path, "r+b") as f:
        f.seek(3)
        f.write(b"Y")
    pair.a._verified.clear()
    with pytest.raises(FileNotFoundError, match="no intact copy"):
        pair.a.get("k/obj")


def test_version_is_the_same_on_every_copy(pair):
    pair.a.put("v", b"payload")
    assert pair.a.head("v").version == pair.b.head("v").version
    pair.a.local_delete(["v"])
    assert pair.a.head("v").version == pair.b.local_info("v").version  # from the peer


def test_list_and_delete_span_hosts(pair):
    pair.a.put("s/1", b"a")
    pair.b.local_put("s/2", [memoryview(b"b")], __import__("crc32c").crc32c(b"b"))
    assert [i.key for i in pair.a.list("s/")] == ["s/1", "s/2"]
    pair.a.delete(["s/1", "s/2"])
    assert list(pair.a.list("s/")) == [] and list(pair.b.list("s/")) == []


def test_budget_refuses_before_writing(tmp_path):
    s = ShmStore(str(tmp_path / "job"), name="job", budget_bytes=100, host="h0")
    s.put("a", b"x" * 60)
    with pytest.raises(MemoryBudgetError, match="over the budget of 100"):
        s.put("b", b"x" * 60)
    assert s.head("b") is None
    assert not os.listdir(s._tmp)  # no partial file left either
    s.put("a", b"y" * 90)  # replacing counts the old one out
    s.delete(["a"])
    s.put("b", b"x" * 100)


def test_budget_of_the_replica_host_fails_the_put(tmp_path):
    p = _Pair(str(tmp_path))
    try:
        p.b.configure(budget_bytes=10)
        with pytest.raises(MemoryBudgetError, match="hb"):
            p.a.put("big", b"z" * 20)
    finally:
        p.close()


def test_a_lost_peer_fails_the_put(tmp_path):
    p = _Pair(str(tmp_path))
    p.sb.close()
    try:
        with pytest.raises(StoreUnavailableError, match="not committed"):
            p.a.put("x", b"1")
        assert p.a.get("x") == b"1"  # the local copy; reads of what is here still work
    finally:
        p.close()


def test_k_cannot_exceed_other_hosts(tmp_path):
    s = ShmStore(str(tmp_path / "job"))
    s.set_peers([], 1)  # a job restarted on one host: reads work, puts do not
    with pytest.raises(InvalidOptionError, match="k=1 replicas on other hosts"):
        s.put("a", b"x")
    assert s.head("a") is None


def test_a_stranger_without_the_token_is_refused(pair):
    c = PeerClient(pair.sb.address, "wrong")
    resp, _ = c.request({"op": "get", "key": "x"})
    assert resp["status"] == "error" and "token" in resp["msg"]
    c.close()


def test_the_file_holds_the_object_exactly_and_its_crc_is_beside_it(tmp_path):
    s = ShmStore(str(tmp_path / "job"))
    s.put("a/b", b"abc")
    assert open(s.path("a/b"), "rb").read() == b"abc"  # a step is a plain checkpoint dir
    assert SIDECAR.unpack(open(s.crc_path("a/b"), "rb").read()) == (
        __import__("crc32c").crc32c(b"abc"),
        3,
    )
    assert not s.crc_path("a/b").startswith(s.root + os.sep)
    s.delete(["a/b"])
    assert not os.path.exists(os.path.dirname(s.crc_path("a/b")))
    assert os.listdir(s.root) == []


def test_a_copy_without_its_sidecar_is_not_trusted(pair):
    pair.a.put("k", b"data")
    os.unlink(pair.a.crc_path("k"))
    assert pair.a.local_info("k") is None
    assert pair.a.get("k") == b"data"  # b's copy, kept here again with a sidecar
    assert pair.a.verify_local("k")


def test_a_closed_server_answers_no_kept_connection_either(tmp_path):
    p = _Pair(str(tmp_path))
    try:
        p.a.put("x", b"1")  # a connection to b is now kept open
        p.sb.close()
        with pytest.raises(StoreUnavailableError):
            p.a.put("y", b"2")
    finally:
        p.close()


def test_temporary_files_of_dead_writers_are_cleaned_live_ones_kept(tmp_path):
    import subprocess

    s = ShmStore(str(tmp_path / "job"))
    os.makedirs(s._tmp)
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    for name in (f"{dead.pid}-1-0", f"{os.getpid()}-1-0", f"{os.getppid()}-1-0", "other"):
        open(os.path.join(s._tmp, name), "wb").close()
    assert s.clean_tmp() == [f"{dead.pid}-1-0"]
    assert sorted(os.listdir(s._tmp)) == sorted(
        [f"{os.getpid()}-1-0", f"{os.getppid()}-1-0", "other"]
    )
