"""PosixCommitter on its own (no tensors): the protocol, the lock rule between two holders,
the -old- fallback when no atomic exchange exists, and the managers' clean-up honouring it."""

from __future__ import annotations

import os

import pytest

from shardpoint_core.commit import posix
from shardpoint_core.commit.base import Committer
from shardpoint_core.commit.cleanup import clean_leftovers
from shardpoint_core.commit.posix import PosixCommitter
from shardpoint_core.format.errors import CheckpointNotFoundError


def _staged(c, target, token, body=b"m"):
    staging = c.begin(target, token)
    with open(os.path.join(staging, "data"), "wb") as f:
        f.write(body)
    c.write_manifest(staging, body)
    return staging


def test_it_is_a_committer():
    assert isinstance(PosixCommitter(), Committer)


def test_a_second_holder_never_deletes_or_restores_a_live_save(tmp_path):
    saver, observer = PosixCommitter(fsync=False), PosixCommitter(fsync=False)
    target = str(tmp_path / "step_00000001")
    staging = _staged(saver, target, "aa11")
    (lo,) = observer.leftovers(str(tmp_path))
    assert lo.in_use is True and lo.kind == "tmp" and lo.target == target
    assert observer.discard(staging) is False and os.path.isdir(staging)
    assert clean_leftovers(observer, str(tmp_path), lambda n: True) == []
    saver.publish(staging, target, overwrite=False)
    assert observer.state(target) == "committed" and observer.leftovers(str(tmp_path)) == []
    # a crashed save (nobody holds the lock) is cleaned at once
    dead = PosixCommitter(fsync=False)
    left = _staged(dead, str(tmp_path / "step_00000002"), "bb22")
    dead._locks.release(left)  # the process died: its lock is gone
    assert clean_leftovers(observer, str(tmp_path), lambda n: True) == [left]
    assert sorted(os.listdir(tmp_path)) == ["step_00000001"]


def test_retention_removes_only_unheld_checkpoints(tmp_path):
    c, other = PosixCommitter(fsync=False), PosixCommitter(fsync=False)
    target = str(tmp_path / "ckpt")
    c.publish(_staged(c, target, "cc33"), target, overwrite=False)
    assert other._locks.take(target)  # a replacement of it holds the lock
    assert c.remove(target) is False and c.state(target) == "committed"
    other._locks.release(target)
    assert c.remove(target) is True and os.listdir(tmp_path) == []
    os.mkdir(target)
    with pytest.raises(CheckpointNotFoundError, match="not a committed checkpoint"):
        c.remove(target)  # the same class on every store (CommitterTests)


def test_replacement_without_exchange_moves_the_old_one_aside_locked(tmp_path, monkeypatch):
    c = PosixCommitter(fsync=False)
    target = str(tmp_path / "ckpt")
    c.publish(_staged(c, target, "dd44", b"old"), target, overwrite=False)
    seen = {}
    real_rename = os.rename

    def rename(a, b):
        if ".shardpoint-old-" in b:  # the old one is moved aside, still locked
            real_rename(a, b)
            seen["old_locked"] = PosixCommitter().discard(b) is False
            return
        real_rename(a, b)

    monkeypatch.setattr(posix, "exchange_dirs", lambda a, b: False)
    monkeypatch.setattr(os, "rename", rename)
    c.publish(_staged(c, target, "ee55", b"new"), target, overwrite=True)
    assert seen == {"old_locked": True}
    assert open(os.path.join(target, "data"), "rb").read() == b"new"
    assert os.listdir(tmp_path) == ["ckpt"]


def test_staging_deleted_before_its_lock_is_made_again(tmp_path, monkeypatch):
    """A clean-up that deleted the fresh, not yet locked staging directory: the save makes
    it again and holds the lock on the one at that path."""
    c = PosixCommitter(fsync=False)
    real_take, calls = c._locks.take, []

    def take(path):
        if not calls:  # a cleaner wins the first race
            calls.append(path)
            os.rmdir(path)
        return real_take(path)

    monkeypatch.setattr(c._locks, "take", take)
    staging = c.begin(str(tmp_path / "x"), "ff66")
    assert os.path.isdir(staging) and c._locks.holds(staging)
    assert PosixCommitter().discard(staging) is False
    c.abort(staging)
    assert os.listdir(tmp_path) == []
