"""Save and load across hosts of a test cluster: hosts as network namespaces with shaped
links (``shardpoint_testing.cluster``), real gloo processes, real files in a shared directory.

Checked: ranks learn their host as on a real cluster (hostname, torchrun's variables), a
checkpoint saved by rows on 2 hosts x 2 ranks loads by columns bit for bit with the cost
model seeing 2 hosts, and a host that dies or whose link is cut in the middle of a save, an
async save's background phase or a load fails every surviving rank with ``RankLostError``
within the group's timeout, with nothing half-written visible and ``recover`` cleaning up.
Everything the cluster created is gone afterwards. Skipped with the reason when not root.
"""

import os
import re
import shlex
import subprocess
import tempfile
import time

import pytest
import torch

import shardpoint as sp
from shardpoint_testing import cluster as cl

pytestmark = pytest.mark.skipif(
    cl.unavailable_reason() is not None, reason=cl.unavailable_reason() or ""
)

ROWS, COLS = 64, 96


@pytest.fixture(autouse=True)
def _one_cluster_at_a_time():
    """The tests check that the machine's namespaces are as before: clusters of this
    module run one at a time, also across pytest-xdist workers (a lock file)."""
    import fcntl

    with open(os.path.join(tempfile.gettempdir(), "shardpoint-cluster-tests.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _netns() -> set:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _by_rows(rank: int, world: int) -> sp.ShardedTensor:
    n = ROWS // world
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    return sp.ShardedTensor(full[rank * n : (rank + 1) * n].clone(), (ROWS, COLS), (rank * n, 0))


def _round_trip(rank, world, root):
    from shardpoint.exchange.topology import host_identity

    state = {
        "w": _by_rows(rank, world),
        "b": torch.full((8,), 3.0, dtype=torch.bfloat16),
        "step": 7,
    }
    sp.save(state, f"{root}/ck")
    n = COLS // world
    like = {
        "w": sp.ShardedTensor(torch.zeros(ROWS, n), (ROWS, COLS), (0, rank * n)),
        "b": torch.zeros(8, dtype=torch.bfloat16),
        "step": 0,
    }
    report = sp.LoadReport()
    out = sp.load(f"{root}/ck", like=like, report=report)
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    ok = (
        torch.equal(out["w"], full[:, rank * n : (rank + 1) * n])
        and out["step"] == 7
        and torch.equal(out["b"], torch.full((8,), 3.0, dtype=torch.bfloat16))
    )
    return host_identity(), ok, report.costs.get("hosts"), report.choice()


def test_save_on_two_hosts_loads_by_columns_and_leaves_nothing_behind():
    """2 hosts x 2 ranks over 1 Gbit/s links: the ranks see two hosts (hostnames and the
    cost model), the columns come back bit for bit, and the namespaces are gone after."""
    before = _netns()
    with cl.Cluster(2, 2, cl.Link(mbit=1000)) as c:
        ours = set(c.host_ns) | {c.switch, c.storage}
        assert ours <= _netns()
        got = c.run(_round_trip, c.shared_dir, timeout=240, pg_timeout=60)
        shared = c.shared_dir
    hosts = [g[0] for g in got]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3], hosts
    assert all(g[1] for g in got), got
    assert got[0][2] == 2, got[0]
    assert got[0][3].split()[0] in ("dedup", "direct") and "on 2 hosts" in got[0][3], got[0]
    assert _netns() == before and not (ours & _netns())
    assert not os.path.exists(shared)


def test_host_identity_follows_the_launchers(monkeypatch):
    """SLURM's node name first, then the hostname qualified by torchrun's node rank on a
    multi-node run; an explicit ``host_id`` always wins."""
    import socket
    from shardpoint.exchange.topology import host_identity

    name = socket.gethostname()
    assert host_identity(environ={}) == name
    assert host_identity(environ={"GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1"}) == name
    assert host_identity(environ={"GROUP_RANK": "3", "GROUP_WORLD_SIZE": "4"}) == f"{name}#node3"
    assert (
        host_identity(
            environ={"SLURMD_NODENAME": "gpu017", "GROUP_RANK": "3", "GROUP_WORLD_SIZE": "4"}
        )
        == "gpu017"
    )
    assert host_identity("mine", environ={"SLURMD_NODENAME": "gpu017"}) == "mine"


def test_cluster_is_removed_after_a_failure_inside():
    before = _netns()
    with pytest.raises(ZeroDivisionError):
        with cl.Cluster(2, 1) as c:
            shared = c.shared_dir
            _ = 1 / 0
    assert _netns() == before and not os.path.exists(shared)


# ---------------------------------------------------------------------------- failures
PG_TIMEOUT = 10.0  # the group's timeout: the bound the docs state for a lost peer
MARGIN = 30.0  # process scheduling on a loaded 2-core machine


class _SlowWrites:
    """The real backend; each write first leaves a marker and waits, so the test can strike
    while every rank is in the middle of its writes."""

    def __init__(self, root: str, rank: int) -> None:
        from shardpoint_core.transactions.resolve import get_backend

        self.inner, self.root, self.rank = get_backend(), root, rank

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def write(self, handle, offset, data):
        open(f"{self.root}/writing.{self.rank}", "w").close()
        time.sleep(0.3)
        return self.inner.write(handle, offset, data)

    def read_into(self, handle, offset, out):
        open(f"{self.root}/reading.{self.rank}", "w").close()
        time.sleep(0.3)
        return self.inner.read_into(handle, offset, out)


def _fail_job(rank, world, root, what):
    state = {f"t{i}": _by_rows(rank, world) for i in range(6)}
    if what == "load":
        sp.save(state, f"{root}/ck")
    be = _SlowWrites(root, rank)
    t0 = time.monotonic()
    try:
        if what == "load":
            n = COLS // world
            like = {
                k: sp.ShardedTensor(torch.zeros(ROWS, n), (ROWS, COLS), (0, rank * n))
                for k in state
            }
            sp.load(f"{root}/ck", like=like, backend=be, options=sp.LoadOptions(strategy="dedup"))
        else:
            sp.save(state, f"{root}/new", backend=be, async_save=what == "async")
            sp.save({}, f"{root}/after")  # an async save's error surfaces here at the latest
        out = "no error"
    except BaseException as e:  # noqa: BLE001 - the outcome is the test's subject
        out = f"{type(e).__name__}: {e}"
    return out, time.monotonic() - t0


def _strike(c: cl.Cluster, what: str, how: str, root: str) -> dict:
    job = c.start(_fail_job, root, what, pg_timeout=PG_TIMEOUT)
    marker = "reading" if what == "load" else "writing"
    deadline = time.monotonic() + 180
    while not all(os.path.exists(f"{root}/{marker}.{r}") for r in range(c.world)):
        assert time.monotonic() < deadline, "the ranks never started their I/O"
        job.poll(0.1)
    struck = time.monotonic()
    (c.kill_host if how == "kill" else c.cut_link)(1)
    results, errors = job.outcomes(PG_TIMEOUT + MARGIN + 60)
    return {"struck": struck, "results": results, "errors": errors, "job": job}


@pytest.mark.slow
@pytest.mark.parametrize(
    "what,how",
    [
        ("save", "kill"),
        ("save", "cut"),
        ("async", "kill"),
        ("async", "cut"),
        ("load", "cut"),
        ("load", "kill"),
    ],
)
def test_a_lost_host_fails_every_survivor_within_the_group_timeout(tmp_path, what, how):
    """Host 1 of 2 (2 ranks each) is killed or cut off while every rank writes (a save, an
    async save's background phase) or reads (a load): each surviving rank raises
    RankLostError within the group's timeout (plus scheduling slack), no new checkpoint is
    visible, and ``recover`` leaves the directory with nothing of the failed save."""
    with cl.Cluster(2, 2, cl.Link(mbit=1000), shared_dir=str(tmp_path)) as c:
        out = _strike(c, what, how, str(tmp_path))
    survivors = [0, 1] if how == "kill" else [0, 1, 2, 3]
    for r in survivors:
        assert r in out["results"], (r, out["errors"])
        msg, _took = out["results"][r]
        assert msg.startswith(("RankLostError", "SaveFailedError", "LoadFailedError")), msg
        assert "RankLostError" in msg or "rank" in msg, msg
        took = out["job"].finished_at[r] - out["struck"]
        assert took < PG_TIMEOUT + MARGIN, (r, took, msg)
    if how == "kill":
        assert set(out["errors"]) == {2, 3}, out["errors"]
    sp.recover(str(tmp_path), min_age_s=0)
    left = sorted(n for n in os.listdir(tmp_path) if not n.startswith(("writing", "reading")))
    assert left == (["ck"] if what == "load" else []), left
    if what == "load":
        assert torch.equal(
            sp.load(str(tmp_path / "ck"))["t0"],
            torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS),
        )


