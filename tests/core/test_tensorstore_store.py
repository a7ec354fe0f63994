"""The TensorStore byte store (shardpoint_core.stores.tensorstore) on its file, memory and s3
drivers: the shipped store contract, conditional writes through generations, sizes, errors
mapped to the core's classes, the registry's tensorstore+ schemes, and the object-store
committer's conformance scenarios (on s3 through the fault proxy in front of the tests'
moto server)."""

import contextlib
import os
import tempfile
import uuid

import pytest
from hypothesis import settings

pytest.importorskip("tensorstore")

from shardpoint_conformance.commit_faults import SCENARIOS, Rig  # noqa: E402
from shardpoint_core.commit.object_store import ObjectStoreCommitter  # noqa: E402
from shardpoint_core.format.errors import (
    InvalidOptionError,
    StoreNotFoundError,  # noqa: E402
    StoreUnavailableError,
)
from shardpoint_core.stores.registry import open_store  # noqa: E402
from shardpoint_core.stores.tensorstore import (
    NO_VALUE,
    TensorStoreOptions,  # noqa: E402
    TensorStoreStore,
    parse_url,
)
from shardpoint_core.stores.testing import StoreStateMachine, StoreTests  # noqa: E402
from shardpoint_testing.probes import pause_lease  # noqa: E402


class TestTensorStoreFile(StoreTests):
    @pytest.fixture
    def store(self, tmp_path):
        return TensorStoreStore(str(tmp_path / "root"))


class TestTensorStoreFileNoSync(StoreTests):
    """Writes not synced one by one; ``make_durable`` fsyncs what was put."""

    @pytest.fixture
    def store(self, tmp_path):
        return TensorStoreStore(str(tmp_path), TensorStoreOptions(file_sync=False))


class TestTensorStoreMemory(StoreTests):
    @pytest.fixture
    def store(self):
        name = f"c{uuid.uuid4().hex[:8]}"
        yield TensorStoreStore(f"memory://{name}/run/step_1")
        TensorStoreStore.drop(name)


class TestTensorStoreS3(StoreTests):
    """The contract on the tests' moto server, through TensorStore's own S3 client."""

    @pytest.fixture
    def store(self, s3_env):
        return TensorStoreStore(s3_env.url(s3_env.fresh_prefix("tsc")))


def _fresh_memory() -> TensorStoreStore:
    return TensorStoreStore(f"memory://m{uuid.uuid4().hex[:8]}")


_TMP = tempfile.TemporaryDirectory(prefix="sp-ts-model-")


def _fresh_file() -> TensorStoreStore:
    return TensorStoreStore(tempfile.mkdtemp(dir=_TMP.name))


# The stateful model (random puts, conditional puts, deletes, reads against a dict).
TestTensorStoreMemoryModel = StoreStateMachine.for_store(_fresh_memory).TestCase
TestTensorStoreMemoryModel.settings = settings(
    max_examples=30, stateful_step_count=30, deadline=None
)
TestTensorStoreFileModel = StoreStateMachine.for_store(_fresh_file).TestCase
TestTensorStoreFileModel.settings = settings(max_examples=15, stateful_step_count=20, deadline=None)


@pytest.fixture(params=["file", "memory", "s3"])
def any_store(request, tmp_path):
    if request.param == "file":
        return TensorStoreStore(f"file://{tmp_path}")
    if request.param == "memory":
        return TensorStoreStore(f"memory://v{uuid.uuid4().hex[:8]}")
    env = request.getfixturevalue("s3_env")
    return TensorStoreStore(env.url(env.fresh_prefix("tsv")))


def test_generations_are_versions(any_store):
    """if_absent writes once; if_match replaces only the version one saw; head, put and
    get_versioned name the same version of the same bytes."""
    s = any_store
    assert s.capabilities.conditional_put and s.capabilities.conditional_replace
    v1 = s.put("m", b"one", if_absent=True)
    with pytest.raises(FileExistsError):
        s.put("m", b"two", if_absent=True)
    assert s.head("m").version == v1
    v2 = s.put("m", b"two", if_match=v1)
    with pytest.raises(FileExistsError):
        s.put("m", b"three", if_match=v1)  # someone replaced it meanwhile
    with pytest.raises(FileExistsError):
        s.put("m", b"three", if_match="not-a-version")
    data, info = s.get_versioned("m", 100)
    assert (data, info.version, info.size) == (b"two", v2, 3) and v2 != v1
    data, info = s.get_versioned("m", 2)  # longer than asked: bytes cut, size whole
    assert (data, info.size) == (b"tw", 3)
    with pytest.raises(FileNotFoundError):
        s.put("never", b"x", if_match=v1)
    with pytest.raises(FileNotFoundError):
        s.get_versioned("never", 10)


