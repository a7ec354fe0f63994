"""The README's first screen gives the two commands, and its python examples run as written."""
import os
import re
import subprocess
import sys

from shardpoint_testing.launch import run_code, run_world

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = open(os.path.join(ROOT, "README.md")).read()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)
INSTALL = ("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
           "pip install -e '.[test]' && shardpoint demo")
TEST_CMD = "python -m pytest -q"


def run_python(code, cwd):
    """The block as ``python -c`` runs it, in a process forked from the launcher's fork server
    (torch already imported: a fresh interpreter's import is most of a small block's cost).
    The first example runs in a real fresh interpreter (``test_usage_example_runs``)."""
    r = run_code(code, cwd=cwd, timeout=300)
    assert r.returncode == 0, r.stderr
    return r


def test_first_screen_has_install_demo_and_test_commands():
    first = "\n".join(README.splitlines()[:30])
    assert INSTALL in first and TEST_CMD in first
    assert first.index(INSTALL) < first.index(TEST_CMD)
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert re.search(rf"^{re.escape(TEST_CMD)}\s*$", ci, re.M)   # CI runs exactly this
    assert os.access(os.path.join(ROOT, ".ci", "run"), os.X_OK)


def test_readme_sections():
    heads = re.findall(r"^## (.+)$", README, re.M)
    for h in ("Concepts", "Distributed use", "Load semantics", "Errors", "Command line",
              "Coming from DCP / Megatron / Hugging Face", "On disk", "Conformance suite",
              "Repository"):
        assert h in heads, h


def test_usage_example_runs(tmp_path):
    example = BLOCKS[0]
    assert len(example.strip().splitlines()) <= 12
    r = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, stdin=subprocess.DEVNULL)   # as a newcomer
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "ckpt" / "step_1" / "manifest.msgpack").is_file()


def test_tensorstore_example_opens_a_saved_tensor(tmp_path):
    ts_block = next(b for b in BLOCKS if "ts.open" in b)
    code = (BLOCKS[0] + "\n" + ts_block + "\nassert (t.read().result() == "
            "model.weight.detach().numpy()).all()\n")
    run_python(code, tmp_path)


def test_zarr_python_example_reads_a_saved_tensor(tmp_path):
    block = next(b for b in BLOCKS if "register_zarr_dtypes()" in b)
    run_python(BLOCKS[0] + "\n" + block + "\nassert (w == model.weight.detach().numpy()).all()\n",
               tmp_path)


def _run_block(rank, world, code, cwd):
    os.chdir(cwd)
    exec(compile(code, "README.md", "exec"), {"__name__": "__main__"})
    return rank


def test_distributed_example_runs_on_two_ranks(tmp_path):
    code = next(b for b in BLOCKS if "init_process_group" in b)
    assert run_world(2, _run_block, code, str(tmp_path), timeout=240) == [0, 1]
    assert (tmp_path / "ckpt" / "step_100" / "manifest.msgpack").is_file()


def test_training_loops_section_runs_and_resumes(tmp_path):
    assert "Training loops" in re.findall(r"^## (.+)$", README, re.M)
    code = next(b for b in BLOCKS if "CheckpointManager" in b)
    run_python(code, tmp_path)
    run_python(code + "\nassert mgr.latest_step() == 8, mgr.all_steps()\n", tmp_path)  # resumed
    steps = sorted(os.listdir(tmp_path / "ckpt"))
    assert "step_00000008" in steps and 2 <= len(steps) <= 3   # 2 newest (+ the best one)


def test_lazy_open_and_convert_example_runs(tmp_path):
    block = next(b for b in BLOCKS if "sp.open(" in b)
    run_python(BLOCKS[0] + "\n" + block, tmp_path)
    assert (tmp_path / "export" / "model.safetensors").is_file()
    assert (tmp_path / "ckpt" / "from_hf" / "manifest.msgpack").is_file()


def test_checkpointer_example_runs(tmp_path):
    r = run_python(next(b for b in BLOCKS if "sp.Checkpointer()" in b), tmp_path)
    assert "(4, 4) float32 (4, 4)" in r.stdout


def test_read_metadata_example_walks_the_typed_tree(tmp_path):
    r = run_python(next(b for b in BLOCKS if 'read_metadata("ckpt/meta").tree' in b), tmp_path)
    lines = r.stdout.splitlines()
    assert lines[0] == "model/w (2, 3) float32 (2, 3) numpy"
    assert lines[1:] == ["model/w tensor", "model/n tensor", "sched/0 value", "sched/1/0 value",
                         "sched/1/1 value", "rng object", "step value"]


def test_tuning_example_runs(tmp_path):
    """The I/O tuning block: a configured backend and load options, a real round trip."""
    run_python(next(b for b in BLOCKS if "TensorStoreBackend(" in b), tmp_path)


def test_stores_example_runs(tmp_path):
    run_python(next(b for b in BLOCKS if "gopher://" in b), tmp_path)
    assert os.listdir(tmp_path) == ["ckpt"]          # gopher:// made no local directory


def test_async_loop_example_runs(tmp_path):
    """Training goes on during async saves; leaving the manager's block waits for the last."""
    block = next(b for b in BLOCKS if "async_save=True)" in b and "CheckpointManager" in b)
    run_python(block, tmp_path)
    assert sorted(os.listdir(tmp_path / "ckpt" / "run")) == ["step_00000004", "step_00000006"]


def test_errors_example_resumes_from_the_newest_sound_step(tmp_path, monkeypatch, capsys):
    """A damaged newest step raises CorruptCheckpointError; the loop falls back to the one
    before it. (In this process: it needs no process group, and that saves a torch import.)"""
    import torch

    import shardpoint as sp
    mgr = sp.CheckpointManager(str(tmp_path / "ckpt"))
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((64,), float(step)), "step": step})
    chunk = tmp_path / "ckpt" / "step_00000002" / "tensors" / "w" / "c" / "0"
    data = bytearray(chunk.read_bytes())
    data[3] ^= 0xFF
    chunk.write_bytes(bytes(data))
    block = next(b for b in BLOCKS if "except sp.CorruptCheckpointError" in b)
    monkeypatch.chdir(tmp_path)
    scope = {"__name__": "__main__"}
    exec(compile(block, "README.md", "exec"), scope)
    assert scope["state"]["step"] == 1
    assert "step 2 is damaged (SP-READ-3)" in capsys.readouterr().out


def test_distributed_example_destroys_its_process_group():
    """Without it gloo's teardown aborted about 1 exit in 20 (issue 21)."""
    code = next(b for b in BLOCKS if "init_process_group" in b)
    assert code.rstrip().splitlines()[-1].startswith("dist.destroy_process_group()")
