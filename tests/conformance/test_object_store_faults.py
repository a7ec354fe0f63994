"""The conformance suite's object-store commit faults (shardpoint_conformance.commit_faults)
run against the reference committer on the tests' S3 server (through the fault proxy) and
on the GCS emulator (through the proxy that enforces preconditions and loses replies). One
case of each kind by default; every combination with --runslow."""

import contextlib

import pytest

from shardpoint_conformance.commit_faults import SCENARIOS, Rig
from shardpoint_core.commit.object_store import ObjectStoreCommitter
from shardpoint_testing.probes import pause_lease


@pytest.fixture
def s3_rig(s3_env, request):
    pytest.importorskip("boto3")
    from shardpoint_core.stores.s3 import S3Options, S3Store
    from shardpoint_testing.s3 import FaultProxy

    url = s3_env.url(s3_env.fresh_prefix("conf"))

    @contextlib.contextmanager
    def faulty(rule):
        with FaultProxy(s3_env, rule) as proxy:
            yield S3Store.from_url(url, S3Options(endpoint_url=proxy.endpoint, max_attempts=3))

    def blackhole(endpoint):
        o = S3Options(endpoint_url=endpoint, connect_timeout_s=1, read_timeout_s=1, deadline_s=2)
        return S3Store.from_url(url, o), o.deadline_s + o.connect_timeout_s + o.read_timeout_s

    return Rig(
        S3Store.from_url(url),
        faulty,
        ObjectStoreCommitter,
        pause_lease,
        quick=not request.config.getoption("--runslow"),
        blackhole=blackhole,
    )


@pytest.fixture
def gcs_rig(gcs_server, request):
    from shardpoint_core.stores.gcs import GcsOptions, GcsStore
    from shardpoint_testing.gcs import PreconditionProxy

    url = gcs_server.url(gcs_server.fresh_prefix("conf"))
    strict = PreconditionProxy(gcs_server)
    strict.__enter__()

    @contextlib.contextmanager
    def faulty(rule):
        with PreconditionProxy(gcs_server, rule) as proxy:
            yield GcsStore.from_url(
                url, GcsOptions(endpoint_url=proxy.endpoint, conditional_writes=True)
            )

    def blackhole(endpoint):
        o = GcsOptions(
            endpoint_url=endpoint,
            connect_timeout_s=1,
            timeout_s=1,
            retry_timeout_s=2,
            conditional_writes=True,
        )
        return GcsStore.from_url(url, o), o.retry_timeout_s + o.connect_timeout_s + o.timeout_s

    yield Rig(
        GcsStore.from_url(url, GcsOptions(endpoint_url=strict.endpoint, conditional_writes=True)),
        faulty,
        ObjectStoreCommitter,
        pause_lease,
        quick=not request.config.getoption("--runslow"),
        blackhole=blackhole,
    )
    strict.__exit__(None, None, None)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_commit_faults_on_s3(s3_rig, scenario):
    SCENARIOS[scenario](s3_rig)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_commit_faults_on_gcs(gcs_rig, scenario):
    SCENARIOS[scenario](gcs_rig)
