"""Every code block of README.md and docs/ runs, each in a temporary directory of its own
(tests/docs/blocks.py reads them and their ``<!-- test: ... -->`` options): ``python`` blocks
in one process (torch already imported: forked from the launcher's fork server), on gloo ranks
(``ranks=``) or in JAX processes; ``sh`` blocks with ``bash -e``, the project's commands on
PATH. Blocks that need a part the install did not bring skip, naming the extra."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from shardpoint_testing.launch import run_code, run_world

from .blocks import EXTRA, ROOT, Block, all_blocks, named

ALL = all_blocks()
# Run here: python and sh blocks that no other test runs and that are not files for another.
RUN = [b for b in ALL if b.lang in ("python", "sh") and not {"skip", "by", "file"} & set(b.opts)]
BIN = os.path.dirname(sys.executable)


def _needs(block: Block) -> None:
    for mod in block.needs:
        extra = EXTRA.get(mod, "all")
        pytest.importorskip(mod, reason=f"{block.id} needs {mod} (pip install -e '.[{extra}]')")


def _exec_block(rank, world, code, cwd):
    os.chdir(cwd)
    exec(compile(code, "doc block", "exec"), {"__name__": "__main__"})
    return rank


def _env(**extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", JAX_PLATFORMS="cpu", **extra)
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    return env


def run_sh(code: str, cwd, env: dict | None = None, timeout: float = 300) -> str:
    """``bash -e -o pipefail``; whatever the block started in the background is stopped after
    (it runs in a session of its own)."""
    p = subprocess.Popen(
        ["bash", "-e", "-o", "pipefail", "-c", code],
        cwd=cwd,
        env=env or _env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        p.wait()
    assert p.returncode == 0, f"exit {p.returncode}\n{code}\n{out[-4000:]}"
    return out


def run_python(block: Block, code: str, cwd, env: dict | None = None) -> str:
    """As the block's options say: ranks, JAX devices, a fresh interpreter for JAX (never
    forked from a process that has imported torch), else forked from the fork server."""
    if "ranks" in block.opts:
        n = int(block.opts["ranks"])
        assert run_world(n, _exec_block, code, str(cwd), timeout=240) == list(range(n))
        return ""
    if "devices" in block.opts:
        from shardpoint_jax.launch import run_processes

        n = int(block.opts.get("processes", 1))
        return run_processes(
            code, n, int(block.opts["devices"]), cwd=str(cwd), timeout=300, env=env
        )[0]
    if any(m.split(".")[0] in ("jax", "flax", "optax", "orbax") for m in block.needs):
        r = subprocess.run(
            [sys.executable, "-c", code],
            cwd=cwd,
            env=env or _env(),
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )
    else:
        r = run_code(code, cwd=str(cwd), env=env, timeout=300)
    assert r.returncode == 0, f"{block.id}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r.stdout


def run_block(block: Block, cwd, request=None) -> str:
    """Run ``block`` in ``cwd`` as its options say, the block it comes ``after`` first."""
    _needs(block)
    env, code = None, block.code
    if block.opts.get("s3"):
        s3 = request.getfixturevalue("s3_env")
        code = code.replace("s3://my-bucket/", f"s3://{s3.bucket}/{s3.fresh_prefix('docs')}/")
        env = _env()
    if block.opts.get("gcs"):
        gcs = request.getfixturevalue("gcs_env")
        code = code.replace("gs://my-bucket/", f"gs://{gcs.bucket}/{gcs.fresh_prefix('docs')}/")
        env = _env()
    if "after" in block.opts:
        first = named(block.page, block.opts["after"])
        if "file" in first.opts:
            (cwd / first.opts["file"]).write_text(first.code)
        else:
            run_block(first, cwd, request)
    if block.lang == "sh":
        return run_sh(code, cwd, env)
    return run_python(block, code, cwd, env)


@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_block_runs(block, tmp_path, request):
    run_block(block, tmp_path, request)


def test_every_block_is_run_or_says_why():
    """A block is run here, by a named test, or skipped with a reason; options parse; every
    ``after=`` names a block of its page; only python and sh blocks say how to run."""
    assert len(RUN) >= 20
    for b in ALL:
        if b.lang in ("python", "sh"):
            assert set(b.opts) & {"skip", "by", "file"} or b in RUN, b.id
        else:
            assert not b.opts, f"{b.id}: a {b.lang or 'plain'} block is never run"
        if "after" in b.opts:
            named(b.page, b.opts["after"])


def test_blocks_run_by_other_tests_name_a_real_test():
    defined = set()
    for d, _subs, files in os.walk(os.path.join(ROOT, "tests")):
        for f in files:
            if f.startswith("test_") and f.endswith(".py"):
                defined |= set(
                    re.findall(r"^def (test_\w+)", open(os.path.join(d, f)).read(), re.M)
                )
    for b in ALL:
        if "by" in b.opts:
            assert b.opts["by"] in defined, f"{b.id}: by={b.opts['by']} is no test"


PATH = re.compile(
    r"""["'](?:file://\{[^}]*\}/)?((?:ckpt|s3://my-bucket|gs://my-bucket|export)/"""
    r"""[^"'\s]*)["'\s]"""
)


WRITES = re.compile(r"save\(|Writer\(|convert|makedirs\(")


def test_examples_use_paths_of_their_own():
    """Run in order in one directory, the examples would not collide: no checkpoint path
    appears on two pages, and on a page one block writes it (others may read it)."""
    seen: dict = {}
    writer: dict = {}
    found = 0
    for b in ALL:
        if b.lang not in ("python", "sh"):
            continue
        for path in set(PATH.findall(b.code)):
            found += 1
            other = seen.setdefault(path, b.page)
            assert other == b.page, f"{path!r} is used by {other} and {b.id}"
            if WRITES.search(b.code):
                first = writer.setdefault(path, b.id)
                assert first == b.id, f"{path!r} is written by {first} and {b.id}"
    assert found >= 20
