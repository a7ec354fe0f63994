"""The README's first screen (the two commands, a short example, links that resolve) and the
documentation's examples that need more checks than running (test_doc_blocks.py runs the
rest): their output, what they leave on disk, a second run that resumes."""

import os
import re
import subprocess
import sys

from shardpoint_testing.launch import run_code

from .blocks import ROOT, blocks, find

README = open(os.path.join(ROOT, "README.md")).read()
INSTALL = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
    "pip install -e '.[test]' && shardpoint demo"
)
TEST_CMD = "python -m pytest -q"


def run_python(code, cwd):
    """The block as ``python -c`` runs it, in a process forked from the launcher's fork server
    (torch already imported: a fresh interpreter's import is most of a small block's cost).
    The README's example runs in a real fresh interpreter (``test_usage_example_runs``)."""
    r = run_code(code, cwd=cwd, timeout=300)
    assert r.returncode == 0, r.stderr
    return r


def test_first_screen_has_install_demo_and_test_commands():
    first = "\n".join(README.splitlines()[:30])
    assert INSTALL in first and TEST_CMD in first
    assert first.index(INSTALL) < first.index(TEST_CMD)
    sh = [b.code.strip() for b in blocks("README.md") if b.lang == "sh"]
    assert sh[:2] == [INSTALL, TEST_CMD]  # the first two sh blocks, as they are
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert re.search(rf"^{re.escape(TEST_CMD)}\s*$", ci, re.M)  # CI runs exactly this
    assert os.access(os.path.join(ROOT, ".ci", "run"), os.X_OK)


def test_readme_is_a_first_screen_that_links_to_the_docs():
    """At most ~150 lines; each relative link resolves to a file of the repository; the docs'
    pages it names exist (the site's nav in mkdocs.yml lists the same pages)."""
    assert len(README.splitlines()) <= 150
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [x for x in links if "://" not in x]
    assert len(local) >= 15 and any(x.startswith("docs/") for x in local)
    for x in local:
        assert os.path.exists(os.path.join(ROOT, x)), x
    nav = open(os.path.join(ROOT, "mkdocs.yml")).read()
    for x in local:
        if x.startswith("docs/"):
            assert x[len("docs/") :] in nav, x


def test_usage_example_runs(tmp_path):
    example = next(b for b in blocks("README.md") if b.lang == "python").code
    assert len(example.strip().splitlines()) <= 12
    r = subprocess.run(
        [sys.executable, "-c", example],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )  # as a newcomer
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "ckpt" / "step_1" / "manifest.msgpack").is_file()


def test_tensorstore_example_opens_a_saved_tensor(tmp_path):
    import pytest

    pytest.importorskip("tensorstore", reason="pip install -e '.[tensorstore]'")
    code = find("docs/reference/on-disk.md", "ts.open").code
    r = run_python(
        code + "\nassert (t.read().result() == sp.load('ckpt/zarr_demo')"
        "['model']['weight'].numpy()).all()\n",
        tmp_path,
    )
    assert r.stdout.startswith('dtype("float32") (3, 4) [0. 1. 2. 3.]'), r.stdout


def test_training_loops_section_runs_and_resumes(tmp_path):
    code = find("docs/tutorials/manager.md", "BestN(1").code
    run_python(code, tmp_path)
    run_python(code + "\nassert mgr.latest_step() == 8, mgr.all_steps()\n", tmp_path)  # resumed
    steps = sorted(os.listdir(tmp_path / "ckpt" / "loop"))
    assert "step_00000008" in steps and 2 <= len(steps) <= 3  # 2 newest (+ the best one)


def test_checkpointer_example_runs(tmp_path):
    r = run_python(find("docs/tutorials/single-process.md", "sp.Checkpointer()").code, tmp_path)
    assert "(4, 4) float32 (4, 4)" in r.stdout


def test_read_metadata_example_walks_the_typed_tree(tmp_path):
    r = run_python(find("docs/reference/load-semantics.md", "read_metadata(").code, tmp_path)
    lines = r.stdout.splitlines()
    assert lines[0] == "model/w (2, 3) float32 (2, 3) numpy"
    assert lines[1:] == [
        "model/w tensor",
        "model/n tensor",
        "sched/0 value",
        "sched/1/0 value",
        "sched/1/1 value",
        "rng object",
        "step value",
    ]


def test_tuning_example_runs(tmp_path):
    """The I/O tuning block: a configured backend and load options, a real round trip."""
    run_python(find("docs/how-to/tuning.md", "ZarrBackend(").code, tmp_path)
    assert (tmp_path / "ckpt" / "tuned" / "manifest.msgpack").is_file()


def test_stores_example_runs(tmp_path):
    r = run_python(find("docs/tutorials/single-process.md", "gopher://").code, tmp_path)
    assert os.listdir(tmp_path) == ["ckpt"]  # gopher:// made no local directory
    assert "gopher" in r.stdout and "registered" in r.stdout


def test_async_loop_example_runs(tmp_path):
    """Training goes on during async saves; leaving the manager's block waits for the last."""
    run_python(find("docs/tutorials/manager.md", "async_save=True)").code, tmp_path)
    assert sorted(os.listdir(tmp_path / "ckpt" / "async_run")) == ["step_00000004", "step_00000006"]


def test_errors_example_resumes_from_the_newest_sound_step(tmp_path, monkeypatch, capsys):
    """A damaged newest step raises CorruptCheckpointError; the loop falls back to the one
    before it. (In this process: it needs no process group, and that saves a torch import.)"""
    import torch

    import shardpoint as sp

    mgr = sp.CheckpointManager(str(tmp_path / "ckpt" / "loop"))
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((64,), float(step)), "step": step})
    step2 = tmp_path / "ckpt" / "loop" / "step_00000002"
    obj, off, _n, _crc = sp.read_metadata(str(step2)).tensors["w"].packed.chunk(0)
    data = bytearray((step2 / obj).read_bytes())  # the packed layout: w's chunk in a data file
    data[off + 3] ^= 0xFF
    (step2 / obj).write_bytes(bytes(data))
    block = find("docs/tutorials/manager.md", "except sp.CorruptCheckpointError").code
    monkeypatch.chdir(tmp_path)
    scope = {"__name__": "__main__"}
    exec(compile(block, "manager.md", "exec"), scope)
    assert scope["state"]["step"] == 1
    assert "step 2 is damaged (SP-READ-3)" in capsys.readouterr().out


def test_distributed_example_destroys_its_process_group():
    """Without it gloo's teardown aborted about 1 exit in 20 (issue 21)."""
    for page in ("docs/tutorials/torchrun.md", "docs/tutorials/fsdp2.md"):
        code = find(page, "init_process_group").code
        assert code.rstrip().splitlines()[-1].startswith("dist.destroy_process_group()")
