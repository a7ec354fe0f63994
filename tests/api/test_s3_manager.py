"""sp.CheckpointManager on s3:// against a real S3 server (moto, on loopback): steps listed
through the store, retention through the object-store committer, best-N from the manifests,
resume; the observer rule ([SP-COMMIT-15]: a leftover save prefix is removed only once old
enough, a prefix a marker names never), and a step removed under a reader's load."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")
torch = pytest.importorskip("torch")

import shardpoint as sp  # noqa: E402
from shardpoint_core.commit.steps import StepRoot  # noqa: E402
from shardpoint_core.format.policy import AnyOf, BestN, LatestN  # noqa: E402
from shardpoint_core.stores.s3 import S3Store  # noqa: E402
from shardpoint_core.verify import verify_checkpoint  # noqa: E402
from shardpoint_testing.probes import crashed_save  # noqa: E402


def state(step):
    return {"w": torch.full((16, 4), float(step)), "b": torch.arange(6.0) + step, "step": step}


def step_prefixes(root):
    return sorted({o.key.split("/")[0] for o in S3Store.from_url(root).list()})


def test_steps_retention_best_and_resume_on_s3(s3_env):
    root = s3_env.url(s3_env.fresh_prefix("mgr"))
    losses = {1: 0.5, 2: 0.1, 3: 0.9, 4: 0.8, 5: 0.7}
    with sp.CheckpointManager(
        root, retention=AnyOf(LatestN(2), BestN(1, "loss")), best_metric="loss"
    ) as mgr:
        assert mgr.all_steps() == [] and mgr.latest_step() is None
        with pytest.raises(sp.CheckpointNotFoundError):
            mgr.load()
        for step, loss in losses.items():
            mgr.save(step, state(step), metrics={"loss": loss})
        assert mgr.path(4) == f"{root}/step_00000004"
        assert mgr.all_steps() == [2, 4, 5] and mgr.best_step() == 2
        with pytest.raises(sp.CheckpointExistsError, match="force=True"):
            mgr.save(5, state(5))
        mgr.save(5, state(50), metrics={"loss": 0.7}, force=True)
    # the removed steps' objects are gone, marker and save prefix alike
    assert step_prefixes(root) == ["step_00000002", "step_00000004", "step_00000005"]
    again = sp.CheckpointManager(root, best_metric="loss")  # a restarted job resumes
    assert again.latest_step() == 5 and again.metrics(2) == {"loss": 0.1}
    out = again.load()
    assert out["step"] == 50 and torch.equal(out["w"], torch.full((16, 4), 50.0))
    assert "__metrics__" not in out
    assert again.load(2, like={"b": torch.empty(6)})["b"].tolist() == [2.0, 3, 4, 5, 6, 7]
    assert all(verify_checkpoint(again.path(s)).ok for s in again.all_steps())


def test_the_file_systems_backend_serves_an_s3_root_too(s3_env):
    """One backend over any byte store (issue 19): ``ZarrBackend`` (ZarrBackend's
    older name, the one users pass) saves and loads on an s3:// root as well."""
    from shardpoint_core.transactions.backend import ZarrBackend

    mgr = sp.CheckpointManager(s3_env.url(s3_env.fresh_prefix("one")), backend=ZarrBackend())
    mgr.save(1, state(1))
    out = mgr.load()
    assert torch.equal(out["w"], state(1)["w"]) and out["step"] == 1


