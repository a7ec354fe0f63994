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


FROZEN = torch.arange(4096, dtype=torch.float32)  # 16 KiB, the same in every state


def _own_bytes(dst: str) -> int:
    """The bytes of the data objects a packed checkpoint holds itself (not its bases')."""
    p = sp.read_metadata(dst).packed
    return sum(s for i, (_p, s) in enumerate(p.objects) if p.base_of(i) is None)


def _frozen_states(tmp_path) -> list:
    """Three states sharing ``frozen`` and ``b`` (``w`` changes) saved with hashes: ``src/a``
    (full), ``src/b`` on ``a`` (its frozen chunks in ``a``), ``src/c`` full on its own."""
    out = []
    for name, k, base in (("a", 0, True), ("b", 1, "a"), ("c", 2, True)):
        state = {**_state(), "frozen": FROZEN}
        state["w"] = state["w"] + k
        where = tmp_path / ("src" if name != "c" else "alone") / name
        sp.save(state, str(where), incremental=base)
        out.append((str(where), state))
    assert [n for n, _i in sp.read_metadata(out[1][0]).packed.bases] == ["a"]
    assert sp.read_metadata(out[2][0]).packed.bases == []
    return out


@pytest.mark.parametrize("target", ["files", "object store"])
def test_a_copy_builds_on_a_checkpoint_beside_its_target(tmp_path, target):
    """copy_checkpoint(incremental=<base>): the chunks the base holds (same array and number,
    length, crc32c, hash) are referred to, not copied: a copy of an incremental source (its
    frozen chunks in its own base) and one of a full source (its data object compacted)
    hold only the changed bytes, name the base that owns the chunks (references never
    chained: step_3 names step_1, not step_2), load bit for bit and verify (every referred
    chunk read and checked)."""
    (a, sa), (b, sb), (c, sc) = _frozen_states(tmp_path)
    run = str(tmp_path / "ckpt") if target == "files" else "memory://copyonto/run"
    res = copy_checkpoint(a, f"{run}/step_1", incremental=f"{run}/step_0")  # none: a full one
    assert res.base is None and sp.read_metadata(f"{run}/step_1").packed.bases == []
    for src, step, state in ((b, 2, sb), (c, 3, sc)):
        dst = f"{run}/step_{step}"
        res = copy_checkpoint(src, dst, incremental=f"step_{step - 1}")
        m = sp.read_metadata(dst)
        assert res.base == f"step_{step - 1}"
        assert [n for n, _i in m.packed.bases] == ["step_1"]
        assert _own_bytes(dst) < FROZEN.numel() * 4 < _own_bytes(f"{run}/step_1")
        assert res.nbytes == _own_bytes(dst)
        got = sp.load(dst)
        assert torch.equal(got["w"], state["w"]) and torch.equal(got["frozen"], FROZEN)
        assert torch.equal(got["b"].view(torch.int16), state["b"].view(torch.int16))
        report = verify_checkpoint(dst, strict=True)
        assert report.ok and report.shared["step_1"] >= 2  # frozen and b
    if target == "files":  # a compacted object holds exactly the copied chunks
        assert sorted(os.listdir(f"{run}/step_3/packed"))[0].startswith("onto-")


def test_a_copy_whose_base_is_unusable_or_goes_meanwhile_is_a_full_one(tmp_path, monkeypatch):
    """A base that is not there, or is removed and replaced while the copy runs (before its
    commit), never fails the copy: it is a whole checkpoint naming no base, bit for bit,
    and nothing else is left beside it."""
    import shutil

    from shardpoint_core.transactions import copy as copy_mod

    (a, _sa), (b, sb), _c = _frozen_states(tmp_path)
    run = tmp_path / "ckpt"
    copy_checkpoint(a, str(run / "step_1"))
    res = copy_checkpoint(b, str(run / "step_2"), incremental="step_9")
    assert res.base is None and sp.read_metadata(str(run / "step_2")).packed.bases == []
    real, calls = copy_mod.copy_part, []

    def base_replaced_first(*args, **kw):
        if not calls:  # the base goes while the first try copies: another checkpoint there
            shutil.rmtree(run / "step_1")
            sp.save(_state(), str(run / "step_1"), incremental=True)
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(copy_mod, "copy_part", base_replaced_first)
    res = copy_checkpoint(b, str(run / "step_3"), incremental="step_1")
    assert len(calls) == 2 and res.base is None
    assert sp.read_metadata(str(run / "step_3")).packed.bases == []
    got = sp.load(str(run / "step_3"))
    assert torch.equal(got["w"], sb["w"]) and torch.equal(got["frozen"], FROZEN)
    assert sorted(os.listdir(run)) == ["step_1", "step_2", "step_3"]
