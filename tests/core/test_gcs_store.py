"""The gs:// store (shardpoint_core.store.gcs) against a local GCS emulator
(gcp-storage-emulator, on loopback): the shipped store contract, the delimited listing the
managers use, and what the store does where the emulator drops preconditions."""
import pytest

from shardpoint_core.errors import InvalidOptionError, StoreUnavailableError
from shardpoint_core.store.registry import open_store
from shardpoint_core.store.testing import StoreTests

pytest.importorskip("google.cloud.storage")
from shardpoint_core.store.gcs import GcsOptions, GcsStore, parse_gs_url  # noqa: E402


class TestGcsStoreContract(StoreTests):
    """The shipped store contract on the emulator (conditional writes off: it ignores them,
    so ``if_absent`` is the store's check-then-write there)."""

    @pytest.fixture
    def store(self, gcs_env):
        return GcsStore.from_url(gcs_env.url(gcs_env.fresh_prefix("contract")))

    @pytest.mark.slow          # 160 requests on a pure-Python emulator
    def test_threads(self, store):
        super().test_threads(store)


def test_urls_registry_and_capabilities(gcs_env, monkeypatch):
    assert parse_gs_url("gs://b/run/step_1/") == ("b", "run/step_1")
    with pytest.raises(InvalidOptionError):
        parse_gs_url("gs:///nobucket")
    s = open_store(gcs_env.url("run"))
    assert isinstance(s, GcsStore) and s.url == gcs_env.url("run")
    assert not s.capabilities.conditional_put            # the emulator's env turns them off
    with pytest.raises(InvalidOptionError, match="conditional writes are off"):
        s.put("k", b"x", if_match="1")
    monkeypatch.delenv("SHARDPOINT_GCS_CONDITIONAL_WRITES")
    on = GcsStore.from_url("gs://b/run")                   # real GCS: on by default
    assert on.capabilities.conditional_put and on.capabilities.conditional_replace
    assert not GcsStore.from_url("gs://b", GcsOptions(conditional_writes=False)).conditional


def test_children_version_and_mtime(gcs_env):
    s = GcsStore.from_url(gcs_env.url(gcs_env.fresh_prefix("kids")))
    for k in ("step_1/m", "step_1/save-a/x", "step_2/save-b/y", "top"):
        s.put(k, [b"ab", b"c"])
    assert s.list_children("") == ["step_1", "step_2"]
    assert s.list_children("step_1/") == ["save-a"]
    a, b = s.head("top"), next(iter(s.list("top")))
    assert a.size == b.size == 3 and a.version == b.version and a.mtime > 0
    s.put("top", b"new")
    assert s.head("top").version != a.version              # a generation per write


def test_unreachable_endpoint_is_a_clear_error():
    s = GcsStore.from_url("gs://b/x", GcsOptions(endpoint_url="http://127.0.0.1:9",
                                                 retry_timeout_s=1, timeout_s=1))
    with pytest.raises(StoreUnavailableError, match="127.0.0.1:9"):
        s.get("k")
