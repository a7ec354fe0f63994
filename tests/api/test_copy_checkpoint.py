"""The store-to-store copy of a committed checkpoint (the memory tier's durable copies): the
copy is bitwise the source, on files and on an object store; a copy that fails midway leaves
nothing at the target (no partial checkpoint, no staging), and a target in the way is never
replaced."""

from __future__ import annotations

import os

import pytest
import torch

import shardpoint as sp
from shardpoint_core.transactions.copy import copy_checkpoint


def _state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(64, 8, generator=g), "b": torch.arange(5).to(torch.bfloat16), "n": 3}


def test_copy_is_the_source_bitwise_on_files_and_an_object_store(tmp_path):
    src = str(tmp_path / "a")
    sp.save(_state(), src)
    for dst in (str(tmp_path / "b"), "memory://copytest/run/step_1"):
        res = copy_checkpoint(src, dst)
        assert res.objects >= 2 and res.nbytes > 0
        got, want = sp.load(dst), sp.load(src)
        assert torch.equal(got["w"], want["w"]) and got["n"] == 3
        assert torch.equal(got["b"].view(torch.int16), want["b"].view(torch.int16))
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]


def test_a_source_missing_a_piece_is_refused_before_anything_is_written(tmp_path):
    src = str(tmp_path / "a")
    sp.save(_state(), src)
    chunk = next(
        os.path.join(d, f)
        for d, _s, fs in os.walk(os.path.join(src, "tensors", "w"))
        for f in fs
        if f != "zarr.json"
    )
    os.remove(chunk)  # the source loses a piece: its copy cannot complete
    os.makedirs(tmp_path / "c")  # (an empty directory is the target's to fill)
    with pytest.raises(sp.errors.CorruptCheckpointError, match="is missing"):
        copy_checkpoint(src, str(tmp_path / "c"))
    assert os.listdir(tmp_path / "c") == []  # no partial checkpoint
    assert sorted(os.listdir(tmp_path)) == ["a", "c"]  # no staging left behind


def test_a_target_in_the_way_is_refused_and_kept(tmp_path):
    src, dst = str(tmp_path / "a"), str(tmp_path / "d")
    sp.save(_state(), src)
    os.makedirs(dst)
    with open(os.path.join(dst, "notes.txt"), "w") as f:
        f.write("mine")
    with pytest.raises(sp.errors.CheckpointExistsError):
        copy_checkpoint(src, dst, overwrite=True)
    assert os.listdir(dst) == ["notes.txt"]


def test_a_copy_failing_midway_leaves_nothing_at_the_target(tmp_path):
    """A memory-tier source whose chunk is damaged (its crc32c fails, the store refuses its
    bytes) fails the copy after the target's staging was made: nothing stays."""
    from shardpoint_core.stores.shm import ShmStore

    ShmStore.named("copytest").configure(shm_dir=str(tmp_path / "shm"))
    sp.save(_state(), "shm://copytest/step_1")
    chunk = next(
        os.path.join(d, f)
        for d, _s, fs in os.walk(tmp_path / "shm" / "copytest" / "step_1")
        for f in fs
        if d.endswith(os.path.join("tensors", "w", "c", "0"))
    )
    with open(chunk, "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))
    dst = tmp_path / "ckpt"
    os.makedirs(dst)
    with pytest.raises(sp.errors.CorruptCheckpointError, match="could not be read intact"):
        copy_checkpoint("shm://copytest/step_1", str(dst / "step_1"))
    assert os.listdir(dst) == []  # neither the step nor its staging


def _keys(url: str) -> list:
    """Every object key below the checkpoint at ``url`` (relative to it), with the save
    prefix of an object store (``save-<token>/``, [SP-COMMIT-11]) written ``save-*``."""
    from shardpoint_core.stores.location import locate

    store, root = locate(url).pair()
    out = []
    for info in store.list(f"{root}/" if root else ""):
        rel = info.key[len(root) + 1 if root else 0 :].split("/")
        out.append("/".join("save-*" if p.startswith("save-") else p for p in rel))
    return sorted(out)


@pytest.mark.parametrize("source", ["memory", "shm"])
def test_a_copy_is_laid_out_as_a_save_made_there(tmp_path, source):
    """A copy of an object-store checkpoint (its objects below its own ``save-<token>/``)
    holds its objects below the copy's save prefix alone, not below both
    (``save-NEW/save-OLD/tensors/...``): it lists as a checkpoint saved there directly,
    and it loads bit for bit."""
    from shardpoint_core.stores.shm import ShmStore

    if source == "shm":
        ShmStore.named("copylay").configure(shm_dir=str(tmp_path / "shm"))
        src = "shm://copylay/step_1"
    else:
        src = "memory://copylay-src/run/step_1"
    state = _state()
    sp.save(state, src)
    assert any(k.startswith("save-*/tensors/") for k in _keys(src))  # a save prefix
    for dst in (f"memory://copylay-{source}/run/step_1", str(tmp_path / f"to-{source}" / "step_1")):
        copy_checkpoint(src, dst)
        direct = dst.replace("step_1", "step_2")
        sp.save(state, direct)
        assert _keys(dst) == _keys(direct), dst
        assert not any(k.count("save-*") > 1 for k in _keys(dst))
        got = sp.load(dst)
        assert torch.equal(got["w"], state["w"]) and got["n"] == 3
        assert torch.equal(got["b"].view(torch.int16), state["b"].view(torch.int16))
