"""The resume demo as a newcomer runs it: real forked gloo ranks, a real SIGKILL, three
resumes compared with an uninterrupted run; its checks must also be able to fail."""

import subprocess
import sys

import torch

from shardpoint.tools import demo_train
from shardpoint.api.manager import CheckpointManager


def test_demo_kills_and_resumes_exactly(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "shardpoint.tools.cli", "demo", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )
    text = r.stdout + r.stderr
    assert r.returncode == 0, text
    assert "SIGKILL to all 4 ranks" in text and "demo: PASSED" in text, text
    rows = [line for line in text.splitlines() if line.startswith("(")]
    assert [row.split()[0] for row in rows] == ["(a)", "(b)", "(c)"]
    assert all(row.split()[-1] == "PASS" for row in rows), text
    assert rows[0].count("bitwise equal") == 2  # (a): state and losses exact
    assert all("bitwise equal" in row for row in rows)  # state at resume, every layout
    assert text.count("[reference] step") == 12
    # the killed run left its newest complete checkpoint, nothing else committed after it
    killed = CheckpointManager(tmp_path / "killed")
    assert killed.latest_step() in (4, 8) and killed.metrics(killed.latest_step())["loss"] > 0


def test_digest_sees_a_one_bit_change():
    """The state comparison the demo relies on fails on a single flipped bit."""
    lay = demo_train.make_layout(0, 1, 1)
    tr = demo_train.Trainer(lay, "/nonexistent-root", 4, False)
    before = tr.digest()
    w = tr.w["layers.1.fc2"].detach().view(-1).view(torch.int32)
    w[17] ^= 1
    assert tr.digest() != before
