"""The manager's scenarios on local files, memory:// and S3 (the real local test server), with
identical results: each test is one scenario function run on the three stores, asserting the
same outcomes and error classes. A trainer and an observer on one root; names under the root
that the manager did not write (a user's ``exports/``, a hand-made ``step_5``, ``step_7``
committed by a plain ``sp.save``); retention while a reader loads; a step directory in the
manager's format that never committed."""

import logging
import uuid

import pytest

torch = pytest.importorskip("torch")

import shardpoint as sp  # noqa: E402
from shardpoint_core.commit.routing import default_committer  # noqa: E402
from shardpoint_core.commit.testing import FileSite, StoreSite  # noqa: E402
from shardpoint_core.format.errors import (  # noqa: E402
    CheckpointExistsError,
    CheckpointNotFoundError,
)
from shardpoint_core.stores.location import locate  # noqa: E402
from shardpoint_core.stores.memory import MemoryStore  # noqa: E402
from shardpoint_core.stores.registry import is_local  # noqa: E402
from shardpoint_core.transactions.backend import ZarrBackend  # noqa: E402
from shardpoint_core.transactions.writer import CheckpointWriter  # noqa: E402

USER = b"user data"


@pytest.fixture(params=["files", "memory", "s3"])
def root(request, tmp_path):
    """A fresh manager root on each store."""
    if request.param == "files":
        yield str(tmp_path / "run")
    elif request.param == "memory":
        name = f"mgr{uuid.uuid4().hex[:8]}"
        yield f"memory://{name}/run"
        MemoryStore.drop(name)
    else:
        server = request.getfixturevalue("s3_env")
        yield server.url(server.fresh_prefix("mgr") + "/run")


def site_of(root):
    return FileSite() if is_local(root) else StoreSite(lambda u: locate(u).pair(), url=True)


def st(step):
    return {"w": torch.full((4,), float(step)), "step": step}


def in_use_leftovers(root):
    """``in_use`` of each leftover below ``root`` (live saves: True; dead ones: False)."""
    return [lo.in_use for lo in default_committer().leftovers(root)]


def test_trainer_and_observer_share_a_root(root):
    """An evaluation job's manager reads, loads and cleans up while the trainer's next save
    is in flight: it sees the committed steps only and never touches the live save."""
    trainer = sp.CheckpointManager(root, max_to_keep=2)
    for s in (1, 2):
        trainer.save(s, st(s), metrics={"loss": 1.0 / s})
    live = CheckpointWriter.begin(trainer.path(3))  # the trainer's save of step 3, running
    observer = sp.CheckpointManager(root, best_metric="loss")
    got = observer.load()  # its clean-up runs first
    assert (observer.all_steps(), got["step"], observer.metrics(2), observer.best_step()) == (
        [1, 2],
        2,
        {"loss": 0.5},
        2,
    )
    assert in_use_leftovers(root) == [True]
    live.abort()  # the trainer failed that save
    assert in_use_leftovers(root) == []
    for s in (3, 4):
        trainer.save(s, st(s), metrics={"loss": 1.0 / s})
    assert (observer.all_steps(), observer.latest_step(), observer.best_step()) == ([3, 4], 4, 4)
    assert observer.load()["step"] == 4 and observer.load(3)["step"] == 3


