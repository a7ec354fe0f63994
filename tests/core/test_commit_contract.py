"""The shipped committer contract (shardpoint_core.commit.testing.CommitterTests) on every
committer of the project: rename on local files, the marker protocol on memory://, over
TensorStore's memory kvstore, on the real local S3 server and on the GCS emulator (with
--runslow), and the router (PathCommitter) on local paths and on URLs. Same situations, same behaviour, same error classes."""

import uuid

import pytest

from shardpoint_core.commit.lease import stop_lease
from shardpoint_core.commit.object_store import ObjectStoreCommitter
from shardpoint_core.commit.posix import PosixCommitter
from shardpoint_core.commit.routing import PathCommitter, UrlCommitter
from shardpoint_core.commit.testing import CommitterTests, FileSite, StoreSite
from shardpoint_core.stores.location import locate
from shardpoint_core.stores.memory import MemoryStore
from shardpoint_core.stores.registry import is_local
from tests.docs.blocks import find


def _release_posix(committer, staging):
    committer._locks.release(staging)  # what the saving process's exit does to its flock


def _locate(url):
    return locate(url).pair()


class TestPosixCommitter(CommitterTests):
    any_replaces_other_content = True

    @pytest.fixture
    def committer(self):
        return PosixCommitter(fsync=False)

    @pytest.fixture
    def root(self, tmp_path):
        return str(tmp_path / "run")

    @pytest.fixture
    def site(self):
        return FileSite()

    def abandon(self, committer, staging):
        _release_posix(committer, staging)


class _ObjectStoreContract(CommitterTests):
    @pytest.fixture
    def committer(self, store):
        return ObjectStoreCommitter(store)

    @pytest.fixture
    def root(self):
        return "run"

    @pytest.fixture
    def site(self, store):
        return StoreSite.of(store)

    def abandon(self, committer, staging):
        stop_lease(committer.store, staging)  # no more renewals: expired by now + LATER_S


# The marker committer on memory:// is the documented example itself (how a third-party
# committer runs the contract): its class is defined here from the page and collected.
DOC = find("docs/tutorials/single-process.md", "CommitterTests")
exec(compile(DOC.code, DOC.id, "exec"), globals())


def test_the_documented_contract_example_runs_here():
    cls = globals()["TestMarkerCommitterInMemory"]
    assert issubclass(cls, CommitterTests) and cls.__module__ == __name__


class TestObjectStoreCommitterS3(_ObjectStoreContract):
    @pytest.fixture
    def store(self, s3_env):
        from shardpoint_core.stores.s3 import S3Store

        return S3Store.from_url(s3_env.url(s3_env.fresh_prefix("contract")))


@pytest.mark.slow  # the same committer as on memory:// and S3 (the default run's), on a
class TestObjectStoreCommitterGcs(_ObjectStoreContract):  # pure-Python emulator
    @pytest.fixture
    def store(self, gcs_env):
        from shardpoint_core.stores.gcs import GcsStore

        return GcsStore.from_url(gcs_env.url(gcs_env.fresh_prefix("contract")))


class TestObjectStoreCommitterTensorStoreMemory(_ObjectStoreContract):
    """The marker committer over TensorStore's memory kvstore (its generations give the
    conditional writes)."""

    @pytest.fixture
    def store(self):
        pytest.importorskip("tensorstore", reason="the tensorstore extra")
        from shardpoint_core.stores.tensorstore import TensorStoreStore

        name = f"contract{uuid.uuid4().hex[:8]}"
        yield TensorStoreStore(f"memory://{name}")
        TensorStoreStore.drop(name)


@pytest.mark.slow  # 5 s; the default run has it over TensorStore's memory kvstore
class TestObjectStoreCommitterTensorStoreS3(_ObjectStoreContract):
    """The marker committer over TensorStore's s3 kvstore, on the real local S3 server."""

    @pytest.fixture
    def store(self, s3_env):
        pytest.importorskip("tensorstore", reason="the tensorstore extra")
        from shardpoint_core.stores.tensorstore import TensorStoreStore

        return TensorStoreStore(s3_env.url(s3_env.fresh_prefix("tscontract")))


class _RouterContract(CommitterTests):
    @pytest.fixture
    def committer(self):
        return PathCommitter(PosixCommitter(fsync=False), UrlCommitter(_locate))

    def abandon(self, committer, staging):
        if is_local(staging):
            _release_posix(committer.posix, staging)
        else:
            stop_lease(*_locate(staging))


class TestPathCommitterOnFiles(_RouterContract):
    any_replaces_other_content = True

    @pytest.fixture
    def root(self, tmp_path):
        return str(tmp_path / "run")

    @pytest.fixture
    def site(self):
        return FileSite()


class TestPathCommitterOnUrls(_RouterContract):
    @pytest.fixture
    def root(self):
        name = f"contract{uuid.uuid4().hex[:8]}"
        yield f"memory://{name}/run"
        MemoryStore.drop(name)

    @pytest.fixture
    def site(self):
        return StoreSite(_locate, url=True)
