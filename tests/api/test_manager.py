"""CheckpointManager: a stateful test against a trivially correct model of what must be on
disk (saves, crashes leaving real leftovers, retention, best-k, restarts), and real SIGKILLs."""

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import shardpoint as sp
from shardpoint.api.manager import METRICS_KEY, CheckpointManager


def model_keep(steps: dict, max_to_keep, keep_every, keep_best, mode) -> set:
    """The retention rule, written out plainly: steps maps step -> loss (or None)."""
    order = sorted(steps)
    keep = {order[-1]}
    keep |= set(order if max_to_keep is None else order[-max_to_keep:])
    keep |= {s for s in order if keep_every and s % keep_every == 0}
    if keep_best:
        scored = [s for s in order if steps[s] is not None]
        sign = 1 if mode == "min" else -1
        scored.sort(key=lambda s: (sign * steps[s], -s))
        keep |= set(scored[:keep_best])
    return keep


class ManagerMachine(RuleBasedStateMachine):
    @initialize(
        max_to_keep=st.sampled_from([None, 1, 2, 3]),
        keep_every=st.sampled_from([None, 3]),
        best=st.sampled_from([None, ("min", None), ("min", 2), ("max", 1)]),
    )
    def setup(self, max_to_keep, keep_every, best):
        self.root = tempfile.mkdtemp(prefix="sp-mgr-")
        mode, keep_best = best or ("min", None)
        self.kw = dict(
            max_to_keep=max_to_keep,
            keep_every=keep_every,
            best_mode=mode,
            best_metric="loss" if best else None,
            keep_best=keep_best,
        )
        self.keep_best = keep_best if best else None  # best_metric alone keeps none extra
        self.mgr = CheckpointManager(self.root, **self.kw)
        self.disk: dict = {}  # step -> (value, loss): what must be committed on disk
        self.next_step = 1
        self.foreign: set = set()  # names a person made in root: never the manager's

    def teardown(self):
        shutil.rmtree(getattr(self, "root", "/nonexistent"), ignore_errors=True)

    def _retain(self):
        keep = model_keep(
            {s: v[1] for s, v in self.disk.items()},
            self.kw["max_to_keep"],
            self.kw["keep_every"],
            self.keep_best,
            self.kw["best_mode"],
        )
        self.disk = {s: v for s, v in self.disk.items() if s in keep}

    @rule(
        value=st.integers(-1000, 1000),
        loss=st.one_of(st.none(), st.integers(0, 5)),
        skip=st.integers(1, 3),
    )
    def save(self, value, loss, skip):
        step = self.next_step + skip - 1
        self.next_step = step + 1
        metrics = None if loss is None else {"loss": float(loss), "acc": 0.5}
        self.mgr.save(step, {"w": torch.full((3,), float(value)), "step": step}, metrics=metrics)
        self.disk[step] = (value, None if loss is None else float(loss))
        self._retain()
        self.check_clean()

    @precondition(lambda self: self.disk)
    @rule(value=st.integers(-1000, 1000))
    def overwrite_latest(self, value):
        step = max(self.disk)
        with pytest.raises(sp.CheckpointExistsError):
            self.mgr.save(step, {"w": torch.zeros(3), "step": step})
        self.mgr.save(step, {"w": torch.full((3,), float(value)), "step": step}, force=True)
        self.disk[step] = (value, None)
        self._retain()
        self.check_clean()

    @rule(
        kind=st.sampled_from(["staging", "bare_step", "half_step", "half_delete", "mid_overwrite"]),
        data=st.data(),
    )
    def crash_and_restart(self, kind, data):
        """Leave on disk what a process killed at some point leaves, then start again."""
        self.moved_aside = getattr(self, "moved_aside", None)
        hidden = os.path.join(self.root, f".step_{self.next_step:08d}.shardpoint-tmp-1a2b3c")
        if kind == "staging":  # killed while ranks wrote chunks
            os.makedirs(os.path.join(hidden, "tensors", "w", "c"), exist_ok=True)
            open(os.path.join(hidden, "tensors", "w", "zarr.json"), "w").close()
        elif kind == "bare_step":  # a directory some tool made, never a checkpoint,
            self.foreign.add(f"step_{self.next_step}")  # named like a step: not the manager's
            os.makedirs(os.path.join(self.root, f"step_{self.next_step}"), exist_ok=True)
        elif kind == "half_step":  # files but no manifest, under a step-like name
            name = f"step_{self.next_step:09d}"
            self.foreign.add(name)
            os.makedirs(os.path.join(self.root, name, "tensors", "w"), exist_ok=True)
        visible = sorted(s for s in self.disk if s != self.moved_aside)
        if kind == "half_delete" and visible:  # killed during retention's rmtree
            victim = data.draw(st.sampled_from(visible))
            os.rename(
                self.mgr.path(victim),
                os.path.join(self.root, f".step_{victim:08d}.shardpoint-tmp-dead01"),
            )
            del self.disk[victim]
        elif kind == "mid_overwrite" and visible and self.moved_aside is None:
            victim = data.draw(st.sampled_from(visible))  # killed between the commit renames
            os.rename(
                self.mgr.path(victim),
                os.path.join(self.root, f".step_{victim:08d}.shardpoint-old-beef02"),
            )
            self.moved_aside = victim
            os.makedirs(
                os.path.join(self.root, f".step_{victim:08d}.shardpoint-tmp-beef02", "tensors"),
                exist_ok=True,
            )
        before = set(os.listdir(self.root))
        self.mgr = CheckpointManager(self.root, **self.kw)
        # leftovers stay until this manager saves or loads: constructing one never cleans
        assert set(os.listdir(self.root)) == before

    def check_clean(self):
        # nothing but the model's steps in root and what a person made there (never deleted):
        # every leftover was cleaned (or put back)
        self.moved_aside = None
        assert sorted(os.listdir(self.root)) == sorted(
            [f"step_{s:08d}" for s in self.disk] + list(self.foreign)
        )

    @rule()
    def load_latest(self):
        if not self.disk:
            with pytest.raises(sp.CheckpointNotFoundError):
                self.mgr.load()
            return
        latest = max(self.disk)
        out = self.mgr.load()
        assert sorted(out) == ["step", "w"] and out["step"] == latest  # metrics not returned
        assert torch.equal(out["w"], torch.full((3,), float(self.disk[latest][0])))
        like = {"w": torch.empty(3), "step": 0}
        assert self.mgr.load(latest, like=like)["step"] == latest
        self.check_clean()

    @invariant()
    def disk_matches_model(self):
        if not hasattr(self, "mgr"):
            return
        # a step moved aside by a crashed overwrite is invisible until the next save/load
        # puts it back
        hidden = getattr(self, "moved_aside", None)
        visible = sorted(s for s in self.disk if s != hidden)
        assert self.mgr.all_steps() == visible
        assert self.mgr.latest_step() == (visible[-1] if visible else None)
        for s in visible:
            assert self.mgr.metrics(s).get("loss") == self.disk[s][1]
        if self.kw["best_metric"]:
            scored = [s for s in visible if self.disk[s][1] is not None]
            sign = 1 if self.kw["best_mode"] == "min" else -1
            want = min(scored, key=lambda s: (sign * self.disk[s][1], -s)) if scored else None
            assert self.mgr.best_step() == want


