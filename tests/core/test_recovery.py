"""[SP-COMMIT-6] recovery of crashed saves' leftovers, on the directory states a crash leaves."""

import json
import os
import shutil
import time

import torch

import shardpoint as sp
from shardpoint.tools.cli import main as cli_main


def _age(root, seconds=3600):
    """Make ``root`` look untouched for ``seconds`` (a crash long ago)."""
    t = time.time() - seconds
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            os.utime(os.path.join(d, n), (t, t), follow_symlinks=False)
    os.utime(root, (t, t))


def _ckpt(path, who):
    sp.save({"w": torch.full((8,), float(who)), "who": who}, str(path))
    return str(path)


def test_crash_between_the_two_renames_restores_the_previous_checkpoint(tmp_path):
    """Non-atomic replacement died after moving the old one aside: '-old-' goes back to <name>,
    the never-committed '-tmp-' (complete, with manifest) is removed. Dry run changes nothing."""
    old = tmp_path / ".ckpt.shardpoint-old-ab12"
    new = tmp_path / ".ckpt.shardpoint-tmp-ab12"
    os.rename(_ckpt(tmp_path / "a", 1), old)
    os.rename(_ckpt(tmp_path / "b", 2), new)
    _age(old), _age(new)
    target = str(tmp_path / "ckpt")
    acts = sp.recover(target, dry_run=True)
    assert {(os.path.basename(a.path), a.action, a.done) for a in acts} == {
        (old.name, "restore", False),
        (new.name, "remove", False),
    }
    assert sorted(os.listdir(tmp_path)) == sorted([old.name, new.name])
    acts = sp.recover(target)
    assert all(a.done for a in acts)
    assert os.listdir(tmp_path) == ["ckpt"]
    back = sp.load(target)
    assert back["who"] == 1 and torch.equal(back["w"], torch.full((8,), 1.0))


def test_parent_scan_keeps_committed_checkpoints_and_recent_saves(tmp_path):
    """Scanning the parent: a superseded '-old-' and a crashed partial '-tmp-' go; a '-tmp-'
    written moments ago (maybe a running save) and every committed checkpoint stay."""
    ckpt = _ckpt(tmp_path / "step_1", 1)
    os.rename(_ckpt(tmp_path / "x", 0), tmp_path / ".step_1.shardpoint-old-01")
    crashed = tmp_path / ".step_2.shardpoint-tmp-02"
    shutil.copytree(ckpt, crashed)
    os.remove(crashed / "manifest.msgpack")  # died before the manifest
    running = tmp_path / ".step_3.shardpoint-tmp-03"
    os.makedirs(running / "tensors")
    _age(tmp_path / ".step_1.shardpoint-old-01"), _age(crashed)
    acts = {os.path.basename(a.path): a for a in sp.recover(str(tmp_path), min_age_s=600)}
    assert acts[".step_1.shardpoint-old-01"].action == "remove"
    assert acts[crashed.name].action == "remove"
    assert acts[running.name].action == "skip" and "may still" in acts[running.name].reason
    assert sorted(os.listdir(tmp_path)) == sorted(["step_1", running.name])
    assert sp.load(ckpt)["who"] == 1


def test_old_leftover_beside_a_directory_without_manifest_is_left_alone(tmp_path, capsys):
    """<name> exists but holds no manifest: [SP-COMMIT-6] does not say; nothing is touched.
    Also the CLI's --json output and exit code."""
    old = tmp_path / ".c.shardpoint-old-0f"
    os.rename(_ckpt(tmp_path / "a", 1), old)
    os.makedirs(tmp_path / "c" / "junk")
    _age(old)
    assert cli_main(["recover", str(tmp_path / "c"), "--json"]) == 0
    acts = json.loads(capsys.readouterr().out)
    assert [(a["kind"], a["action"], a["done"]) for a in acts] == [("old", "skip", False)]
    assert sorted(os.listdir(tmp_path)) == sorted(["c", old.name])
    assert sp.load(str(old))["who"] == 1


