"""A trainer and an evaluation job sharing one manager root (issue 19's data loss).

A trainer process saves steps 1..40 through a CheckpointManager (``max_to_keep=1000``, then
``max_to_keep=3``) while an observer process loops on ``CheckpointManager(root).load()``.
Every save must succeed, every step a save reported committed (and retention has not removed
since) must verify, and every load the observer got must hold one step's tensors, never a mix;
a load that loses its step to retention raises a documented error. For both front ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from shardpoint_core.verify import verify_checkpoint

STEPS = 40

TORCH_TRAINER = """
import json, sys, torch, shardpoint as sp
out, report = sys.argv[1], {{}}
for root, keep in zip(sys.argv[2::2], map(int, sys.argv[3::2])):
    done, failed = [], []
    with sp.CheckpointManager(root, max_to_keep=keep) as mgr:
        for step in range(1, {steps} + 1):
            state = {{"a": torch.full((64,), float(step)), "b": torch.full((3, 5), float(step)),
                      "step": step}}
            try:
                mgr.save(step, state)
                done.append(step)
            except Exception as e:
                failed.append([step, repr(e)])
    report[root] = {{"done": done, "failed": failed}}
json.dump(report, open(out, "w"))
"""

TORCH_OBSERVER = """
import json, os, sys, time, shardpoint as sp
from shardpoint_core.format import errors
stop, out, roots = sys.argv[1], sys.argv[2], sys.argv[3:]
loads, errs, mixed, i = 0, [], [], 0
while not os.path.exists(stop):
    root, i = roots[i % len(roots)], i + 1
    try:
        t = sp.CheckpointManager(root).load()
    except errors.ShardpointError as e:     # documented: a step removed meanwhile, none yet
        errs.append(type(e).__name__)
        continue
    except Exception as e:                  # anything else is a bug
        mixed.append("undocumented " + repr(e)); continue
    loads += 1
    vals = set(t["a"].tolist()) | set(t["b"].flatten().tolist()) | {float(t["step"])}
    if len(vals) != 1:
        mixed.append(sorted(vals))
json.dump({"loads": loads, "errors": errs, "mixed": mixed}, open(out, "w"))
"""

JAX_TRAINER = """
import json, sys, numpy as np, jax.numpy as jnp, shardpoint_jax as spj
out, report = sys.argv[1], {{}}
for root, keep in zip(sys.argv[2::2], map(int, sys.argv[3::2])):
    done, failed = [], []
    with spj.CheckpointManager(root, max_to_keep=keep) as mgr:
        for step in range(1, {steps} + 1):
            state = {{"a": jnp.full((64,), float(step)), "b": jnp.full((3, 5), float(step)),
                      "step": step}}
            try:
                mgr.save(step, state)
                done.append(step)
            except Exception as e:
                failed.append([step, repr(e)])
    report[root] = {{"done": done, "failed": failed}}
json.dump(report, open(out, "w"))
"""

JAX_OBSERVER = """
import json, os, sys, numpy as np, shardpoint_jax as spj
stop, out, roots = sys.argv[1], sys.argv[2], sys.argv[3:]
loads, errs, mixed, i = 0, [], [], 0
while not os.path.exists(stop):
    root, i = roots[i % len(roots)], i + 1
    try:
        t = spj.CheckpointManager(root).load()
    except spj.errors.ShardpointError as e:
        errs.append(type(e).__name__)
        continue
    except Exception as e:
        mixed.append("undocumented " + repr(e)); continue
    loads += 1
    vals = set(np.asarray(t["a"]).tolist()) | set(np.asarray(t["b"]).ravel().tolist())
    vals |= {float(t["step"])}
    if len(vals) != 1:
        mixed.append(sorted(vals))
json.dump({"loads": loads, "errors": errs, "mixed": mixed}, open(out, "w"))
"""


def _run(tmp_path, trainer: str, observer: str) -> None:
    """The trainer saves into a root with max_to_keep=1000, then one with 3, while the
    observer loads from both in turn; then the checks of the module docstring."""
    keeps = {str(tmp_path / "keep1000"): 1000, str(tmp_path / "keep3"): 3}
    stop, tout, oout = (str(tmp_path / n) for n in ("stop", "t.json", "o.json"))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for root in keeps:
        os.makedirs(root)
    obs = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(observer), stop, oout, *keeps], env=env
    )
    try:
        args = [a for root, keep in keeps.items() for a in (root, str(keep))]
        subprocess.run(
            [sys.executable, "-c", textwrap.dedent(trainer.format(steps=STEPS)), tout, *args],
            env=env,
            timeout=180,
            check=True,
        )
    finally:
        open(stop, "w").close()
        try:
            obs.wait(timeout=60)
        except subprocess.TimeoutExpired:
            obs.kill()
            raise
    report, o = json.load(open(tout)), json.load(open(oout))
    for root, keep in keeps.items():
        t = report[root]
        assert t["failed"] == [], t["failed"]
        assert t["done"] == list(range(1, STEPS + 1))
        kept = t["done"][-keep:]
        for step in kept:
            rep = verify_checkpoint(os.path.join(root, f"step_{step:08d}"))
            assert rep.ok, (root, step, list(rep))
        assert sorted(os.listdir(root)) == [f"step_{s:08d}" for s in kept]
    assert o["mixed"] == [], o["mixed"]  # never tensors of two steps, never a raw error
    assert o["loads"] > 0


def test_torch_manager_observer_never_destroys_a_save(tmp_path):
    _run(tmp_path, TORCH_TRAINER, TORCH_OBSERVER)


def test_jax_manager_observer_never_destroys_a_save(tmp_path):
    pytest.importorskip("jax")
    _run(tmp_path, JAX_TRAINER, JAX_OBSERVER)


def test_a_step_removed_under_a_torch_load_fails_it_cleanly(tmp_path):
    """Retention removes the step between the load's manifest read and its chunk reads (the
    window the observer test hits by chance): the load raises a ShardpointError."""
    import torch
    import shardpoint as sp
    from shardpoint_core.commit.posix import PosixCommitter
    from shardpoint_core.transactions.backend import ZarrBackend

    class RemovedAfterManifest(ZarrBackend):
        def read_manifest(self, path):
            data = super().read_manifest(path)
            assert PosixCommitter().remove(path)
            return data

    path = str(tmp_path / "step_00000001")
    sp.save({"w": torch.ones(64), "b": torch.zeros(3, 5)}, path)
    with pytest.raises(sp.ShardpointError):
        sp.load(path, backend=RemovedAfterManifest())
    assert os.listdir(tmp_path) == []


def test_a_step_removed_under_a_jax_load_fails_it_cleanly(tmp_path, monkeypatch):
    spj = pytest.importorskip("shardpoint_jax")
    import numpy as np
    import shardpoint_jax.loading as loading
    from shardpoint_core.commit.posix import PosixCommitter

    def read_then_remove(path, *args):
        reader = real(path, *args)  # the manifest read
        assert PosixCommitter().remove(path)
        return reader

    path = str(tmp_path / "step_00000001")
    spj.save(path, {"w": np.ones(64), "b": np.zeros((3, 5))})
    real = loading.open_reader
    monkeypatch.setattr(loading, "open_reader", read_then_remove)
    with pytest.raises(spj.errors.ShardpointError):
        spj.load(path)
    assert os.listdir(tmp_path) == []