def test_cost_model_prices_host_links_and_the_storage_total():
    """4 ranks on 2 hosts each need all 1 GB; dedup reads it once and sends each host the
    half it did not read, direct reads it on both hosts. A storage system that serves
    little in total makes dedup the cheaper; fast storage behind slow host links makes
    direct the cheaper (dedup's reads and receipts both pass each host's link)."""
    from shardpoint.planning.load_planner import choose_strategy

    G = 10**9
    hosts = ["a", "a", "b", "b"]
    args = (hosts, G, [G // 2] * 4, {"a": G, "b": G}, 10.0, 100.0)
    kw = dict(dedup_rank_bytes=[G // 4] * 4, direct_rank_bytes=[G] * 4, memory_gbps=100.0)
    tight = choose_strategy(*args, **kw, storage_total_gbps=0.5, link_gbps=10.0)
    assert tight.strategy == "dedup", tight
    slow_links = choose_strategy(*args, **kw, link_gbps=1.0)
    assert slow_links.strategy == "direct", slow_links
    assert slow_links.direct_s == pytest.approx(1.0)  # each host reads 1 GB over 1 GB/s
    assert slow_links.dedup_s == pytest.approx(0.5 + 1.0)  # half read, then 2 x 0.5 received


@pytest.mark.slow
def test_conformance_run_on_two_hosts(tmp_path, capsys):
    """``shardpoint conformance run --hosts 2 --ranks-per-host 2``: the cases save and load
    across two hosts' namespaces over shaped links and pass; the cluster is gone after."""
    from shardpoint_conformance import cli

    before = _netns()
    out = tmp_path / "rows.json"
    rc = cli.main(
        [
            "run",
            "--hosts",
            "2",
            "--ranks-per-host",
            "2",
            "--link-mbit",
            "1000",
            "--cases",
            "3",
            "--seed",
            "23",
            "--dir",
            str(tmp_path / "c"),
            "--json",
            str(out),
            "--no-vectors",
        ]
    )
    text = capsys.readouterr().out
    rows = __import__("json").loads(out.read_text())
    assert rc == 0 and len(rows) == 3 and all(r["ok"] for r in rows), text
    assert {(r["save_world"], r["load_world"]) for r in rows} == {(4, 4)}
    assert "2 host(s) x 2 rank(s)" in text and "1000 Mbit/s" in text
    assert _netns() == before


def test_conformance_run_hosts_refuses_other_world_sizes(capsys):
    from shardpoint_conformance import cli

    rc = cli.main(
        ["run", "--hosts", "2", "--ranks-per-host", "2", "--save-world-sizes", "3", "--no-vectors"]
    )
    assert rc == 2 and "worlds of 4" in capsys.readouterr().err


def _s3_round_trip(rank, world, url):
    """Save by rows to ``url`` (the storage host's S3 server), load by columns."""
    state = {
        "w": _by_rows(rank, world),
        "b": torch.full((8,), 3.0, dtype=torch.bfloat16),
        "step": 7,
    }
    sp.save(state, url)
    n = COLS // world
    like = {
        "w": sp.ShardedTensor(torch.zeros(ROWS, n), (ROWS, COLS), (0, rank * n)),
        "b": torch.zeros(8, dtype=torch.bfloat16),
        "step": 0,
    }
    out = sp.load(url, like=like)
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    return (
        torch.equal(out["w"], full[:, rank * n : (rank + 1) * n])
        and out["step"] == 7
        and torch.equal(out["b"], torch.full((8,), 3.0, dtype=torch.bfloat16)),
        os.environ["AWS_ENDPOINT_URL"],
    )


@pytest.mark.slow  # the conformance run on the storage host's S3 below covers it by default
def test_s3_on_the_storage_host_save_and_resharded_load():
    """The S3-compatible server runs on the storage host: 2 hosts save by rows to s3:// and
    load by columns bit for bit, every byte crossing the storage host's shaped link (its
    counters see at least the data, written and read back); nothing is left behind."""
    before = _netns()
    with cl.Cluster(2, 1, cl.Link(mbit=1000)) as c:
        s3 = c.s3_server()
        assert s3.endpoint == f"http://{cl.STORAGE_ADDR}:9000"
        crossed = c.link_bytes(-1)
        got = c.run(_s3_round_trip, s3.url("run/step_1"), env=s3.env(), timeout=180, pg_timeout=60)
        crossed = c.link_bytes(-1) - crossed
        ours = set(c.host_ns) | {c.switch, c.storage}
    assert got == [(True, s3.endpoint)] * 2, got
    assert crossed >= 2 * ROWS * COLS * 4, crossed
    assert not (ours & _netns()) and _netns() == before


README = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "docs",
    "how-to",
    "conformance.md",
)  # the docs' command


def _conformance_on_storage_s3(args: list, tmp_path, capsys) -> tuple:
    from shardpoint_conformance import cli

    before = _netns()
    out = tmp_path / "rows.json"
    rc = cli.main(args + ["--seed", "23", "--json", str(out), "--no-vectors"])
    text = capsys.readouterr().out
    rows = __import__("json").loads(out.read_text()) if out.exists() else []
    assert rc == 0 and rows and all(r["ok"] for r in rows), text
    assert f"S3-compatible server at http://{cl.STORAGE_ADDR}:9000" in text, text
    for r in rows:  # listed on the storage host by boto3, not through shardpoint's store
        assert r["stored"]["manifest"] and r["stored"]["bytes"] >= r["bytes"], r
    crossed = int(re.search(r"the storage link carried (\d+) bytes", text).group(1))
    assert crossed >= sum(r["stored"]["bytes"] for r in rows), text  # written, then read
    assert _netns() == before
    return rows, text


def test_conformance_run_on_the_storage_hosts_s3(tmp_path, capsys):
    """The README's command: ``conformance run --hosts 2 --store s3`` saves and loads the
    cases on the S3 server of the cluster's storage host (each rank over its host's link and
    the storage link); they pass, the server holds each case's manifest and chunks, the
    storage link carried at least those bytes, and the cluster is gone after."""
    line = next(
        x
        for x in open(README).read().splitlines()
        if x.startswith("sudo shardpoint conformance run") and "--store s3" in x
    )
    args = shlex.split(line)[3:]
    assert args[:1] == ["run"] and "--hosts" in args, line
    rows, _ = _conformance_on_storage_s3(args, tmp_path, capsys)
    assert {(r["save_world"], r["load_world"]) for r in rows} == {(2, 2)}


@pytest.mark.slow
def test_conformance_run_on_the_storage_hosts_s3_two_ranks_per_host(tmp_path, capsys):
    rows, text = _conformance_on_storage_s3(
        [
            "run",
            "--hosts",
            "2",
            "--ranks-per-host",
            "2",
            "--link-mbit",
            "500",
            "--store",
            "s3://my-bucket/runs/a",
            "--cases",
            "6",
        ],
        tmp_path,
        capsys,
    )
    assert {(r["save_world"], r["load_world"]) for r in rows} == {(4, 4)} and len(rows) == 6
    assert "under s3://my-bucket/runs/a" in text and "500 Mbit/s" in text


def test_conformance_run_hosts_refuses_a_store_it_cannot_serve(capsys):
    from shardpoint_conformance import cli

    rc = cli.main(["run", "--hosts", "2", "--store", "gs://b/p", "--no-vectors"])
    assert rc == 2 and "--store s3://BUCKET/PREFIX" in capsys.readouterr().err
    rc = cli.main(["run", "--store", "s3", "--no-vectors"])  # not a local folder "s3"
    assert rc == 2 and "(--hosts)" in capsys.readouterr().err


def test_a_sigkilled_owner_leaves_no_namespace_or_directory_behind():
    """The process that built a cluster is SIGKILLed (no ``close``, no exit hook): its
    reaper tears the cluster down, namespaces, links, the processes in them, the shared
    directory and the hosts' memory, and nothing else."""
    import signal
    import sys

    before = _netns()
    code = (
        "import sys; from shardpoint_testing.cluster import Cluster\n"
        "c = Cluster(1, 1, host_memory=True)\n"
        "p = c.popen_host(0, ['sleep', '600'])\n"
        "print(c.shared_dir, c.memory_dir, p.pid, *c._created, flush=True); sys.stdin.read()\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        shared, memory, sleeper, *made = owner.stdout.readline().split()
        assert made and set(made) <= _netns() and os.path.isdir(shared), made
        assert os.path.isdir(memory), memory
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=10)
        deadline = time.monotonic() + 15
        while (set(made) & _netns() or os.path.exists(shared) or os.path.exists(memory)) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.1)
        assert not set(made) & _netns(), "namespaces outlived their SIGKILLed owner"
        assert not os.path.exists(shared) and not os.path.exists(memory)
        assert (
            not os.path.exists(f"/proc/{sleeper}/cmdline")
            or "sleep" not in open(f"/proc/{sleeper}/cmdline").read()
        )
        assert before <= _netns() | set(made)  # nothing else was touched
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=10)