_RUNNING_SAVE = """
import sys, time, threading
import torch, shardpoint as sp
from shardpoint_core.transactions.resolve import get_backend

be = get_backend()
class Stalled:
    # The real backend; writes wait until the test kills this process (a save in progress).
    def __getattr__(self, name):
        return getattr(be, name)
    def write(self, handle, offset, data):
        print("writing", flush=True)
        time.sleep(600)
sp.save({"w": torch.ones(4)}, sys.argv[1], backend=Stalled())
"""


def test_a_running_save_is_never_recovered_however_old_its_files(tmp_path):
    """[SP-COMMIT-6]: a real save, stalled in its writes in another process, holds the lock on
    its staging directory: recovery skips it even with min_age_s=0 and files aged an hour.
    Once that process is killed (SIGKILL), the lock is gone and the leftover is removed."""
    import subprocess
    import sys

    target = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-c", _RUNNING_SAVE, str(target)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "writing"
        (staging,) = [p for p in tmp_path.iterdir() if ".shardpoint-tmp-" in p.name]
        _age(staging)
        (act,) = sp.recover(str(target), min_age_s=0)
        assert act.action == "skip" and "holds its lock" in act.reason and not act.done
        assert staging.is_dir()
    finally:
        proc.kill()
        proc.wait(timeout=60)
    (act,) = sp.recover(str(target), min_age_s=0)
    assert act.action == "remove" and act.done
    assert not staging.exists() and not target.exists()


def test_a_finished_or_failed_save_leaves_no_lock_behind(tmp_path):
    """The lock is dropped at commit and at abort: a later save to the same path in this
    process, and recovery's probe, find nothing held."""
    from shardpoint_core.stores.durable import dir_locked
    from shardpoint_core.transactions.resolve import get_backend

    path = _ckpt(tmp_path / "ckpt", 1)
    assert dir_locked(path) is False
    be = get_backend()
    staging = be.staging_path(str(tmp_path / "other"), "ab12")
    be.begin_save(staging)
    assert dir_locked(staging) is True  # another open file: the probe conflicts
    be.abort(staging)
    assert not os.path.exists(staging) and not be.committer._locks
    _ckpt(tmp_path / "ckpt2", 2)
    assert not be.committer._locks


def test_a_process_forked_during_a_save_does_not_keep_its_lock(tmp_path):
    """A child forked while a save holds its staging lock (a DataLoader worker started beside
    an async save) drops its copy of the descriptor: once the save ends, the directory is
    free although the child still lives."""
    from shardpoint_core.stores.durable import dir_locked
    from shardpoint_core.transactions.resolve import get_backend

    be = get_backend()
    staging = be.staging_path(str(tmp_path / "ckpt"), "fork1")
    be.begin_save(staging)
    r, w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: say it runs, wait, report its lock count
        try:
            os.close(w)
            os.write(ready_w, b"1")
            os.read(r, 1)
        finally:
            os._exit(len(be.committer._locks))
    try:
        os.close(r)
        os.close(ready_w)
        assert os.read(ready_r, 1) == b"1"  # the child is past its fork hooks
        os.close(ready_r)
        assert dir_locked(staging) is True  # the parent's save still holds it
        be.committer._locks.release(staging)  # the save ends (commit or abort)
        assert dir_locked(staging) is False  # the living child holds nothing
    finally:
        os.close(w)  # lets the child exit
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # nothing left in the child's table
    be.abort(staging)


def test_a_negative_or_nan_min_age_is_refused_not_taken_as_zero(tmp_path, capsys):
    """`--min-age -5` was accepted and acted as 0: it would remove a save running elsewhere."""
    import pytest

    p = _ckpt(tmp_path / "ck", 1)
    for bad in ("-5", "nan", "inf"):
        assert cli_main(["recover", p, "--min-age", bad]) == 2
        assert "an age is a finite number >= 0" in capsys.readouterr().err
        with pytest.raises(sp.InvalidOptionError, match="min_age_s"):
            sp.recover(p, min_age_s=float(bad))
    assert cli_main(["recover", p, "--min-age", "0"]) == 0