def test_sizes_without_reading_the_object(any_store):
    """head and list know an object's size from one request that does not carry its bytes
    (a stat, or the refusal of a read past its end): pinned here, so a TensorStore whose
    refusal no longer names the size fails this test instead of reading whole objects."""
    s = any_store
    s.put("big", os.urandom(300_000))
    s.put("e", b"")
    if s.driver != "file":
        assert s._size("big") == 300_000
        got = s.kv.read("big", byte_range=slice(1 << 62, None))
        with pytest.raises(ValueError, match="300000"):
            got.result()
    assert s.head("big").size == 300_000 and s.head("e").size == 0
    assert [(i.key, i.size) for i in s.list()] == [("big", 300_000), ("e", 0)]
    r = s.kv.read("absent").result()
    assert r.state == "missing" and bytes(r.stamp.generation) == NO_VALUE


def test_urls_and_registry(tmp_path):
    assert parse_url("tensorstore+s3://b/run/x/") == ("s3", "b", "run/x")
    assert parse_url("gs://b") == ("gcs", "b", "")
    assert parse_url(str(tmp_path)) == ("file", str(tmp_path), "")
    assert parse_url("tensorstore+file://") == ("file", "/", "")
    for bad in ("s3://b/a/../c", "memory:///x", "http://h/x", "file://rel/x"):
        with pytest.raises(InvalidOptionError):
            parse_url(bad)
    s = open_store(f"tensorstore+file://{tmp_path}")
    assert isinstance(s, TensorStoreStore) and s.driver == "file"
    s.put("a/b", b"x")
    assert (tmp_path / "a" / "b").read_bytes() == b"x"  # plain files, readable by anyone
    m = open_store("tensorstore+memory://reg/p")
    m.put("k", b"v")
    assert open_store("tensorstore+memory://reg").get("p/k") == b"v"  # one named store
    TensorStoreStore.drop("reg")
    with pytest.raises(InvalidOptionError):
        TensorStoreOptions(max_retries=0)


def test_checkpoints_through_the_tensorstore_schemes(tmp_path, s3_env):
    """sp.save and sp.load (and a manager) on tensorstore+memory/file/s3 paths, bit for bit;
    a checkpoint written through TensorStore's file driver loads from the plain path, and
    one written by FileStore loads through TensorStore."""
    torch = pytest.importorskip("torch")
    import shardpoint as sp

    state = {
        "w": torch.arange(1000, dtype=torch.float32).reshape(10, 100),
        "b": torch.ones(3, dtype=torch.bfloat16),
        "step": 7,
    }
    name = f"e{uuid.uuid4().hex[:8]}"
    for run in (
        f"tensorstore+memory://{name}/run",
        f"tensorstore+file://{tmp_path}/run",
        "tensorstore+" + s3_env.url(s3_env.fresh_prefix("tse2e")),
    ):
        sp.save(state, f"{run}/x")
        got = sp.load(f"{run}/x")
        assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
        assert got["step"] == 7
        m = sp.CheckpointManager(run, max_to_keep=1)
        m.save(1, state)
        m.save(2, state)
        assert m.all_steps() == [2] and torch.equal(m.load(2)["w"], state["w"])
    TensorStoreStore.drop(name)
    assert torch.equal(sp.load(str(tmp_path / "run" / "x"))["w"], state["w"])
    sp.save(state, str(tmp_path / "plain"))
    assert torch.equal(sp.load(f"tensorstore+file://{tmp_path}/plain")["w"], state["w"])


def test_s3_errors_are_the_cores(s3_env):
    """A missing bucket, an unreachable endpoint: the core's classes, in bounded time."""
    gone = TensorStoreStore("s3://no-such-bucket-here/x")
    with pytest.raises(StoreNotFoundError, match="no-such-bucket-here"):
        gone.put("k", b"x")
    dead = TensorStoreStore(
        s3_env.url("x"),
        TensorStoreOptions(endpoint_url="http://127.0.0.1:9", max_retries=2, timeout_s=30),
    )
    with pytest.raises(StoreUnavailableError):
        dead.get("k")
    off = TensorStoreStore(s3_env.url("x"), TensorStoreOptions(conditional_writes=False))
    assert not off.capabilities.conditional_put
    with pytest.raises(InvalidOptionError):
        off.put("k", b"x", if_absent=True)


def test_s3_conditional_write_is_one_atomic_request(s3_env):
    """A conditional put is one PUT carrying the condition (If-None-Match / If-Match), not
    TensorStore's non-AWS default of a HEAD before the PUT (a race between the two lets two
    saves both commit)."""
    from shardpoint_testing.s3 import FaultProxy

    url = s3_env.url(s3_env.fresh_prefix("tsone"))
    seen = []
    with FaultProxy(s3_env, lambda m, p, n: seen.append(m)) as proxy:
        s = TensorStoreStore(url, TensorStoreOptions(endpoint_url=proxy.endpoint))
        v = s.put("k", b"1", if_absent=True)
        s.put("k", b"2", if_match=v)
        assert seen == ["PUT", "PUT"]
        with pytest.raises(FileExistsError):
            s.put("k", b"3", if_absent=True)
        assert seen == ["PUT"] * 3 and s.get("k") == b"2"


