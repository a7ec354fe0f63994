"""The README's first screen gives the two commands, and its python examples run."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()


def test_first_screen_has_install_demo_and_test_commands():
    first = "\n".join(README.splitlines()[:30])
    assert "pip install torch==2.13.0" in first and "shardpoint demo" in first
    assert "python -m pytest -q" in first
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert "python -m pytest -q" in ci  # CI runs exactly the README's test command


def test_usage_example_runs(tmp_path):
    example = re.findall(r"```python\n(.*?)```", README, re.S)[0]
    r = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "ckpt" / "step_1" / "manifest.msgpack").is_file()


def test_tensorstore_example_opens_a_saved_tensor(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    usage = blocks[0]
    ts_block = next(b for b in blocks if "ts.open" in b)
    code = usage + "\n" + ts_block + "\nassert (t.read().result() == model.weight.detach().numpy()).all()\n"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
