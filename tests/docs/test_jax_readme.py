"""The JAX tutorial's examples that need more checks than running (test_doc_blocks.py runs
the others): what they save, a second run that resumes, the Flax example on 4 CPU devices."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("jax", reason="shardpoint_jax needs jax (pip install -e '.[jax]')")

from shardpoint_jax.launch import run_processes  # noqa: E402

from .blocks import find  # noqa: E402


def block(marker):
    """The JAX tutorial's example that contains ``marker``."""
    return find("docs/tutorials/jax.md", marker).code


def test_flax_example_runs_on_four_devices(tmp_path):
    pytest.importorskip("flax", reason="the Flax example needs flax (pip install -e '.[flax]')")
    pytest.importorskip("optax", reason="the Flax example needs optax")
    run_processes(block("nnx"), 1, 4, cwd=str(tmp_path), timeout=300)
    import shardpoint_jax as spj

    got = spj.load(str(tmp_path / "ckpt" / "flax"))
    assert got["model"]["kernel"]["value"].shape == (8, 16)
    assert int(got["opt"]["step"]["value"]) == 0


def test_async_save_example_runs(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", block("jax_async")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert r.returncode == 0, r.stderr
    import shardpoint_jax as spj

    got = spj.load(str(tmp_path / "ckpt" / "jax_async"))
    assert got["step"] == 1 and float(got["w"].sum()) == 1024 * 1024  # the values at the call


def test_checkpoint_manager_example_runs_and_resumes(tmp_path):
    code = block("spj.CheckpointManager(")
    for _run in range(2):  # the second run resumes from the first one's step 6
        r = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )
        assert r.returncode == 0, r.stderr
    import numpy as np
    import shardpoint_jax as spj

    mgr = spj.CheckpointManager(str(tmp_path / "ckpt" / "jax_run"))
    assert mgr.all_steps() == [10, 12]  # the best (lowest loss) is the newest here
    got = mgr.load()
    want = np.linspace(-1.0, 1.0, 16, dtype=np.float32)
    for _ in range(12):
        want = want * np.float32(0.9)
    assert got["step"] == 12 and np.allclose(np.asarray(got["params"]["w"]), want)
    assert mgr.metrics(12)["loss"] == float(np.abs(np.asarray(got["params"]["w"])).mean())
