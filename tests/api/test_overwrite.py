"""``overwrite`` replaces what it should and nothing else ([SP-COMMIT-5], issue 21 "Data
destroyed"): True replaces a committed checkpoint or an empty directory; 'any' also a
directory that is not a checkpoint; nothing ever replaces a file, a directory of checkpoints
(a CheckpointManager's root) or a path holding a conversion's source. Both front ends and
convert; the refusal of a non-checkpoint never tells the user to pass overwrite=True."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import shardpoint as sp
from shardpoint_core.format.errors import CheckpointExistsError, InvalidOptionError


def _user_dir(tmp_path):
    d = tmp_path / "userdir"
    d.mkdir()
    (d / "notes.txt").write_text("precious")
    return d


def _manager_root(tmp_path, steps=(1, 2)):
    root = tmp_path / "run"
    with sp.CheckpointManager(str(root)) as mgr:
        for s in steps:
            mgr.save(s, {"w": torch.full((2,), float(s))})
    return root


def test_true_refuses_a_users_directory_and_says_how_to_consent(tmp_path):
    d = _user_dir(tmp_path)
    for ow in (False, True):
        with pytest.raises(CheckpointExistsError) as e:
            sp.save({"w": torch.ones(2)}, str(d), overwrite=ow)
        assert "overwrite=True" not in str(e.value) and "overwrite='any'" in str(e.value)
    assert os.listdir(d) == ["notes.txt"]
    sp.save({"w": torch.ones(2)}, str(d), overwrite="any")
    assert torch.equal(sp.load(str(d))["w"], torch.ones(2))
    assert not (d / "notes.txt").exists()


def test_nothing_replaces_a_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"not ours")
    for ow in (False, True, "any"):
        with pytest.raises(CheckpointExistsError, match="file") as e:
            sp.save({"w": torch.ones(2)}, str(f), overwrite=ow)
        assert "overwrite=True" not in str(e.value)
    assert f.read_bytes() == b"not ours"


def test_nothing_replaces_a_managers_root(tmp_path):
    root = _manager_root(tmp_path)
    for ow in (True, "any"):
        with pytest.raises(CheckpointExistsError, match="directory of checkpoints"):
            sp.save({"w": torch.ones(2)}, str(root), overwrite=ow)
    assert sp.CheckpointManager(str(root)).all_steps() == [1, 2]


def test_true_replaces_a_checkpoint_and_an_empty_directory(tmp_ckpt, tmp_path):
    sp.save({"w": torch.zeros(2)}, tmp_ckpt)
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        sp.save({"w": torch.ones(2)}, tmp_ckpt)
    sp.save({"w": torch.ones(2)}, tmp_ckpt, overwrite=True)
    assert torch.equal(sp.load(tmp_ckpt)["w"], torch.ones(2))
    (tmp_path / "empty").mkdir()
    sp.save({"w": torch.ones(2)}, str(tmp_path / "empty"))
    with pytest.raises(InvalidOptionError, match="'any'"):
        sp.save({"w": torch.ones(2)}, tmp_ckpt, overwrite="yes")


def test_jax_save_follows_the_same_rules(tmp_path):
    spj = pytest.importorskip("shardpoint_jax")
    d, root = _user_dir(tmp_path), _manager_root(tmp_path)
    f = tmp_path / "f"
    f.write_text("x")
    for target, values in ((d, (False, True)), (root, (True, "any")), (f, (True, "any"))):
        for ow in values:
            with pytest.raises(spj.CheckpointExistsError) as e:
                spj.save(str(target), {"a": np.ones(2)}, overwrite=ow)
            assert "overwrite=True" not in str(e.value)
    assert os.listdir(d) == ["notes.txt"] and f.read_text() == "x"
    assert sp.CheckpointManager(str(root)).all_steps() == [1, 2]
    spj.save(str(d), {"a": np.ones(2)}, overwrite="any")
    assert np.array_equal(spj.load(str(d))["a"], np.ones(2))
    with pytest.raises(spj.InvalidRequestError):
        spj.save(str(d), {"a": np.ones(2)}, overwrite="yes")


def test_convert_never_deletes_its_source(tmp_path):
    """``shardpoint convert src/model.safetensors src --overwrite`` deleted the source and
    its neighbours: the destination held the source."""
    from safetensors.torch import save_file
    from shardpoint.tools.convert import convert

    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": torch.ones(3)}, str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    for dst in (src, tmp_path):
        for ow in (True, "any"):
            with pytest.raises(CheckpointExistsError, match="input of this command"):
                convert(str(src / "model.safetensors"), str(dst), overwrite=ow)
    assert sorted(os.listdir(src)) == ["config.json", "model.safetensors"]
    # a finished output of the target format is replaced with consent; a user's file is not
    out = tmp_path / "out.safetensors"
    convert(str(src / "model.safetensors"), str(out), to="safetensors")
    convert(str(src / "model.safetensors"), str(out), to="safetensors", overwrite=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "mine.txt").write_text("keep")
    with pytest.raises(CheckpointExistsError):
        convert(str(src / "model.safetensors"), str(other), overwrite=True)
    assert (other / "mine.txt").read_text() == "keep"


def test_convert_cli_overwrite_and_overwrite_any(tmp_path, capsys):
    """``--overwrite`` replaces a checkpoint only; ``--overwrite-any`` a user's directory
    too; a destination holding the source is refused either way (exit status != 0)."""
    from safetensors.torch import save_file
    from shardpoint.tools.cli import main as cli

    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": torch.ones(3)}, str(src / "model.safetensors"))
    d = _user_dir(tmp_path)
    st = str(src / "model.safetensors")
    assert cli(["convert", st, str(d), "--overwrite"]) != 0
    err = capsys.readouterr().err
    assert "--overwrite-any" in err and "overwrite=True" not in err
    assert os.listdir(d) == ["notes.txt"]
    assert cli(["convert", st, str(src), "--overwrite-any"]) != 0
    assert os.listdir(src) == ["model.safetensors"]
    assert cli(["convert", st, str(d), "--overwrite-any"]) == 0
    assert torch.equal(sp.load(str(d))["w"], torch.ones(3))
    capsys.readouterr()