def test_an_observer_leaves_live_saves_and_named_prefixes_alone(s3_env):
    """A save prefix that no marker names may be a save still running: an observer's manager
    leaves it while it is recent ([SP-COMMIT-15]); once old, the clean-up removes it, and
    never the prefix a step's marker names."""
    root = s3_env.url(s3_env.fresh_prefix("obs"))
    sp.CheckpointManager(root).save(1, state(1))
    store = S3Store.from_url(root)
    live = "step_00000002/save-0123456789ab/tensors/w/c/0/0"  # a save of step 2 running
    crashed = "step_00000001/save-abcdef012345/tensors/w/zarr.json"  # beside committed step 1
    for key, data in ((live, b"x"), (crashed, b"{}")):  # both dead, leases expired
        save, _, rest = key.partition("/tensors/")
        crashed_save(store, save, {"tensors/" + rest: data})
    observer = sp.CheckpointManager(root)
    assert observer.all_steps() == [1]
    assert observer.load()["step"] == 1  # its clean-up ran: both are recent
    assert store.head(live) is not None and store.head(crashed) is not None
    steps = StepRoot(root)
    assert sorted(steps.clean_leftovers(min_age_s=3600)) == []
    done = steps.clean_leftovers(min_age_s=0)  # as if both were 15 minutes old
    assert sorted(done) == [
        f"{root}/step_00000001/save-abcdef012345",
        f"{root}/step_00000002/save-0123456789ab",
    ]
    assert step_prefixes(root) == ["step_00000001"]
    assert verify_checkpoint(observer.path(1)).ok  # the named prefix stayed


def test_a_step_removed_under_a_load_fails_it_cleanly(s3_env):
    """Retention removes the step between the load's manifest read and its chunk reads: the
    load raises a ShardpointError, never tensors of two steps."""
    from shardpoint_core.transactions.backend import ZarrBackend

    class RemovedAfterManifest(ZarrBackend):
        def read_manifest_with_identity(self, path):  # what a load reads the manifest by
            got = super().read_manifest_with_identity(path)
            assert self.committer.remove(path)
            return got

    root = s3_env.url(s3_env.fresh_prefix("rm"))
    sp.CheckpointManager(root).save(1, state(1))
    with pytest.raises(sp.LoadFailedError, match="removed by another job"):
        sp.load(f"{root}/step_00000001", backend=RemovedAfterManifest())
    assert step_prefixes(root) == []


OBSERVER = """
import json, os, sys, shardpoint as sp
stop, out, root = sys.argv[1:4]
loads, errs, mixed = 0, [], []
open(out + ".ready", "w").close()
while not os.path.exists(stop):
    try:
        t = sp.CheckpointManager(root).load()
    except sp.ShardpointError as e:          # documented: a step removed meanwhile, none yet
        errs.append(type(e).__name__); continue
    except Exception as e:                   # anything else is a bug
        mixed.append("undocumented " + repr(e)); continue
    loads += 1
    vals = set(t["w"].flatten().tolist()) | {float(t["step"])}
    if len(vals) != 1:
        mixed.append(sorted(vals))
json.dump({"loads": loads, "errors": errs, "mixed": mixed}, open(out, "w"))
"""


@pytest.mark.slow  # ~15 s on the shared 2-core machine (a second torch process)
def test_trainer_and_observer_share_an_s3_root(s3_env, tmp_path):
    """The file-system scenario of tests/api/test_manager_observer.py, small, on S3: every
    save succeeds and the kept steps verify while an observer loops on load()."""
    import json

    root = s3_env.url(s3_env.fresh_prefix("share"))
    stop, out = str(tmp_path / "stop"), str(tmp_path / "o.json")
    obs = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(OBSERVER), stop, out, root], env=dict(os.environ)
    )
    try:
        for _ in range(600):  # the observer runs before the saves start
            if os.path.exists(out + ".ready") or obs.poll() is not None:
                break
            time.sleep(0.05)
        with sp.CheckpointManager(root, max_to_keep=2) as mgr:
            for step in range(1, 6):
                mgr.save(step, {"w": torch.full((8, 8), float(step)), "step": step})
            assert mgr.all_steps() == [4, 5]
            assert all(verify_checkpoint(mgr.path(s)).ok for s in (4, 5))
    finally:
        open(stop, "w").close()
        try:
            obs.wait(timeout=60)
        except subprocess.TimeoutExpired:
            obs.kill()
            raise
    o = json.load(open(out))
    assert o["mixed"] == [], o["mixed"]
    assert o["loads"] + len(o["errors"]) > 0
    assert step_prefixes(root) == ["step_00000004", "step_00000005"]
