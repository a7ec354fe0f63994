"""The S3 byte store against a real S3-compatible server (moto's, on loopback): the store
protocol, conditional writes, multipart, clear errors for a missing bucket, bad credentials
and an unreachable endpoint, and retries of throttling, 5xx and dropped connections injected
by a proxy."""

import os
import time

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")

from shardpoint_core.format.errors import (
    InvalidKeyError,
    InvalidOptionError,  # noqa: E402
    StoreAccessDeniedError,
    StoreNotFoundError,
    StoreUnavailableError,
)
from shardpoint_core.stores.base import ByteStore  # noqa: E402
from shardpoint_core.stores.s3 import S3Options, S3Store, parse_s3_url  # noqa: E402
from shardpoint_testing.s3 import FaultProxy, free_port  # noqa: E402


@pytest.fixture
def store(s3_env):
    return S3Store.from_url(s3_env.url(s3_env.fresh_prefix("store")))


def test_protocol_and_round_trip(store):
    assert isinstance(store, ByteStore)
    assert store.capabilities.conditional_put and store.capabilities.durable_put
    etag = store.put("a/b", [b"hello ", bytearray(b""), memoryview(b"world")])
    assert etag and store.get("a/b") == b"hello world"
    assert store.get_range("a/b", 6, 100) == b"world"
    assert store.get_range("a/b", 11, 5) == b""
    out = bytearray(5)
    store.read_into("a/b", 6, memoryview(out))
    assert out == b"world"
    with pytest.raises(EOFError):
        store.read_into("a/b", 8, memoryview(bytearray(5)))
    info = store.head("a/b")
    assert (info.key, info.size, info.version) == ("a/b", 11, etag)
    assert store.head("a/missing") is None
    with pytest.raises(FileNotFoundError):
        store.get("a/missing")
    store.put("a/c", b"x")
    store.put("b", b"y")
    assert [i.key for i in store.list("a/")] == ["a/b", "a/c"]
    assert [i.key for i in store.list()] == ["a/b", "a/c", "b"]
    store.delete(["a/b", "a/never-there"])
    assert [i.key for i in store.list()] == ["a/c", "b"]


def test_keys_that_could_escape_are_refused(store):
    for bad in ("", "/a", "a/", "a/../b", "./a", "a\\b"):
        with pytest.raises(InvalidKeyError):
            store.put(bad, b"x")
    with pytest.raises(InvalidOptionError):
        parse_s3_url("s3://bucket/a/../b")
    with pytest.raises(InvalidOptionError):
        parse_s3_url("gs://bucket/a")
    assert parse_s3_url("s3://bucket/a/b/") == ("bucket", "a/b")


def test_conditional_writes(store):
    """If-None-Match: * creates once; If-Match replaces only the version one saw."""
    v1 = store.put("m", b"one", if_absent=True)
    with pytest.raises(FileExistsError):
        store.put("m", b"two", if_absent=True)
    assert store.get("m") == b"one"
    v2 = store.put("m", b"two", if_match=v1)
    with pytest.raises(FileExistsError):
        store.put("m", b"three", if_match=v1)  # someone replaced it meanwhile
    assert store.get("m") == b"two" and v2 != v1
    with pytest.raises(FileNotFoundError):
        store.put("never", b"x", if_match=v1)


def test_multipart_from_several_buffers(store):
    """Above the threshold an object goes up in parallel parts, straight from the caller's
    buffers, and appears whole; a conditional multipart upload loses like a PUT."""
    big = os.urandom((5 << 20) + 123)
    st = S3Store(
        store.bucket, store.prefix, S3Options(multipart_threshold=5 << 20, part_size=5 << 20)
    )
    pieces = [big[:7], big[7 : (5 << 20) - 9], b"", big[(5 << 20) - 9 :]]
    st.put("big", pieces, if_absent=True)
    assert st.head("big").size == len(big)
    assert st.get("big") == big
    assert st.get_range("big", 5 << 20, 10) == big[5 << 20 : (5 << 20) + 10]
    with pytest.raises(FileExistsError):
        st.put("big", pieces, if_absent=True)
    # no multipart upload is left behind by the refused one
    assert not st.client.list_multipart_uploads(Bucket=st.bucket).get("Uploads")


