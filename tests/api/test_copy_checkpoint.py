"""The store-to-store copy of a committed checkpoint (the memory tier's durable copies): the
copy is bitwise the source, on files and on an object store, in either layout (packed, the
default, and per-array); a copy that fails midway leaves nothing at the target (no partial
checkpoint, no staging), and a target in the way is never replaced. An incremental packed
source is copied flattened: the copy holds every chunk itself and names no base."""

from __future__ import annotations

import os

import pytest
import torch

import shardpoint as sp
from shardpoint_core.transactions.copy import copy_checkpoint
from shardpoint_core.verify import verify_checkpoint


def _state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(64, 8, generator=g), "b": torch.arange(5).to(torch.bfloat16), "n": 3}


LAYOUTS = ["packed", "zarr"]


def _backend(layout: str):
    """The layout under test: the default (packed) or the per-array one, asked for."""
    return None if layout == "packed" else sp.ZarrBackend()


def _data_files(root) -> list:
    """The files of the checkpoint at ``root`` holding chunk bytes: the packed layout's data
    objects (``packed/*.bin``), or the per-array layout's chunk files."""
    return sorted(
        os.path.join(d, f)
        for d, _s, fs in os.walk(root)
        for f in fs
        if (f.endswith(".bin") and os.path.basename(d) == "packed")
        or (os.sep + "c" in d and f != "zarr.json")
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_copy_is_the_source_bitwise_on_files_and_an_object_store(tmp_path, layout):
    src = str(tmp_path / "a")
    sp.save(_state(), src, backend=_backend(layout))
    for dst in (str(tmp_path / "b"), f"memory://copytest-{layout}/run/step_1"):
        res = copy_checkpoint(src, dst)
        # the packed layout: the one data object of the one writer; per-array: a chunk
        # and a zarr.json per array at least
        if layout == "packed":
            assert res.objects == 1 and res.nbytes > 0
        else:
            assert res.objects >= 4 and res.nbytes > 0
        got, want = sp.load(dst), sp.load(src)
        assert torch.equal(got["w"], want["w"]) and got["n"] == 3
        assert torch.equal(got["b"].view(torch.int16), want["b"].view(torch.int16))
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_source_missing_a_piece_is_refused_before_anything_is_written(tmp_path, layout):
    src = str(tmp_path / "a")
    sp.save(_state(), src, backend=_backend(layout))
    os.remove(_data_files(src)[0])  # the source loses a piece: its copy cannot complete
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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_copy_failing_midway_leaves_nothing_at_the_target(tmp_path, layout):
    """A memory-tier source whose object is damaged (its crc32c fails, the store refuses its
    bytes) fails the copy after the target's staging was made: nothing stays."""
    from shardpoint_core.stores.shm import ShmStore

    ShmStore.named("copytest").configure(shm_dir=str(tmp_path / "shm"))
    sp.save(_state(), "shm://copytest/step_1", backend=_backend(layout))
    chunk = _data_files(tmp_path / "shm" / "copytest" / "step_1")[-1]
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
    prefix of an object store (``save-<token>/``, [SP-COMMIT-11]) written ``save-*`` and a
    packed data object's writer (random) ``*`` (``packed/*-0.bin``)."""
    import re

    from shardpoint_core.stores.location import locate

    store, root = locate(url).pair()
    out = []
    for info in store.list(f"{root}/" if root else ""):
        rel = info.key[len(root) + 1 if root else 0 :].split("/")
        key = "/".join("save-*" if p.startswith("save-") else p for p in rel)
        out.append(re.sub(r"packed/[0-9a-f]+-(\d+)\.bin$", r"packed/*-\1.bin", key))
    return sorted(out)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("source", ["memory", "shm"])
def test_a_copy_is_laid_out_as_a_save_made_there(tmp_path, source, layout):
    """A copy of an object-store checkpoint (its objects below its own ``save-<token>/``)
    holds its objects below the copy's save prefix alone, not below both
    (``save-NEW/save-OLD/tensors/...``): it lists as a checkpoint saved there directly,
    and it loads bit for bit."""
    from shardpoint_core.stores.shm import ShmStore

    if source == "shm":
        ShmStore.named("copylay").configure(shm_dir=str(tmp_path / "shm"))
        src = "shm://copylay/step_1"
    else:
        src = f"memory://copylay-src-{layout}/run/step_1"
    state = _state()
    sp.save(state, src, backend=_backend(layout))
    data = "save-*/packed/" if layout == "packed" else "save-*/tensors/"
    assert any(k.startswith(data) for k in _keys(src))  # a save prefix
    for dst in (
        f"memory://copylay-{source}-{layout}/run/step_1",
        str(tmp_path / f"to-{source}" / "step_1"),
    ):
        copy_checkpoint(src, dst)
        direct = dst.replace("step_1", "step_2")
        sp.save(state, direct, backend=_backend(layout))
        assert _keys(dst) == _keys(direct), dst
        assert not any(k.count("save-*") > 1 for k in _keys(dst))
        got = sp.load(dst)
        assert torch.equal(got["w"], state["w"]) and got["n"] == 3
        assert torch.equal(got["b"].view(torch.int16), state["b"].view(torch.int16))


def _incremental(tmp_path):
    """A packed base ``run/a`` and ``run/b`` saved on it (its ``w`` changed, ``b`` shared):
    ``b``'s index names ``a`` as a base ([SP-PACK-9])."""
    run = tmp_path / "run"
    state = _state()
    sp.save(state, str(run / "a"), incremental=True)  # nothing beside it: full, with hashes
    state["w"] = state["w"] + 1
    sp.save(state, str(run / "b"), incremental="a")
    assert sp.read_metadata(str(run / "b")).packed.bases  # it does share with a
    return run, state


def test_an_incremental_source_is_copied_flattened(tmp_path):
    """The copy of an incremental checkpoint holds the chunks its base held (read there,
    each checked against its hash) and names no base: it loads bit for bit once the base
    is gone, on files and on an object store."""
    import shutil

    run, state = _incremental(tmp_path)
    for dst in (str(tmp_path / "elsewhere" / "b"), "memory://copyinc/run/b"):
        res = copy_checkpoint(str(run / "b"), dst)
        m = sp.read_metadata(dst)
        assert m.packed.bases == [] and m.packed.object_bases is None
        assert res.objects == 2  # b's own data object, one flat object of a's chunks
        assert m.packed.hashes is not None  # it can be a base in turn
    shutil.rmtree(run / "a")
    for dst in (str(tmp_path / "elsewhere" / "b"), "memory://copyinc/run/b"):
        got = sp.load(dst)
        assert torch.equal(got["w"], state["w"]) and got["n"] == 3
        assert torch.equal(got["b"].view(torch.int16), state["b"].view(torch.int16))
        assert verify_checkpoint(dst, strict=True).ok


def test_an_incremental_copy_whose_base_is_gone_or_damaged_is_refused(tmp_path):
    """A base replaced (another identity) is refused before anything is written; a base
    whose bytes are not the chunk its record names fails the copy: nothing at the target."""
    import shutil

    run, _state_ = _incremental(tmp_path)
    p = sp.read_metadata(str(run / "b")).packed
    r = next(r for r in p.records if p.base_of(int(r["object"])) is not None)
    data = run / "a" / p.objects[int(r["object"])][0]  # a chunk of a's that b names
    with open(data, "r+b") as f:
        f.seek(int(r["offset"]))
        b = f.read(1)
        f.seek(int(r["offset"]))
        f.write(bytes([b[0] ^ 0xFF]))
    dst = tmp_path / "out"
    os.makedirs(dst)
    with pytest.raises(sp.errors.CorruptCheckpointError, match="SP-PACK-10"):
        copy_checkpoint(str(run / "b"), str(dst / "b"))
    assert os.listdir(dst) == []
    shutil.rmtree(run / "a")
    sp.save(_state(), str(run / "a"))  # another checkpoint named a
    with pytest.raises(sp.errors.CorruptCheckpointError, match="SP-PACK-9.*identity differs"):
        copy_checkpoint(str(run / "b"), str(dst / "b"))
    assert os.listdir(dst) == []


def test_a_large_data_object_is_copied_in_pieces(tmp_path, monkeypatch):
    """A data object larger than a piece (a writer's whole state on files) is copied
    piecewise onto files, bit for bit (the piece made small here to reach that path)."""
    from shardpoint_core.transactions import copy as copy_mod

    monkeypatch.setattr(copy_mod, "PIECE", 1000)
    src, dst = str(tmp_path / "a"), str(tmp_path / "b")
    state = _state()
    sp.save(state, src)
    (obj,) = _data_files(src)
    assert os.path.getsize(obj) > 2000
    copy_checkpoint(src, dst)
    (again,) = _data_files(dst)
    assert open(again, "rb").read() == open(obj, "rb").read()
    assert torch.equal(sp.load(dst)["w"], state["w"])
