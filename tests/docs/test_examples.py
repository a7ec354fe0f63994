"""Every script in examples/ runs as a user runs it (CPU, gloo ranks forked by the script),
stops, and resumes from the manager's newest complete step."""

import os
import re
import subprocess
import sys

import shardpoint as sp
from shardpoint_testing.launch import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(script, *args, fresh=False):
    """``python examples/<script> args...``: forked from the launcher's fork server (torch
    already imported; the script forks its ranks itself), or in a fresh interpreter."""
    path, env = os.path.join(ROOT, "examples", script), {**os.environ, "OMP_NUM_THREADS": "1"}
    if fresh:
        r = subprocess.run(
            [sys.executable, path, *map(str, args)],
            capture_output=True,
            text=True,
            timeout=240,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    else:
        r = run_script(path, *args, env=env, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def losses(text):
    return [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", text, re.M)]


def test_megatron_tp_pp_dp_resumes_with_another_dp(tmp_path):
    first = run("megatron_tp_pp_dp.py", tmp_path, 4, 8)  # TP2 x PP2 x DP2
    second = run("megatron_tp_pp_dp.py", tmp_path, 6, 4)  # TP2 x PP2 x DP1
    assert "resumed at step 4 with TP=2 PP=2 DP=1" in second
    curve = losses(first) + losses(second)
    assert len(curve) == 6 and curve[-1] < curve[0]
    assert sp.CheckpointManager(tmp_path).all_steps() == [4, 6]
    keys = sp.read_metadata(tmp_path / "step_00000006").tensors
    assert {f"model/blocks.{b}.fc1" for b in range(4)} <= set(keys)  # global block keys


def test_fsdp2_loop_resumes_on_one_rank(tmp_path):
    first = run("fsdp2_loop.py", tmp_path, 4, 2)
    second = run("fsdp2_loop.py", tmp_path, 6, 1)
    assert "resumed at step 4 on 1 ranks" in second
    curve = losses(first) + losses(second)
    assert len(curve) == 6 and curve == sorted(curve, reverse=True)
    assert any(
        k.startswith("optim/state/0.weight/")
        for k in sp.read_metadata(tmp_path / "step_00000006").tensors
    )  # FQN keys


def test_nanochat_style_loop(tmp_path):
    out = run("nanochat_style.py", tmp_path, fresh=True)  # one as a user starts it
    assert "resumed at step 4" in out and "generated:" in out
    assert sp.CheckpointManager(tmp_path).all_steps() == [6, 8]


def test_megatron_example_refuses_a_world_it_cannot_run_up_front(tmp_path):
    """12 ranks crashed in gloo (192 vs 128) and 6 hung: the batch of 8 needs DP | 8."""
    for ranks in (12, 6, 3):
        r = run_script(
            os.path.join(ROOT, "examples", "megatron_tp_pp_dp.py"), tmp_path, 2, ranks, timeout=120
        )
        assert r.returncode != 0 and f"not {ranks}" in r.stderr, r.stderr
        assert "4, 8, 16, 32" in r.stderr
    assert not os.listdir(tmp_path)
