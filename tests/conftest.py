"""Shared test setup: the ``--runslow`` option for long property runs and big cases."""
import pytest


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run tests marked slow (long property runs, big worlds)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tmp_ckpt(tmp_path):
    """A checkpoint path that does not exist yet, inside a fresh temporary directory."""
    return str(tmp_path / "ckpt")


@pytest.fixture(scope="session")
def s3_server():
    """One real S3-compatible server (moto's, on loopback) for the whole session; tests share
    its bucket and keep apart by ``s3_server.fresh_prefix()``."""
    from shardpoint_testing.s3 import S3Server
    with S3Server() as server:
        yield server


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The standard AWS environment pointing at the session's server (children inherit it)."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE",
              "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(k, raising=False)
    return s3_server


@pytest.fixture(scope="session")
def gcs_server():
    """One local GCS emulator (gcp-storage-emulator, on loopback) for the whole session; tests
    share its bucket and keep apart by ``gcs_server.fresh_prefix()``. Skips where the emulator
    or the client (the ``gcs`` extra) is not installed."""
    pytest.importorskip("gcp_storage_emulator")
    pytest.importorskip("google.cloud.storage")
    from shardpoint_testing.gcs import GcsServer
    with GcsServer() as server:
        yield server


@pytest.fixture
def gcs_env(gcs_server, monkeypatch):
    """The environment pointing gs:// stores at the session's emulator (children inherit it)."""
    for k, v in gcs_server.env().items():
        monkeypatch.setenv(k, v)
    return gcs_server