ManagerMachine.TestCase.settings = settings(max_examples=12, stateful_step_count=10, deadline=None)
TestManagerStateful = ManagerMachine.TestCase


def test_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointManager(tmp_path, max_to_keep=0)
    with pytest.raises(ValueError, match="best_metric"):
        CheckpointManager(tmp_path, keep_best=2)
    with pytest.raises(ValueError, match="best_mode"):
        CheckpointManager(tmp_path, best_metric="loss", best_mode="lowest")
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(sp.UnsupportedValueError, match="reserved"):
        mgr.save(1, {METRICS_KEY: 1}, metrics={"loss": 1.0})
    with pytest.raises(sp.UnsupportedValueError, match="dict state"):
        mgr.save(1, [torch.zeros(2)], metrics={"loss": 1.0})
    assert mgr.all_steps() == []


def test_metrics_are_values_inside_the_checkpoint(tmp_path):
    with CheckpointManager(tmp_path, best_metric="loss") as mgr:
        mgr.save(10, {"x": torch.arange(3)}, metrics={"loss": 2.5})
        mgr.save(20, {"x": torch.arange(3)}, metrics={"loss": 1.5})
    m = sp.read_metadata(os.path.join(tmp_path, "step_00000020"))
    assert m.tree[METRICS_KEY]["loss"].value == 1.5  # in the manifest, no side file
    assert sorted(os.listdir(os.path.join(tmp_path, "step_00000020"))) == [
        "manifest.msgpack",
        "packed",
    ]  # the packed layout (the default): its data objects, no side file
    assert len(os.listdir(os.path.join(tmp_path, "step_00000020", "packed"))) == 1
    assert CheckpointManager(tmp_path, best_metric="loss").best_step() == 20
    assert CheckpointManager(tmp_path, best_metric="loss", best_mode="max").best_step() == 10


