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
    return subprocess.run(
        [str(exe)], cwd=repo, env=env, capture_output=True, text=True, timeout=120
    )


def test_layers_contract_holds():
    r = _lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


def test_a_function_level_import_upwards_breaks_the_contract(tmp_path):
    for d in SOURCES:
        shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "core" / "shardpoint_core" / "sneaky.py").write_text(
        "def f():\n    from shardpoint.api import save\n    return save\n"
    )
    r = _lint(tmp_path)
    assert r.returncode != 0
    assert "shardpoint_core.sneaky" in r.stdout and "BROKEN" in r.stdout


@pytest.mark.parametrize(
    "rung,planted,target",
    [
        (
            "format",
            "def f():\n    from shardpoint_core.transactions.backend import ZarrBackend\n"
            "    return ZarrBackend\n",
            "shardpoint_core.transactions",
        ),
        (
            "arrays",
            "def f():\n    from shardpoint_core.commit.posix import PosixCommitter\n"
            "    return PosixCommitter\n",
            "shardpoint_core.commit",
        ),
        ("stores", "import shardpoint_core.arrays.array\n", "shardpoint_core.arrays"),
    ],
)
def test_an_upward_or_sideways_import_inside_the_core_breaks_the_ladder(
    tmp_path, rung, planted, target
):
    """The core's ladder (format < stores < arrays | commit < transactions < verify) is a
    contract of its own: a rung importing a higher one, or arrays and commit importing each
    other, fails it, inside a function too."""
    for d in SOURCES:
        shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "core" / "shardpoint_core" / rung / "sneaky.py").write_text(planted)
    r = _lint(tmp_path)
    assert r.returncode != 0
    assert "the core's ladder" in r.stdout and "BROKEN" in r.stdout
    assert f"shardpoint_core.{rung}.sneaky -> {target}" in r.stdout, r.stdout


def test_a_module_outside_every_rung_breaks_the_ladder(tmp_path):
    """Every module of the core sits in a rung (the contract is exhaustive): a new top-level
    module must be placed, not left beside the ladder."""
    for d in SOURCES:
        shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "core" / "shardpoint_core" / "loose.py").write_text("X = 1\n")
    r = _lint(tmp_path)
    assert r.returncode != 0 and "shardpoint_core.loose" in r.stdout + r.stderr


def _cycles(package: str) -> list:
    """The import cycles among ``package``'s modules (function-level imports included): its
    strongly connected components of more than one module."""
    import grimp

    graph = grimp.build_graph(package)
    edges = {
        m: {w for w in graph.find_modules_directly_imported_by(m) if w in graph.modules}
        for m in graph.modules
    }
    index: dict = {}
    low: dict = {}
    stack: list = []
    on: set = set()
    found = []
    for start in sorted(edges):  # Tarjan, iterative (no recursion limit)
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


@pytest.mark.parametrize(
    "package",
    [
        "shardpoint_core",
        "shardpoint",
        "shardpoint_jax",
        "shardpoint_testing",
        "shardpoint_conformance",
    ],
)
def test_no_import_cycle_in_any_package(package):
    pytest.importorskip("grimp")
    assert _cycles(package) == []


def test_the_cycle_check_finds_a_planted_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / "cyc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from cyc import b\n    return b\n")
    (pkg / "b.py").write_text("from cyc import a\n")
    (pkg / "c.py").write_text("from cyc import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _cycles("cyc") == [["cyc.a", "cyc.b"]]


@pytest.mark.parametrize(
    "module", ["shardpoint_core.verify", "shardpoint.tools.cli", "shardpoint_core.arrays"]
)
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
        r = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "shardpoint", *cmd],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        imported = {
            line.split("|")[-1].strip()
            for line in r.stderr.splitlines()
            if line.startswith("import time:")
        }
        assert "shardpoint_core.format.manifest" in imported
        assert not {m for m in imported if m.split(".")[0] in ("torch", "jax")}, cmd
