"""The static checks CI runs (ruff check and format; mypy, strict on the core) pass on the tree, and they
catch what they are there for: a class that claims a core protocol without satisfying it
(``runtime_checkable`` compares method names only, so nothing else would notice), and an
undefined name (the kind that kept a CUDA-only test from ever running)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core"


def _tool(module: str) -> None:
    try:
        __import__(module)
    except ImportError:
        pytest.skip(f"{module} is not installed (the lint extra: pip install -e '.[lint]')")


def _run(*args: str, cwd: Path = ROOT, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MYPYPATH"}
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=cwd,
        env=env,
        text=True,
        capture_output=True,
        timeout=timeout,
    )


def _ruff(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    exe = shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed (the lint extra: pip install -e '.[lint]')")
    return subprocess.run([exe, *args], cwd=cwd, text=True, capture_output=True, timeout=300)


def test_ruff_passes_on_the_tree():
    got = _ruff("check", "--no-cache", ".")
    assert got.returncode == 0, got.stdout + got.stderr


def test_the_tree_is_formatted_and_the_check_catches_a_change(tmp_path):
    got = _ruff("format", "--check", "--no-cache", ".")
    assert got.returncode == 0, got.stdout + got.stderr
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "t.py").write_text("x = {'a':1}\n")
    got = _ruff("format", "--check", "--no-cache", "t.py", cwd=tmp_path)
    assert got.returncode == 1 and "t.py" in got.stdout, got.stdout + got.stderr


def test_ruff_catches_an_undefined_name(tmp_path):
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "t.py").write_text("def f():\n    return bits(1)\n")
    got = _ruff("check", "--no-cache", "t.py", cwd=tmp_path)
    assert got.returncode == 1 and "F821" in got.stdout, got.stdout + got.stderr


@pytest.mark.slow
def test_mypy_passes_on_the_configured_files():
    _tool("mypy")
    got = _run("mypy", "--no-incremental", timeout=900)
    assert got.returncode == 0, got.stdout + got.stderr


_PLANTED = """
    from typing import Iterable, Iterator, Optional
    from base import ByteStore, ObjectInfo, PutData, StoreCapabilities

    class RightStore:
        url = "right://"
        capabilities = StoreCapabilities()
        def get(self, key: str) -> bytes: return b""
        def get_range(self, key: str, start: int, length: int) -> bytes: return b""
        def read_into(self, key: str, start: int, out: memoryview) -> None: ...
        def put(self, key: str, data: PutData, *, if_absent: bool = False) -> None: ...
        def head(self, key: str) -> Optional[ObjectInfo]: return None
        def list(self, prefix: str = "") -> Iterator[ObjectInfo]: return iter(())
        def delete(self, keys: Iterable[str]) -> None: ...
        def make_durable(self, keys: Optional[Iterable[str]] = None) -> None: ...

    class WrongStore(RightStore):
        # wrong: no offset, so a caller's read_into(key, start, out) breaks on it
        def read_into(self, key: str, out: memoryview) -> None: ...  # type: ignore[override]

    def right(s: RightStore) -> ByteStore:
        return s

    def wrong(s: WrongStore) -> ByteStore:
        return s  # the planted violation
"""


def test_mypy_catches_a_wrong_protocol_implementation(tmp_path):
    """A store whose read_into lacks the offset passes ``isinstance(x, ByteStore)`` at run
    time; the static check each of the core's stores carries (a function returning it as
    a ByteStore) fails on it, and only on it. (The protocol's module is checked on its own,
    copied beside the planted file: it imports nothing of the core, and mypy stays quick.)"""
    _tool("mypy")
    from shardpoint_core.stores import base

    src = textwrap.dedent(_PLANTED)
    shutil.copy(base.__file__, tmp_path / "base.py")
    ns: dict = {}
    sys.path.insert(0, str(tmp_path))
    try:
        exec(compile(src, "planted.py", "exec"), ns)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("base", None)
    wrong = ns["WrongStore"]()  # all runtime_checkable sees: the method names
    assert isinstance(wrong, ns["ByteStore"]) and isinstance(wrong, base.ByteStore)
    (tmp_path / "planted.py").write_text(src)
    got = _run(
        "mypy",
        "--strict",
        "--no-incremental",
        "--python-version",
        "3.12",
        "--config-file",
        os.devnull,
        "--cache-dir",
        str(tmp_path / ".mypy_cache"),
        "planted.py",
        cwd=tmp_path,
    )
    errors = [ln for ln in got.stdout.splitlines() if ": error:" in ln]
    line = src.splitlines().index("    return s  # the planted violation") + 1
    assert got.returncode == 1 and len(errors) == 1, got.stdout + got.stderr
    assert (
        f"planted.py:{line}: error: Incompatible return value type" in errors[0]
        and "ByteStore" in errors[0]
    ), got.stdout
