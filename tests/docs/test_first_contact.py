"""What a newcomer meets first: the README's install and test commands pass on their own, so
no test folder may stand in for a package the install did not bring (tests/jax was imported as
``jax`` where JAX was absent: ``importorskip`` did not skip, and the suite failed), and every
test of an optional part skips with its reason."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests")

# The optional parts the suite skips without: import names, as importorskip names them.
OPTIONAL = ("jax", "jaxlib", "orbax", "flax", "optax")


def test_every_test_folder_is_a_package():
    """tests/ and each folder below it holding Python files has an ``__init__.py``: pytest then
    puts the repository root on sys.path, not tests/, and a folder is ``tests.jax``, never a
    top-level ``jax`` (a namespace package that hides the real one's absence)."""
    missing = [
        os.path.relpath(d, ROOT)
        for d, _subs, files in os.walk(TESTS)
        if "__pycache__" not in d
        and any(f.endswith(".py") for f in files)
        and "__init__.py" not in files
    ]
    assert not missing, f"test folders without __init__.py: {missing}"


# Hides the named top-level packages as if they were not installed: a regular package of that
# name anywhere on sys.path is passed over, while a folder without __init__.py would still be
# found (as a namespace package), as on a machine without them.
HIDE = textwrap.dedent("""
    import importlib.machinery, os, sys

    class _Absent:
        def find_spec(self, name, path=None, target=None):
            if path is not None or name not in {names!r}:
                return None
            keep = [p for p in sys.path
                    if not os.path.isfile(os.path.join(p or ".", name, "__init__.py"))]
            spec = importlib.machinery.PathFinder.find_spec(name, keep)
            if spec is None:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return spec

    sys.meta_path.insert(0, _Absent())
""")


def test_tests_of_optional_parts_skip_when_the_part_is_absent(tmp_path):
    """With JAX, Orbax, Flax and optax hidden (the README's install brings none of them), the
    JAX tests and the README's JAX examples are collected and skip, each with its reason."""
    (tmp_path / "sitecustomize.py").write_text(HIDE.format(names=set(OPTIONAL)))
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [str(tmp_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
    )
    files = [
        "tests/jax/test_jax_core.py",
        "tests/jax/test_jax_interop.py",
        "tests/docs/test_jax_readme.py",
        "tests/integrations/test_orbax_handler.py",
    ]
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-rs", "-p", "no:cacheprovider", *files],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    out = r.stdout + r.stderr
    assert r.returncode in (0, 5), out[-3000:]  # 5: every module skipped, none collected
    assert "error" not in out.lower().split("short test summary")[-1], out[-3000:]
    assert f"{len(files)} skipped" in out, out[-3000:]
    assert "jax" in out.split("short test summary")[-1], out[-3000:]  # the reason shown


def readme_commands() -> tuple[str, str]:
    """The README's first two ``sh`` blocks: the install (and demo) command, the test command."""
    import re

    readme = open(os.path.join(ROOT, "README.md")).read()
    install, test = re.findall(r"```sh\n(.*?)\n```", readme, re.S)[:2]
    return install.strip(), test.strip()


def test_ci_first_runs_the_readme_commands_verbatim_with_nothing_in_between():
    install, test = readme_commands()
    assert "pip install" in install and "[test]" in install and test == "python -m pytest -q"
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert os.access(os.path.join(ROOT, ".ci", "run"), os.X_OK)
    lines = [x.strip() for x in ci.splitlines() if x.strip() and not x.strip().startswith("#")]
    i = next((n for n, x in enumerate(lines) if install in x), None)  # verbatim, one line
    assert i is not None, f".ci/run does not run the README's install command: {install}"
    assert lines[i + 1] == test  # and then exactly this
    before = lines[:i]
    assert not any("pip " in x or "venv" in x for x in before), before  # a fresh venv first
    assert lines[i].startswith(install)
    rest = lines[i + 2 :]
    assert any("mkdocs build --strict" in x for x in rest)  # the docs, warnings as errors
    assert any(".[all,test,docs]" in x for x in rest)  # then every extra
    assert rest.count(test) == 1  # and the suite again
