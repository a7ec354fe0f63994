"""Shared test setup: the ``--runslow`` option for long property runs and big cases, the order
that starts the longest test files first, the object-store servers."""

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--runslow",
        action="store_true",
        default=False,
        help="also run tests marked slow (long property runs, big worlds)",
    )


# The files whose tests take longest (real worlds, benchmarks' quick runs, clusters), run
# first. `--dist worksteal` hands each worker a contiguous share of the collection and lets an
# idle worker take the tail of the other's queue: a long test there (tools/ sorts last) ran
# while the other worker sat idle at the end of the run. A file missing here only runs later.
FIRST = (
    "tests/tools/test_bench.py",
    "tests/tools/test_demo.py",
    "tests/conformance/test_cluster.py",
    "tests/conformance/test_cluster_memory_tier.py",
    "tests/jax/test_jax_flax.py",
    "tests/core/test_fuzz.py",
    "tests/jax/test_jax_interop.py",
    "tests/core/test_direct_write.py",
    "tests/core/test_s3_commit.py",
    "tests/api/test_async_save.py",
    "tests/tools/test_s3_convert.py",
)


def _first(item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return FIRST.index(path) if path in FIRST else len(FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_first)  # stable: the rest keep their order
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
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
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


@pytest.fixture(autouse=True)
def _no_lease_outlives_its_test():
    """A save a test began and never published or aborted keeps renewing its lease (as a
    live save does); the end of the test is its process's end: renewals stop, so no store
    request of one test runs during another (a garbage or request count of its own)."""
    yield
    from shardpoint_core.commit.lease import stop_all

    stop_all()
