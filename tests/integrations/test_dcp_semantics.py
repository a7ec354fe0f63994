"""DCP's own semantics through the shardpoint storage classes (issue 33, issue 28's plug-in
errors): what DCP's storage round-trips round-trips through ours (without a pickle), refusals
are shardpoint's documented classes, ``overwrite`` behaves as DCP's, options are honoured or
refused, and ``from shardpoint import dcp`` is a one-line switch. One process (``no_dist``);
the real DCP functions throughout."""

import argparse
import os
import warnings

import numpy as np
import pytest
import torch

warnings.filterwarnings("ignore", message=".*torch.distributed is .*")
warnings.filterwarnings("ignore", message=".*Detected an existing checkpoint.*")


def _no_pickles(path):
    found = [
        f
        for _r, _d, fs in os.walk(path)
        for f in fs
        if f.endswith((".metadata", ".distcp", ".pt", ".pkl"))
    ]
    assert found == [], found


def _values():
    rng = np.random.RandomState(7)
    return {
        "rng": {"numpy": rng.get_state(), "torch": torch.get_rng_state()},
        "arr": np.arange(12, dtype=np.int16).reshape(3, 4),
        "f32": np.linspace(0, 1, 5, dtype=np.float32),
        "t": (torch.arange(4.0), "y"),
        "mixed": [(torch.ones(2, dtype=torch.bfloat16), {"k": np.uint8(3)}), 5],
    }


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return type(b) is torch.Tensor and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (np.ndarray, np.generic)):
        return type(b) is type(a) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def test_values_dcp_storage_round_trips_round_trip_through_ours(tmp_path):
    """``np.random.get_state()``, numpy arrays and tuples holding tensors: DCP's
    FileSystemWriter pickles them whole; ours stores them as arrays and values, and
    ``dcp.load`` of the same state dict gives them back exactly as DCP's own storage does."""
    import torch.distributed.checkpoint as dcp
    import shardpoint as sp
    from shardpoint.dcp import ShardpointReader, ShardpointWriter

    for arm, W, R in (
        ("fs", dcp.FileSystemWriter, dcp.FileSystemReader),
        ("sp", ShardpointWriter, ShardpointReader),
    ):
        p = str(tmp_path / arm)
        dcp.save({"w": torch.ones(3), **_values()}, storage_writer=W(p), no_dist=True)
        like = {
            "w": torch.zeros(3),
            **{k: None for k in _values()},
            "rng": {"numpy": None, "torch": torch.zeros_like(torch.get_rng_state())},
        }
        dcp.load(like, storage_reader=R(p), no_dist=True)
        for k, v in _values().items():
            assert _same(v, like[k]), (arm, k, like[k])
    _no_pickles(tmp_path / "sp")
    back = sp.load(str(tmp_path / "sp"))  # plain shardpoint sees the same values
    assert _same(back["rng"]["numpy"], _values()["rng"]["numpy"])
    np.random.set_state(like["rng"]["numpy"])  # and it is usable as what it was
    assert np.random.randint(1 << 30) == np.random.RandomState(7).randint(1 << 30)