_KILLED = textwrap.dedent("""
    import sys, torch, shardpoint as sp
    mgr = sp.CheckpointManager(sys.argv[1], max_to_keep=2)
    start = (mgr.latest_step() or 0) + 1
    for step in range(start, start + 1000):
        mgr.save(step, {"w": torch.full((64, 64), float(step)), "step": step},
                 metrics={"loss": 1.0 / step})
        print(step, flush=True)
""")


def test_sigkill_mid_save_keeps_the_last_checkpoint_and_restarts_clean(tmp_path):
    """Real SIGKILLs at random moments of a save loop; each restart resumes from the newest
    committed step, cleans the leftovers and keeps retention going."""
    rnd = random.Random(7)
    root = str(tmp_path / "ckpt")
    for _round in range(2):
        p = subprocess.Popen(
            [sys.executable, "-c", _KILLED, root],
            stdout=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        try:
            seen = [int(p.stdout.readline()) for _ in range(rnd.randint(2, 4))]
            import time

            time.sleep(rnd.uniform(0.0, 0.05))  # somewhere inside the next save
            p.send_signal(signal.SIGKILL)
        finally:
            p.kill()
            p.wait(timeout=30)
        mgr = CheckpointManager(root, max_to_keep=2)
        latest = mgr.latest_step()
        assert latest is not None and latest >= seen[-1]
        assert mgr.load()["step"] == latest  # the resume cleans the leftovers
        assert all(not n.startswith(".") for n in os.listdir(root))
        for s in mgr.all_steps():
            out = mgr.load(s)
            assert out["step"] == s and torch.equal(out["w"], torch.full((64, 64), float(s)))
            assert mgr.metrics(s) == {"loss": 1.0 / s}
        assert len(mgr.all_steps()) <= 3  # at most one extra: the kill fell before retention


@pytest.mark.skipif(not hasattr(sp.api, "AsyncSave"), reason="sp.save has no async_save yet")
def test_async_saves_retain_after_commit_and_wait_on_close(tmp_path):
    w = torch.zeros(256, 256)
    with CheckpointManager(tmp_path, max_to_keep=1, async_save=True) as mgr:
        for step in (1, 2, 3):
            w.fill_(float(step))
            h = mgr.save(step, {"w": w, "step": step}, metrics={"loss": float(step)})
            w.fill_(-1.0)  # the training goes on mutating the state
            assert isinstance(h, sp.api.AsyncSave)
        h.wait()
    # closed: the last save committed, retention applied after it, values as at save()
    assert mgr.all_steps() == [3] and mgr.metrics(3) == {"loss": 3.0}
    out = mgr.load()
    assert out["step"] == 3 and torch.equal(out["w"], torch.full((256, 256), 3.0))
    assert sorted(os.listdir(tmp_path)) == ["step_00000003"]
