"""The gs:// store (shardpoint_core.stores.gcs) against a local GCS emulator
(gcp-storage-emulator, on loopback): the shipped store contract, the delimited listing the
managers use, and what the store does where the emulator drops preconditions; then the
conditional mode (GCS's generation preconditions) through a proxy that enforces them
(shardpoint_testing.gcs.PreconditionProxy): the contract again, a stale replacement refused,
and the object-store commit's race of two saves (one wins, [SP-COMMIT-12])."""

import pytest

from shardpoint_core.format.errors import InvalidOptionError, StoreUnavailableError
from shardpoint_core.stores.registry import open_store
from shardpoint_core.stores.testing import StoreTests

pytest.importorskip("google.cloud.storage")
from shardpoint_core.stores.gcs import GcsOptions, GcsStore, parse_gs_url  # noqa: E402


@pytest.mark.slow  # the conditional contract below runs by default; sp.save and the
class TestGcsStoreContract(StoreTests):  # manager run this mode in tests/api/test_gcs_api.py
    """The shipped store contract on the emulator (conditional writes off: it ignores them,
    so ``if_absent`` is the store's check-then-write there)."""

    @pytest.fixture
    def store(self, gcs_env):
        return GcsStore.from_url(gcs_env.url(gcs_env.fresh_prefix("contract")))

    @pytest.mark.slow  # 160 requests on a pure-Python emulator
    def test_threads(self, store):
        super().test_threads(store)


def test_urls_registry_and_capabilities(gcs_env, monkeypatch):
    assert parse_gs_url("gs://b/run/step_1/") == ("b", "run/step_1")
    with pytest.raises(InvalidOptionError):
        parse_gs_url("gs:///nobucket")
    s = open_store(gcs_env.url("run"))
    assert isinstance(s, GcsStore) and s.url == gcs_env.url("run")
    assert not s.capabilities.conditional_put  # the emulator's env turns them off
    with pytest.raises(InvalidOptionError, match="conditional writes are off"):
        s.put("k", b"x", if_match="1")
    monkeypatch.delenv("SHARDPOINT_GCS_CONDITIONAL_WRITES")
    on = GcsStore.from_url("gs://b/run")  # real GCS: on by default
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
    assert s.head("top").version != a.version  # a generation per write


def test_unreachable_endpoint_is_a_clear_error():
    s = GcsStore.from_url(
        "gs://b/x", GcsOptions(endpoint_url="http://127.0.0.1:9", retry_timeout_s=1, timeout_s=1)
    )
    with pytest.raises(StoreUnavailableError, match="127.0.0.1:9"):
        s.get("k")


@pytest.fixture(scope="module")
def strict_gcs(gcs_server):
    from shardpoint_testing.gcs import PreconditionProxy

    with PreconditionProxy(gcs_server) as proxy:
        yield proxy


@pytest.fixture
def strict_env(strict_gcs, gcs_server, monkeypatch):
    for k, v in strict_gcs.env().items():
        monkeypatch.setenv(k, v)
    return gcs_server


class TestGcsStoreConditionalContract(StoreTests):
    """The contract with conditional writes on: ``if_absent`` is ``ifGenerationMatch=0``,
    refused by the server (412 -> FileExistsError)."""

    @pytest.fixture
    def store(self, strict_env):
        s = GcsStore.from_url(strict_env.url(strict_env.fresh_prefix("strict")))
        assert s.capabilities.conditional_put and s.capabilities.conditional_replace
        return s

    @pytest.mark.slow
    def test_threads(self, store):
        super().test_threads(store)


def test_replacement_of_a_generation_that_changed_is_refused(strict_env, strict_gcs):
    s = GcsStore.from_url(strict_env.url(strict_env.fresh_prefix("match")))
    s.put("m", b"one", if_absent=True)
    first = s.head("m").version
    s.put("m", b"two", if_match=first)  # the one read: replaced
    with pytest.raises(FileExistsError):
        s.put("m", b"three", if_match=first)  # stale: someone replaced it
    assert s.get("m") == b"two" and strict_gcs.refused >= 1


def test_of_two_commits_to_one_target_one_wins(strict_env):
    """Two saves, each staged below its own prefix, publish to one fresh target; the winner
    commits right before the loser's PUT of the marker (after any look the loser took), so
    only that conditional PUT (ifGenerationMatch=0) can stop it: it fails with
    CheckpointExistsError and the winner's checkpoint stays whole ([SP-COMMIT-12])."""
    from shardpoint_core.commit.object_store import ObjectStoreCommitter
    from shardpoint_core.format.errors import CheckpointExistsError
    from shardpoint_core.format.manifest import (
        Manifest,
        TensorEntry,
        decode_manifest,
        encode_manifest,
    )

    store = GcsStore.from_url(strict_env.url(strict_env.fresh_prefix("race")))
    plain = ObjectStoreCommitter(store)

    def stage(token, label):
        staging = plain.begin("ck", token)
        store.put(f"{staging}/tensors/w/c/0", label.encode())
        m = Manifest(
            wire_tree={"dict": [["w", {"tensor": "w"}]]},
            objects={},
            tensors={"w": TensorEntry("w", "tensors/w", (1,), "uint8", (1,))},
        )
        store.put(f"{staging}/manifest.msgpack", encode_manifest(m))
        return staging

    winner, loser = stage("aaaaaaaaaaaa", "A"), stage("bbbbbbbbbbbb", "B")

    class WinnerCommitsJustBeforeTheLosersPut:
        """The loser's view of the store: the winner's commit lands just before the loser's
        PUT of the marker is sent (a real interleaving, on the server)."""

        def __init__(self) -> None:
            self.capabilities, self.url, self.fired = store.capabilities, store.url, False

        def put(self, key, data, **kw):
            if key == "ck/manifest.msgpack" and not self.fired:
                self.fired = True
                plain.publish(winner, "ck", overwrite=False)
            return store.put(key, data, **kw)

        def __getattr__(self, name):
            return getattr(store, name)

    with pytest.raises(CheckpointExistsError, match="conditional PUT won"):
        ObjectStoreCommitter(WinnerCommitsJustBeforeTheLosersPut()).publish(
            loser, "ck", overwrite=False
        )
    m = decode_manifest(store.get("ck/manifest.msgpack"))
    assert store.get("ck/" + m.tensors["w"].array + "/c/0") == b"A"
