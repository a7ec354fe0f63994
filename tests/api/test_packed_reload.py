"""A process loads the same packed checkpoint twice: the second load checks its data objects
again ([SP-PACK-7], [SP-SEC-5]); a file changed between the loads is refused by its own rule,
never followed (a link) or read short because the first load had found it sound."""

import os

import pytest
import torch

import shardpoint as sp
from shardpoint_core.format import errors


def _saved(tmp_path):
    st = {"w": torch.arange(4096, dtype=torch.float32), "step": 1}
    ck = tmp_path / "ck"
    sp.save(st, str(ck))  # the default: packed
    (obj,) = [p for p in (ck / "packed").iterdir()]
    got = sp.load(str(ck))
    assert torch.equal(got["w"], st["w"])  # sound: the backend has seen this object
    return ck, obj


def test_a_data_object_replaced_by_a_link_after_a_load_is_refused(tmp_path):
    ck, obj = _saved(tmp_path)
    outside = tmp_path / "outside.bin"
    os.replace(obj, outside)
    os.symlink(outside, obj)
    with pytest.raises(errors.CorruptCheckpointError, match=r"SP-SEC-5"):
        sp.load(str(ck))


def test_a_data_object_cut_short_after_a_load_is_refused_by_its_size(tmp_path):
    ck, obj = _saved(tmp_path)
    with open(obj, "r+b") as f:
        f.truncate(100)
    with pytest.raises(errors.CorruptCheckpointError, match=r"SP-PACK-7"):
        sp.load(str(ck))