def test_untemplated_view_of_values_matches_dcp(tmp_path):
    """DCP's template-free load (``_load_state_dict_from_keys``, what ``dcp_to_torch_save``
    uses) sees the same items and values from both storages."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    from shardpoint.dcp import ShardpointReader, ShardpointWriter

    dcp.save(_values(), storage_writer=dcp.FileSystemWriter(str(tmp_path / "fs")), no_dist=True)
    dcp.save(_values(), storage_writer=ShardpointWriter(tmp_path / "sp"), no_dist=True)
    theirs = _load_state_dict_from_keys(storage_reader=dcp.FileSystemReader(str(tmp_path / "fs")))
    ours = _load_state_dict_from_keys(storage_reader=ShardpointReader(tmp_path / "sp"))
    assert sorted(theirs) == sorted(ours) and _same(theirs, ours)


def test_refusals_are_shardpoint_classes_raw_inside_dcp_and_raised_by_the_facade(tmp_path):
    """A value the format cannot store: through ``dcp.save`` DCP's CheckpointException holds
    our UnsupportedValueError (DCP wraps every storage error, its own included); ``from
    shardpoint import dcp`` raises it as it is. Nothing is written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    import shardpoint as sp
    from shardpoint import dcp as spdcp
    from shardpoint.dcp import ShardpointWriter

    bad = {"w": torch.ones(2), "args": argparse.Namespace(lr=0.1)}
    with pytest.raises(CheckpointException) as ei:
        dcp.save(bad, storage_writer=ShardpointWriter(tmp_path / "c"), no_dist=True)
    assert isinstance(ei.value.failures[0][0], sp.UnsupportedValueError)
    assert spdcp.shardpoint_error(ei.value) is ei.value.failures[0][0]
    with pytest.raises(sp.UnsupportedValueError, match=r"args.*Namespace.*vars\(ns\)") as ei:
        spdcp.save(bad, checkpoint_id=tmp_path / "c", no_dist=True)
    assert isinstance(ei.value.__cause__, CheckpointException)
    assert not (tmp_path / "c").exists()
    # DCP's own refusals stay DCP's: a shape mismatch is its "Size mismatch"
    spdcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "s", no_dist=True)
    with pytest.raises(CheckpointException, match="Size mismatch"):
        spdcp.load({"w": torch.ones(4)}, checkpoint_id=tmp_path / "s", no_dist=True)


def test_a_dcp_filesystem_checkpoint_through_our_reader_is_our_clear_error(tmp_path):
    """Not ``AssertionError("metadata is None ...")``: our CheckpointNotFoundError naming what
    is there and how to convert it (raw: inside DCP's CheckpointException; facade: as is)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    import shardpoint as sp
    from shardpoint import dcp as spdcp
    from shardpoint.dcp import ShardpointReader

    p = str(tmp_path / "fs")
    dcp.save({"w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(p), no_dist=True)
    with pytest.raises(CheckpointException) as ei:
        dcp.load({"w": torch.zeros(3)}, storage_reader=ShardpointReader(p), no_dist=True)
    inner = ei.value.failures[0][0]
    assert isinstance(inner, sp.CheckpointNotFoundError), repr(inner)
    assert "DCP checkpoint" in str(inner) and "shardpoint convert" in str(inner)
    with pytest.raises(sp.CheckpointNotFoundError, match="DCP checkpoint"):
        spdcp.load({"w": torch.zeros(3)}, checkpoint_id=p, no_dist=True)
    with pytest.raises(sp.CheckpointNotFoundError, match="does not exist"):
        spdcp.load({"w": torch.zeros(3)}, checkpoint_id=tmp_path / "none", no_dist=True)
    with pytest.raises(sp.CheckpointNotFoundError):  # a direct call raises too
        ShardpointReader(p).read_metadata()


def test_overwrite_follows_dcp_and_never_deletes_other_files(tmp_path):
    """DCP's e2e ``test_overwrite``: overwrite=True (the default) replaces a checkpoint,
    overwrite=False refuses with "Checkpoint already exists". A directory of other files is
    refused and kept (DCP writes beside them; shardpoint never mixes or deletes them)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    import shardpoint as sp
    from shardpoint import dcp as spdcp
    from shardpoint.dcp import ShardpointWriter

    p = str(tmp_path / "c")
    t1, t2 = torch.randn(10), torch.randn(10)
    spdcp.save({"random": t1}, checkpoint_id=p, no_dist=True)
    dcp.save({"random": t2}, storage_writer=ShardpointWriter(p, overwrite=True), no_dist=True)
    sd = {"random": torch.zeros(10)}
    spdcp.load(sd, checkpoint_id=p, no_dist=True)
    assert torch.equal(sd["random"], t2)
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        dcp.save({"random": t1}, storage_writer=ShardpointWriter(p, overwrite=False), no_dist=True)
    with pytest.raises(sp.CheckpointExistsError, match="Checkpoint already exists"):
        spdcp.save(
            {"random": t1}, storage_writer=ShardpointWriter(p, overwrite=False), no_dist=True
        )
    spdcp.load(sd, checkpoint_id=p, no_dist=True)
    assert torch.equal(sd["random"], t2)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "model.pt").write_bytes(b"theirs")
    with pytest.raises(sp.CheckpointExistsError, match="not a checkpoint"):
        spdcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "mine", no_dist=True)
    assert os.listdir(tmp_path / "mine") == ["model.pt"]
    # DCP's e2e test_no_dist: an empty state dict saves and loads
    spdcp.save({}, checkpoint_id=tmp_path / "empty", no_dist=True)
    spdcp.load({}, checkpoint_id=tmp_path / "empty", no_dist=True)