def test_names_the_manager_did_not_write_are_reported_never_counted_or_removed(root, caplog):
    """The new user's sequence (``sp.save(x, root + "/step_7")``, then a manager with
    ``max_to_keep=2``) beside a user's ``exports/``, a hand-made ``step_5`` and a
    never-committed ``step_00000009`` in the manager's own format: only the manager's steps
    count; ``step_7`` is reported as a stray checkpoint; nothing else is touched."""
    site = site_of(root)
    sp.save({"w": torch.zeros(2)}, f"{root}/step_7")
    user = {"exports": "model.bin", "step_5": "notes.txt", "step_00000009": "eval.json"}
    for d, f in user.items():
        site.put(f"{root}/{d}", f, USER)
    mgr = sp.CheckpointManager(root, max_to_keep=2)
    with caplog.at_level(logging.WARNING, logger="shardpoint"):
        for s in (1, 2, 3, 4):
            mgr.save(s, st(s))
    assert (mgr.all_steps(), mgr.load()["step"], mgr.stray, mgr.stray_checkpoints()) == (
        [3, 4],
        4,
        ["step_7"],
        ["step_7"],
    )
    assert sum("step_7" in r.getMessage() for r in caplog.records) == 1  # reported once
    assert torch.equal(sp.load(f"{root}/step_7")["w"], torch.zeros(2))
    for d, f in user.items():
        assert site.get(f"{root}/{d}", f) == USER
    with pytest.raises(CheckpointNotFoundError, match="step 9 is not a committed"):
        mgr.load(9)


def test_retention_under_a_reader_fails_the_read_never_mixes(root, request):
    """Retention removes the step a load is reading, between its manifest read and its
    chunk reads: the load fails with the same documented error on every store, and the
    manager's steps are whole."""
    trainer = sp.CheckpointManager(root, max_to_keep=1)
    trainer.save(1, st(1))

    class RetentionDuringTheLoad(ZarrBackend):
        def read_manifest_with_identity(self, path):
            got = super().read_manifest_with_identity(path)
            trainer.save(2, st(2))  # retention removes step 1 meanwhile
            return got

    with pytest.raises(sp.ShardpointError) as e:
        sp.load(trainer.path(1), backend=RetentionDuringTheLoad())
    assert type(e.value) is sp.LoadFailedError, repr(e.value)
    assert trainer.all_steps() == [2] and trainer.load()["step"] == 2
    assert default_committer().state(trainer.path(1)) == "missing"


def test_an_uncommitted_step_is_never_removed_or_replaced(root):
    """A step directory in the manager's format that holds something but never committed:
    retention passes it by, removing it is refused (CheckpointNotFoundError), a save of that
    step refuses to replace it (CheckpointExistsError), on every store alike."""
    site = site_of(root)
    mgr = sp.CheckpointManager(root, max_to_keep=1)
    mgr.save(1, st(1))
    site.put(mgr.path(2), "notes.txt", USER)
    mgr.save(3, st(3))
    assert mgr.all_steps() == [3]
    with pytest.raises(CheckpointNotFoundError):
        default_committer().remove(mgr.path(2))
    for force in (False, True):
        with pytest.raises(CheckpointExistsError, match="step 2 cannot be saved") as e:
            mgr.save(2, st(2), force=force)
        assert "already saved" not in str(e.value)
    with pytest.raises(CheckpointNotFoundError):
        mgr.load(2)
    assert site.get(mgr.path(2), "notes.txt") == USER
    assert site.keys(mgr.path(2)) == ["notes.txt"]
    assert mgr.all_steps() == [3] and mgr.load()["step"] == 3


def test_metrics_are_read_through_the_managers_backend(root):
    """``metrics()`` (and retention by metric) reads each step's manifest through the
    backend the manager was given, on object-store roots too."""

    class Counting(ZarrBackend):
        reads = 0

        def read_manifest_with_identity(self, path):
            type(self).reads += 1
            return super().read_manifest_with_identity(path)

        def read_manifest(self, path):
            type(self).reads += 1
            return super().read_manifest(path)

    mgr = sp.CheckpointManager(
        root, backend=Counting(), max_to_keep=1, best_metric="loss", keep_best=1
    )
    mgr.save(1, st(1), metrics={"loss": 2.0})
    mgr.save(2, st(2), metrics={"loss": 1.0})
    before = Counting.reads
    assert mgr.all_steps() == [2]  # step 1: neither the newest nor the best
    fresh = sp.CheckpointManager(root, backend=Counting(), best_metric="loss")
    assert (fresh.metrics(2), fresh.best_step()) == ({"loss": 1.0}, 2)
    assert Counting.reads > before
