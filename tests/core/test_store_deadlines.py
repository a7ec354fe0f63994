"""Object stores answer in bounded time (issue 28): an endpoint that accepts connections and
never answers (a "blackhole") is a StoreUnavailableError naming it, for saves and loads on
S3 and GCS, within the deadline the options give, and the defaults are bounded."""

import socket

import pytest
import torch

import shardpoint as sp
from shardpoint_core.format.errors import InvalidOptionError, StoreUnavailableError
from shardpoint_testing.probes import error_within

pytest.importorskip("boto3")
from shardpoint_core.stores.gcs import GcsOptions  # noqa: E402
from shardpoint_core.stores.s3 import S3Options, S3Store  # noqa: E402


class Blackhole(str):
    """``http://127.0.0.1:<port>`` of a socket that accepts connections (the kernel does,
    into its backlog) and never reads or answers."""

    sock: socket.socket

    def connections(self) -> int:
        """How many connections were opened to it so far (each attempt opens one)."""
        self.sock.setblocking(False)
        n = 0
        while True:
            try:
                c, _ = self.sock.accept()
            except BlockingIOError:
                return n
            c.close()
            n += 1


@pytest.fixture
def blackhole():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    hole = Blackhole(f"http://127.0.0.1:{s.getsockname()[1]}")
    hole.sock = s
    try:
        yield hole
    finally:
        s.close()


def _worst_case(connect: float, read: float, deadline: float) -> float:
    """What an operation may take at most against a blackhole: retries start until the
    deadline, the last one waits its own timeouts out (plus backoff, at most a few seconds)."""
    return deadline + connect + read + 5


def test_default_timeouts_and_deadlines_are_bounded(monkeypatch):
    """By the configured values, not by waiting: a blackhole costs the defaults well under a
    minute (before: 60 s read timeout x 6 attempts on S3, 60 s + 60 s of retries on GCS)."""
    for k in (
        "SHARDPOINT_S3_READ_TIMEOUT_S",
        "SHARDPOINT_S3_CONNECT_TIMEOUT_S",
        "SHARDPOINT_S3_DEADLINE_S",
        "SHARDPOINT_GCS_READ_TIMEOUT_S",
        "SHARDPOINT_GCS_CONNECT_TIMEOUT_S",
        "SHARDPOINT_GCS_DEADLINE_S",
    ):
        monkeypatch.delenv(k, raising=False)
    s3 = S3Store.from_url("s3://b/x").options
    assert _worst_case(s3.connect_timeout_s, s3.read_timeout_s, s3.deadline_s) <= 45
    g = GcsOptions.from_env()
    assert _worst_case(g.connect_timeout_s, g.timeout_s, g.retry_timeout_s) <= 45
    # and the client is built with them (botocore's own config, not just our dataclass)
    cfg = S3Store.from_url(
        "s3://b/x", S3Options(endpoint_url="http://127.0.0.1:9")
    ).client.meta.config
    assert (cfg.connect_timeout, cfg.read_timeout) == (s3.connect_timeout_s, s3.read_timeout_s)


def test_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("SHARDPOINT_S3_READ_TIMEOUT_S", "3")
    monkeypatch.setenv("SHARDPOINT_S3_DEADLINE_S", "4.5")
    monkeypatch.setenv("SHARDPOINT_GCS_DEADLINE_S", "7")
    o = S3Store.from_url("s3://b/x").options
    assert (o.read_timeout_s, o.deadline_s) == (3.0, 4.5)
    assert GcsOptions.from_env().retry_timeout_s == 7.0
    assert S3Options.from_env(deadline_s=9).deadline_s == 9  # explicit fields win
    monkeypatch.setenv("SHARDPOINT_S3_DEADLINE_S", "soon")
    with pytest.raises(InvalidOptionError, match="SHARDPOINT_S3_DEADLINE_S"):
        S3Options.from_env()
    with pytest.raises(InvalidOptionError):
        S3Options(deadline_s=float("inf"))
    with pytest.raises(InvalidOptionError):
        GcsOptions(connect_timeout_s=0)


# Short settings keep the tests fast; what they check is that the settings reach the stores
# that s3:// and gs:// paths open, and that the deadline, not the number of attempts times
# the read timeout, ends the operation (6 attempts x 0.5 s would take > 3 s with backoff).
FAST_S3 = {
    "SHARDPOINT_S3_CONNECT_TIMEOUT_S": "0.5",
    "SHARDPOINT_S3_READ_TIMEOUT_S": "0.5",
    "SHARDPOINT_S3_DEADLINE_S": "0.6",
    "SHARDPOINT_S3_MAX_ATTEMPTS": "6",
}
FAST_GCS = {
    "SHARDPOINT_GCS_CONNECT_TIMEOUT_S": "0.5",
    "SHARDPOINT_GCS_READ_TIMEOUT_S": "0.5",
    "SHARDPOINT_GCS_DEADLINE_S": "0.6",
}


@pytest.mark.parametrize("op", ["save", "load"])
def test_s3_blackhole_is_store_unavailable_naming_the_endpoint(s3_env, blackhole, monkeypatch, op):
    monkeypatch.setenv("AWS_ENDPOINT_URL", blackhole)
    for k, v in FAST_S3.items():
        monkeypatch.setenv(k, v)
    url = "s3://shardpoint-test/blackhole/step_1"
    fn = (lambda: sp.save({"w": torch.ones(3)}, url)) if op == "save" else (lambda: sp.load(url))
    err = error_within(fn, timeout=60, what=f"{op} against a blackhole")
    assert isinstance(err, StoreUnavailableError), repr(err)
    assert blackhole.split("//")[1] in str(err)
    assert "deadline" in str(err)


def test_s3_blackhole_store_stops_at_the_deadline_not_after_every_attempt(s3_env, blackhole):
    """At the store itself: the deadline cuts the retries short. Counted by attempts, not
    time: the blackhole's accept queue shows how many connections were opened."""
    st = S3Store.from_url(
        "s3://b/x",
        S3Options(
            endpoint_url=blackhole,
            connect_timeout_s=1,
            read_timeout_s=0.5,
            deadline_s=1.2,
            max_attempts=10,
        ),
    )
    err = error_within(lambda: st.get("k"), timeout=60, what="GET against a blackhole")
    assert isinstance(err, StoreUnavailableError), repr(err)
    assert blackhole.split("//")[1] in str(err) and "deadline" in str(err)
    assert 1 <= blackhole.connections() <= 4  # not the 10 attempts allowed


@pytest.mark.parametrize("op", ["save", "load"])
def test_gcs_blackhole_is_store_unavailable_naming_the_endpoint(blackhole, monkeypatch, op):
    pytest.importorskip("google.cloud.storage")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", blackhole)
    monkeypatch.delenv("SHARDPOINT_GCS_CONDITIONAL_WRITES", raising=False)
    for k, v in FAST_GCS.items():
        monkeypatch.setenv(k, v)
    url = "gs://shardpoint-test/blackhole/step_1"
    fn = (lambda: sp.save({"w": torch.ones(3)}, url)) if op == "save" else (lambda: sp.load(url))
    err = error_within(fn, timeout=60, what=f"{op} against a blackhole")
    assert isinstance(err, StoreUnavailableError), repr(err)
    assert blackhole.split("//")[1] in str(err)
