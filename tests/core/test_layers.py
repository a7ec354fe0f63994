"""The layering contract (pyproject.toml, [tool.importlinter]) holds, and it is a real check:
an import from a lower layer to a higher one, even inside a function, fails it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["core", "reference", "testing", "conformance"]


def _lint(repo: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(repo / d) for d in SOURCES)}
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(exe)], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=120)


def test_layers_contract_holds():
    r = _lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


def test_a_function_level_import_upwards_breaks_the_contract(tmp_path):
    for d in SOURCES:
        shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "core" / "shardpoint_core" / "sneaky.py").write_text(
        "def f():\n    from shardpoint.api import save\n    return save\n")
    r = _lint(tmp_path)
    assert r.returncode != 0
    assert "shardpoint_core.sneaky" in r.stdout and "BROKEN" in r.stdout


@pytest.mark.parametrize("module", ["shardpoint_core.verify", "shardpoint.tools.cli",
                                    "shardpoint_core.zarr"])
def test_the_core_and_the_cli_import_no_torch(module):
    code = f"import sys, {module}; sys.exit('torch' in sys.modules or 'jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_inspect_and_verify_of_150_tensors_never_import_torch(tmp_path):
    """The CLI's read-only commands run on the core alone: no torch at start-up."""
    import torch
    import shardpoint as sp
    ckpt = str(tmp_path / "ckpt")
    sp.save({f"layers.{i}": torch.full((8, 8), float(i)) for i in range(150)}, ckpt)
    for cmd in (["inspect", ckpt], ["verify", ckpt]):
        r = subprocess.run([sys.executable, "-X", "importtime", "-m", "shardpoint", *cmd],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines()
                    if line.startswith("import time:")}
        assert "shardpoint_core.manifest" in imported
        assert not {m for m in imported if m.split(".")[0] in ("torch", "jax")}, cmd
