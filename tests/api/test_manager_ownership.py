"""A manager counts, keeps and removes only the steps it wrote, on every store; a save that
committed is never reported failed because of an older step (issue: nothing lost in the
managers). Each case here lost data or reported a failure before."""

import os
import uuid

import pytest

torch = pytest.importorskip("torch")

import shardpoint as sp  # noqa: E402
from shardpoint_core.format.errors import CheckpointExistsError, InvalidOptionError  # noqa: E402


def st(step):
    return {"w": torch.full((4,), float(step)), "step": step}


def test_hand_made_step_like_directories_are_never_deleted(tmp_path):
    """``step_5``, ``step_000000009`` (not the manager's format) and ``step_00000000``
    without a manifest (its format, but no commit leaves one) were deleted by the clean-up
    before a save; they are not the manager's."""
    root = tmp_path / "run"
    mine = {"step_5": "notes.txt", "step_000000009": "eval.json", "step_00000000": "x.bin"}
    for d, f in mine.items():
        os.makedirs(root / d)
        (root / d / f).write_text("user data")
    mgr = sp.CheckpointManager(str(root), max_to_keep=1)
    for s in (1, 2, 3):
        mgr.save(s, st(s))
    assert mgr.all_steps() == [3] and mgr.load()["step"] == 3
    for d, f in mine.items():
        assert (root / d / f).read_text() == "user data"


@pytest.mark.parametrize("where", ["files", "memory", "s3", "gcs"])
def test_a_checkpoint_saved_by_hand_under_the_root_is_not_a_step(tmp_path, request, where):
    """The new user's sequence: ``sp.save(x, <root>/step_7)`` then a manager with
    ``max_to_keep=2`` over the root. ``step_7`` was counted as step 7 on S3 (the newest),
    so retention removed the real step 2 and ``load()`` gave step 7's tree. Now ``step_7`` is
    not the manager's: it is neither counted nor removed, on every store alike."""
    if where == "files":
        root = str(tmp_path / "run")
    elif where == "memory":
        root = f"memory://own{uuid.uuid4().hex[:8]}/run"
    else:
        server = request.getfixturevalue(f"{where}_env")
        root = server.url(server.fresh_prefix("own") + "/run")
    sp.save({"w": torch.zeros(2)}, f"{root}/step_7")
    mgr = sp.CheckpointManager(root, max_to_keep=2)
    for s in (1, 2, 3):
        mgr.save(s, st(s))
    assert mgr.all_steps() == [2, 3], root
    assert mgr.load()["step"] == 3 and mgr.load(2)["step"] == 2
    assert torch.equal(sp.load(f"{root}/step_7")["w"], torch.zeros(2))


def test_a_manager_refuses_a_root_that_is_a_checkpoint(tmp_path):
    """A manager pointed at a checkpoint nested its steps inside it, and a later
    ``sp.save(..., overwrite=True)`` of that checkpoint deleted them without a word. Now the
    manager refuses such a root, and the overwrite refuses a checkpoint that holds
    checkpoints ([SP-COMMIT-5])."""
    ck = str(tmp_path / "ck")
    sp.save({"w": torch.ones(2)}, ck)
    with pytest.raises(InvalidOptionError, match="is a checkpoint itself"):
        sp.CheckpointManager(ck)
    # the same nesting made another way (a manager over a root a checkpoint was saved into)
    sp.CheckpointManager(str(tmp_path / "run")).save(1, st(1))
    sp.save({"w": torch.ones(2)}, str(tmp_path / "run2"))
    os.rename(tmp_path / "run" / "step_00000001", tmp_path / "run2" / "step_00000001")
    with pytest.raises(CheckpointExistsError, match="directory of checkpoints"):
        sp.save({"w": torch.ones(3)}, str(tmp_path / "run2"), overwrite=True)
    assert sp.load(str(tmp_path / "run2" / "step_00000001"))["step"] == 1


def test_retention_that_cannot_read_an_older_step_warns_and_the_save_stands(tmp_path):
    """An older step's manifest is damaged: retention by best metric cannot read its
    metrics. The save had committed but raised, so the caller believed it failed. Now it
    returns, the damaged step is kept (never deleted on a guess) and the problem is a
    warning on the manager."""
    root = tmp_path / "run"
    mgr = sp.CheckpointManager(str(root), max_to_keep=1, best_metric="loss", keep_best=1)
    mgr.save(1, st(1), metrics={"loss": 1.0})
    mgr.save(2, st(2), metrics={"loss": 2.0})
    with open(root / "step_00000001" / "manifest.msgpack", "r+b") as f:
        f.seek(40)
        f.write(b"\xff" * 16)
    again = sp.CheckpointManager(str(root), max_to_keep=1, best_metric="loss", keep_best=1)
    result = again.save(3, st(3), metrics={"loss": 3.0})
    assert result.path.endswith("step_00000003")
    assert again.load()["step"] == 3
    assert any("step 1" in w for w in again.retention_warnings), again.retention_warnings
    assert again.all_steps() == [1, 2, 3]  # 1 kept (unreadable), 2 the best, 3 the newest
