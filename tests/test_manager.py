"""CheckpointManager: a stateful model test against a trivially correct model of retention."""
import os

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import shardpoint as sp
from shardpoint.manager import CheckpointManager


class ManagerMachine(RuleBasedStateMachine):
    """Saves steps in increasing order, crashes saves half-way, reloads; compares with a model
    that keeps the ``keep_last`` newest committed steps plus multiples of ``keep_every``."""

    @initialize(keep_last=st.integers(1, 3), keep_every=st.sampled_from([None, 4]))
    def setup(self, keep_last, keep_every):
        import tempfile
        self.root = tempfile.mkdtemp(prefix="sp-mgr-")
        self.mgr = CheckpointManager(self.root, keep_last=keep_last, keep_every=keep_every)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.model: dict = {}      # step -> value saved
        self.next_step = 1

    @rule(value=st.integers(-1000, 1000))
    def save(self, value):
        step = self.next_step
        self.next_step += 1
        self.mgr.save(step, {"w": torch.full((3,), float(value)), "step": step})
        self.model[step] = value
        steps = sorted(self.model)
        keep = set(steps[-self.keep_last:])
        if self.keep_every:
            keep |= {s for s in steps if s % self.keep_every == 0}
        self.model = {s: v for s, v in self.model.items() if s in keep}

    @rule()
    def crashed_save(self):
        # what a save killed before its commit leaves: a staging dir and no manifest
        step = self.next_step
        self.next_step += 1
        stage = os.path.join(self.root, f".step_{step:08d}.shardpoint-tmp-abc123")
        os.makedirs(os.path.join(stage, "tensors", "w"))
        os.makedirs(self.mgr.path(step))   # a bare directory without manifest

    @rule()
    def load_latest(self):
        if not self.model:
            with pytest.raises(sp.CheckpointNotFoundError):
                self.mgr.load()
            return
        latest = max(self.model)
        out = self.mgr.load()
        assert out["step"] == latest
        assert torch.equal(out["w"], torch.full((3,), float(self.model[latest])))

    @invariant()
    def committed_steps_match_model(self):
        if hasattr(self, "mgr"):
            assert self.mgr.steps() == sorted(self.model)


ManagerMachine.TestCase.settings = settings(max_examples=8, stateful_step_count=8,
                                            deadline=None)
TestManager = ManagerMachine.TestCase


def test_stale_staging_dirs_are_cleaned(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    stale = tmp_path / ".step_00000001.shardpoint-tmp-deadbeef"
    stale.mkdir()
    mgr.save(2, {"x": torch.arange(4)})
    assert not stale.exists()
    assert mgr.steps() == [2]
    assert torch.equal(mgr.load(2)["x"], torch.arange(4))