def test_refusals_and_stalls_are_the_cores(tmp_path):
    """What TensorStore refuses before a request starts (a bucket name S3 forbids, a key its
    file driver reserves) and a server that accepts connections and never answers: the
    core's classes, never a raw ValueError, and the stall within ``timeout_s``."""
    from shardpoint_core.format.errors import InvalidKeyError

    with pytest.raises(InvalidOptionError, match="bucket name"):
        TensorStoreStore("s3://b/x").get("k")
    with pytest.raises(InvalidKeyError, match="a.__lock"):
        TensorStoreStore(str(tmp_path)).put("a.__lock", b"x")
    import socket

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        s = TensorStoreStore(
            "s3://bucket-x/x",
            TensorStoreOptions(
                endpoint_url=f"http://127.0.0.1:{srv.getsockname()[1]}",
                timeout_s=0.3,
                max_retries=1,
            ),
        )
        for call in (
            lambda: s.get("k"),
            lambda: s.put("k", b"x"),
            lambda: list(s.list()),
            lambda: s.delete(["k"]),
            lambda: s.head("k"),
        ):
            with pytest.raises(StoreUnavailableError, match="no answer within 0.3 s"):
                call()


def test_file_errors_keep_errno(tmp_path):
    s = TensorStoreStore(str(tmp_path))
    s.put("d/x", b"1")
    with pytest.raises(OSError) as e:  # a key that is a directory of others
        s.put("d", b"2")
    assert not isinstance(e.value, (FileExistsError, FileNotFoundError)) and e.value.errno
    assert "tensorstore" not in type(e.value).__module__


# -- the object-store committer on TensorStore ----------------------------------------------
@pytest.fixture
def ts_s3_rig(s3_env):
    from shardpoint_testing.s3 import FaultProxy

    url = s3_env.url(s3_env.fresh_prefix("tsconf"))

    @contextlib.contextmanager
    def faulty(rule):
        with FaultProxy(s3_env, rule) as proxy:
            yield TensorStoreStore(
                url, TensorStoreOptions(endpoint_url=proxy.endpoint, max_retries=3)
            )

    return Rig(TensorStoreStore(url), faulty, ObjectStoreCommitter, pause_lease)


@pytest.mark.parametrize(
    "scenario",
    [
        pytest.param(n, marks=pytest.mark.slow) if n == "lost_reply" else n  # 8 saves, ~11 s:
        for n in sorted(SCENARIOS)
    ],
)  # one runs below
def test_commit_faults_on_tensorstore_s3(ts_s3_rig, scenario):
    SCENARIOS[scenario](ts_s3_rig)


def test_lost_reply_to_the_marker_on_tensorstore_s3(ts_s3_rig):
    """The fast variant of ``lost_reply``: the marker's PUT is applied and its connection
    dropped; TensorStore retries, the retry's If-None-Match gets 412 for the save's own
    marker, and the save still reports success with its checkpoint whole [SP-COMMIT-17]."""
    from shardpoint_conformance import commit_faults as cf

    rig = ts_s3_rig
    t = f"cf-{uuid.uuid4().hex[:10]}/t"
    with rig.faulty(cf._once(cf._upload(t, "manifest.msgpack", 2), cf.LOST_REPLY)) as store:
        c = rig.committer(store)
        staging, m = cf.stage(rig.store, c, t, "new")
        c.publish(staging, t, overwrite=False, manifest=m)
    assert cf.read(rig.store, t) == "new"


@pytest.fixture(params=["file", "memory"])
def ts_local_rig(request, tmp_path):
    store = (
        TensorStoreStore(str(tmp_path))
        if request.param == "file"
        else TensorStoreStore(f"memory://r{uuid.uuid4().hex[:8]}")
    )

    @contextlib.contextmanager
    def faulty(rule):
        pytest.skip("no proxy can lose a reply of the file or memory driver: lost_reply runs on s3")
        yield store

    return Rig(store, faulty, ObjectStoreCommitter, pause_lease)


@pytest.mark.parametrize("scenario", sorted(set(SCENARIOS) - {"lost_reply"}))
def test_commit_faults_on_tensorstore_local(ts_local_rig, scenario):
    SCENARIOS[scenario](ts_local_rig)


@pytest.mark.skip(
    reason="TensorStore's gcs driver against gcp-storage-emulator: the emulator "
    "ignores ifGenerationMatch (no atomic conditional write to test), returns no "
    "generation with a download (TensorStore reads generation 0 for every "
    "object) and answers a read past the end with a malformed Content-Range; "
    "the driver is exercised on file, memory and s3 here"
)
def test_gcs_driver_on_the_emulator():
    """Placeholder naming why the gcs driver is not tested here."""
