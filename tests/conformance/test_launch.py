"""The process launcher shared by the tests, the demo and the conformance suite
(``shardpoint_testing.launch``): scripts forked from its fork server behave as
``python script`` / ``python -c`` does, and the fork server's preload reaches the ranks."""

import sys

from shardpoint_testing.launch import run_code, run_script, run_world


def test_run_code_reports_output_exit_codes_and_tracebacks(tmp_path):
    r = run_code(
        "import os, sys; print(os.getcwd(), sys.argv[1:]); print('to stderr', file=sys.stderr)",
        "a",
        2,
        cwd=tmp_path,
    )
    assert (r.returncode, r.stdout, r.stderr) == (0, f"{tmp_path} ['a', '2']\n", "to stderr\n")
    assert run_code("import sys; sys.exit(3)").returncode == 3
    r = run_code("import sys; sys.exit('no such world')")
    assert (r.returncode, r.stderr) == (1, "no such world\n")
    r = run_code("raise ValueError('bad block')")
    assert r.returncode == 1 and "ValueError: bad block" in r.stderr and "Traceback" in r.stderr


def test_run_code_joins_threads_and_runs_atexit_like_an_interpreter_exit():
    r = run_code(
        "import atexit, threading, time\n"
        "atexit.register(lambda: print('atexit'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()"
    )
    assert (r.returncode, r.stdout) == (0, "thread\natexit\n")


def test_run_script_puts_the_scripts_folder_first_and_sets_argv(tmp_path):
    (tmp_path / "helper_mod.py").write_text("VALUE = 7\n")
    (tmp_path / "main.py").write_text(
        "import sys, helper_mod\nprint(__name__, sys.argv[1:], helper_mod.VALUE)\n"
    )
    r = run_script(str(tmp_path / "main.py"), "x", env={"PATH": "/usr/bin"})
    assert (r.returncode, r.stdout) == (0, "__main__ ['x'] 7\n"), r


def _preloaded(rank, world):
    return [m in sys.modules for m in ("torch.distributed.tensor", "torch._dynamo")]


def test_ranks_start_with_dtensor_preloaded():
    """DTensor, the device mesh and torch._dynamo cost seconds per rank imported late."""
    assert run_world(2, _preloaded, timeout=120) == [[True, True]] * 2