def test_missing_bucket_is_named(s3_env):
    st = S3Store.from_url("s3://no-such-bucket-here/x")
    with pytest.raises(StoreNotFoundError, match="no-such-bucket-here"):
        st.check()
    with pytest.raises(StoreNotFoundError, match="no-such-bucket-here"):
        st.get("k")
    with pytest.raises(StoreNotFoundError, match="no-such-bucket-here"):
        st.put("k", b"x")


def test_unreachable_endpoint_fails_fast_and_names_it(s3_env, monkeypatch):
    port = free_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    st = S3Store.from_url("s3://b/x", S3Options(max_attempts=3))
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=f"127.0.0.1:{port}"):
        st.get("k")
    assert time.monotonic() - t0 < 60  # bounded retries, never a hang


def test_missing_credentials_are_named(s3_env, monkeypatch, tmp_path):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StoreAccessDeniedError, match="AWS_ACCESS_KEY_ID"):
        S3Store.from_url(s3_env.url("x")).get("k")


@pytest.mark.slow  # a second server, with signature checks on (~7 s)
def test_refused_credentials_are_named(s3_server):
    """A server that checks signatures (moto with auth on) refuses an unknown key."""
    from shardpoint_testing.s3 import S3Server

    with S3Server(auth=True) as server:
        st = S3Store.from_url(
            server.url("x"),
            S3Options(
                endpoint_url=server.endpoint,
                access_key_id="AKIAUNKNOWNUNKNOWN00",
                secret_access_key="wrong",
                region="us-east-1",
                max_attempts=1,
            ),
        )
        with pytest.raises(StoreAccessDeniedError, match="credentials"):
            st.get("k")
        good = S3Store.from_url(
            server.url("x"), S3Options(endpoint_url=server.endpoint, **server.credentials())
        )
        good.put("k", b"v")
        assert good.get("k") == b"v"


@pytest.mark.parametrize(
    "fault",
    [503, pytest.param(500, marks=pytest.mark.slow), pytest.param(0, marks=pytest.mark.slow)],
)
def test_throttling_5xx_and_dropped_connections_are_retried(s3_env, fault):
    """Every second request fails (SlowDown, InternalError, or a dropped connection): the
    store retries with backoff and every operation still succeeds with the right bytes."""

    def rule(method, path, n):
        return fault if n % 2 == 1 else None

    with FaultProxy(s3_env, rule) as proxy:
        st = S3Store.from_url(
            s3_env.url(s3_env.fresh_prefix("faults")),
            S3Options(endpoint_url=proxy.endpoint, max_attempts=4),
        )
        for i in range(2):
            st.put(f"k{i}", [b"v", str(i).encode()])
        assert [st.get(f"k{i}") for i in range(2)] == [b"v0", b"v1"]
        assert st.get_range("k1", 1, 1) == b"1"
        assert [i.key for i in st.list()] == ["k0", "k1"]
        assert proxy.injected >= 4


def test_persistent_5xx_is_a_clear_error(s3_env):
    with FaultProxy(s3_env, lambda m, p, n: 503) as proxy:
        st = S3Store.from_url(
            s3_env.url("x"), S3Options(endpoint_url=proxy.endpoint, max_attempts=2)
        )
        with pytest.raises(StoreUnavailableError, match="503"):
            st.get("k")
        assert 2 <= proxy.injected <= 3  # bounded (botocore may try once more), never endless


def test_options_are_checked():
    with pytest.raises(InvalidOptionError):
        S3Options(part_size=1 << 20)
    with pytest.raises(InvalidOptionError):
        S3Options(max_attempts=0)


def test_core_imports_no_s3_client_until_used():
    import subprocess
    import sys

    code = (
        "import sys, shardpoint_core.stores.s3 as s; "
        "assert 'boto3' not in sys.modules and 'botocore' not in sys.modules; "
        "s.S3Store.from_url('s3://b/p'); assert 'boto3' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


from shardpoint_core.stores.testing import StoreTests  # noqa: E402


class TestS3StoreContract(StoreTests):
    """The shipped store contract (shardpoint_core.stores.testing), on the real server."""

    @pytest.fixture
    def store(self, s3_env):
        return S3Store.from_url(s3_env.url(s3_env.fresh_prefix("contract")))

    @pytest.mark.slow  # hundreds of requests: seconds on moto, more on a busy machine
    def test_threads(self, store):
        super().test_threads(store)
