"""shardpoint_core.format.policy: step names and composable retention, as both managers use them;
the managers' keyword shortcuts spell the same policies; ``keep_best`` is never implicit."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardpoint as sp
from shardpoint_core.format.errors import InvalidKeyError, InvalidOptionError
from shardpoint_core.format.policy import (
    AnyOf,
    BestN,
    EveryNSteps,
    KeepAll,
    LatestN,
    parse_step,
    policy_from_options,
    retained,
    step_name,
)


def test_step_names_round_trip_and_refuse_non_steps():
    assert step_name(42) == "step_00000042" and parse_step("step_00000042") == 42
    assert parse_step("step_1x") is None and parse_step(".step_00000001.shardpoint-tmp-a") is None
    for bad in (-1, True, 1.5, "3"):
        with pytest.raises(InvalidKeyError):
            step_name(bad)


def _model(steps, losses, latest, every, best, mode):
    """The retention rule written out plainly."""
    keep = {max(steps)} | set(sorted(steps)[-latest:] if latest else steps)
    keep |= {s for s in steps if every and s % every == 0}
    if best:
        scored = sorted(
            (s for s in steps if losses.get(s) is not None and math.isfinite(losses[s])),
            key=lambda s: ((losses[s] if mode == "min" else -losses[s]), -s),
        )
        keep |= set(scored[:best])
    return keep


@settings(max_examples=100, deadline=None)
@given(
    steps=st.sets(st.integers(0, 60), min_size=1, max_size=20),
    losses=st.dictionaries(
        st.integers(0, 60), st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True))
    ),
    latest=st.one_of(st.none(), st.integers(1, 5)),
    every=st.one_of(st.none(), st.integers(1, 7)),
    best=st.one_of(st.none(), st.integers(1, 4)),
    mode=st.sampled_from(["min", "max"]),
)
def test_options_spell_the_composed_policy(steps, losses, latest, every, best, mode):
    def metrics_of(s):
        return {} if losses.get(s) is None else {"loss": losses[s]}

    pol = policy_from_options(latest, every, "loss" if best else None, mode, best)
    steps = sorted(steps)
    assert retained(pol, steps, metrics_of) == _model(steps, losses, latest, every, best, mode)
    parts = [LatestN(latest) if latest else KeepAll()]
    parts += [EveryNSteps(every)] if every else []
    parts += [BestN(best, "loss", mode)] if best else []
    assert retained(AnyOf(*parts), steps, metrics_of) == retained(pol, steps, metrics_of)


def test_best_metric_alone_keeps_no_extra_step():
    """Issue 21: keep_best silently became 1 when best_metric was set."""
    pol = policy_from_options(max_to_keep=1, best_metric="loss")
    metrics = {1: 0.1, 2: 0.5, 3: 0.9}
    assert retained(pol, [1, 2, 3], lambda s: {"loss": metrics[s]}) == {3}


def test_bad_policies_and_options_are_refused():
    for make in (
        lambda: LatestN(0),
        lambda: EveryNSteps(1.5),
        lambda: BestN(1, "loss", "low"),
        lambda: BestN(1, 3),
        lambda: AnyOf(3),
        lambda: policy_from_options(keep_best=2),
    ):
        with pytest.raises(InvalidOptionError):
            make()


def test_managers_take_a_policy_a_backend_and_options(tmp_path):
    from shardpoint_core.transactions.backend import ZarrBackend

    be = ZarrBackend(fsync=False)
    pol = AnyOf(LatestN(1), BestN(1, "loss"))
    with pytest.raises(InvalidOptionError, match="not both"):
        sp.CheckpointManager(str(tmp_path), retention=pol, max_to_keep=2)
    with sp.CheckpointManager(
        str(tmp_path),
        retention=pol,
        best_metric="loss",
        backend=be,
        load_options=sp.LoadOptions(strategy="direct"),
    ) as mgr:
        for step, loss in ((1, 0.5), (2, 0.1), (3, 0.7), (4, 0.9)):
            mgr.save(step, {"w": torch.full((2,), float(step))}, metrics={"loss": loss})
        assert mgr.all_steps() == [2, 4] and mgr.best_step() == 2
        assert torch.equal(mgr.load(2)["w"], torch.full((2,), 2.0))
    spj = pytest.importorskip("shardpoint_jax")
    jm = spj.CheckpointManager(str(tmp_path), retention=pol, best_metric="loss")
    assert jm.retained(jm.all_steps()) == {2, 4} and jm.best_step() == 2