def test_one_line_switch_save_load_async_save_and_dcp_names(tmp_path):
    """``from shardpoint import dcp`` in place of ``import torch.distributed.checkpoint as
    dcp``: the same calls write and read shardpoint checkpoints; DCP's other names are DCP's."""
    import torch.distributed.checkpoint as torch_dcp
    import shardpoint as sp
    from shardpoint import dcp

    state = {"model": {"w": torch.randn(4, 3)}, "step": 3, "rng": np.random.get_state()}
    dcp.save(state, checkpoint_id=str(tmp_path / "a"), no_dist=True)
    assert sp.read_metadata(str(tmp_path / "a")) is not None
    _no_pickles(tmp_path / "a")
    like = {"model": {"w": torch.zeros(4, 3)}, "step": 0, "rng": None}
    dcp.load(like, checkpoint_id=str(tmp_path / "a"), no_dist=True)
    assert torch.equal(like["model"]["w"], state["model"]["w"]) and like["step"] == 3
    assert _same(like["rng"], state["rng"])
    fut = dcp.async_save(state, checkpoint_id=str(tmp_path / "b"), no_dist=True)
    fut.result(timeout=120)
    assert sp.load(str(tmp_path / "b"))["step"] == 3
    bad = dcp.async_save(
        {"o": argparse.Namespace()}, checkpoint_id=str(tmp_path / "x"), no_dist=True
    )
    with pytest.raises(sp.UnsupportedValueError):
        bad.result(timeout=120)
    assert dcp.FileSystemWriter is torch_dcp.FileSystemWriter
    assert dcp.DefaultSavePlanner is torch_dcp.DefaultSavePlanner


def test_cache_staged_state_dict_is_honoured_by_dcp_async_save(tmp_path):
    """``cache_staged_state_dict=True`` (DCP's FileSystemWriter option): ``dcp.async_save``
    stages through the writer into one kept, pinned CPU copy reused by the next save, as
    through DCP's writer; without a GPU, pinning fails the same way for both writers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import AsyncStager
    import shardpoint as sp
    from shardpoint.dcp import ShardpointWriter

    w = ShardpointWriter(tmp_path / "a", cache_staged_state_dict=True)
    assert isinstance(w, AsyncStager) and w.cache_staged_state_dict
    state = {"w": torch.arange(6.0)}
    if not torch.cuda.is_available():
        errs = []
        for writer in (dcp.FileSystemWriter(str(tmp_path / "fs"), cache_staged_state_dict=True), w):
            with pytest.raises(RuntimeError) as ei:
                dcp.async_save(state, storage_writer=writer, no_dist=True).result(timeout=120)
            errs.append(str(ei.value))
        assert errs[0] == errs[1] and "accelerator" in errs[0]
        return
    dcp.async_save(state, storage_writer=w, no_dist=True).result(timeout=120)
    cached = w.state_dict_cache
    assert cached is not None
    state["w"] += 1
    dcp.async_save(state, checkpoint_id=str(tmp_path / "b"), storage_writer=w, no_dist=True).result(
        timeout=120
    )
    assert w.state_dict_cache is cached
    assert torch.equal(sp.load(str(tmp_path / "b"))["w"], torch.arange(6.0) + 1)
    assert torch.equal(sp.load(str(tmp_path / "a"))["w"], torch.arange(6.0))
