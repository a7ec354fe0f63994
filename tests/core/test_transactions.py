"""The checkpoint transactions (shardpoint_core.transactions): one writer and one reader for
every store, with the same outcomes on files, ``memory://`` and S3 (the local test server)."""
from __future__ import annotations

import uuid

import numpy as np
import pytest

from shardpoint_core.format.errors import (CheckpointExistsError, CheckpointNotFoundError,
                                           InvalidOptionError, LoadFailedError)
from shardpoint_core.format.manifest import Manifest, TensorEntry, array_path_for
from shardpoint_core.format.spec import ArraySpec
from shardpoint_core.transactions.reader import CheckpointReader
from shardpoint_core.transactions.writer import CheckpointWriter

SPEC = ArraySpec((4, 4), "float32", (2, 4))


@pytest.fixture(params=["files", "memory", "s3"])
def where(request, tmp_path):
    if request.param == "files":
        return str(tmp_path / "ck")
    if request.param == "memory":
        return f"memory://tx-{uuid.uuid4().hex[:8]}/ck"
    server = request.getfixturevalue("s3_env")
    return server.url(server.fresh_prefix("tx") + "/ck")


def _manifest(value: float) -> Manifest:
    """The manifest of one tensor ``w``; ``value`` only names the save in failures."""
    entry = TensorEntry("w", array_path_for("w"), SPEC.shape, SPEC.dtype, SPEC.chunk_shape)
    return Manifest({"dict": [["w", {"tensor": "w"}]]}, {"w": entry}, {}, save_world_size=2)


def _save(path: str, value: float, overwrite=False) -> None:
    """Two writers, as two ranks would: the coordinator begins, the other joins."""
    w0 = CheckpointWriter.begin(path, overwrite=overwrite)
    w1 = CheckpointWriter.join(path, w0.staging)
    with w0:
        for w, row in ((w0, 0), (w1, 2)):
            a = w.open_array(array_path_for("w"), SPEC)
            w.wait([w.write(a, (row, 0), np.full((2, 4), value + row, np.float32))])
            w.flush()
        w0.commit(_manifest(value))


def test_a_save_and_a_load_round_trip_on_every_store(where):
    _save(where, 1.0)
    r = CheckpointReader.open(where)
    assert list(r.manifest.tensors) == ["w"]
    out = np.empty((4, 4), np.float32)
    a = r.array("w")
    r.wait([r.read_into(a, (0, 0), out)])
    assert out[:2].tolist() == [[1.0] * 4] * 2 and out[2:].tolist() == [[3.0] * 4] * 2
    r.check_unchanged()


def test_the_same_refusals_on_every_store(where):
    with pytest.raises(CheckpointNotFoundError):
        CheckpointReader.open(where)
    _save(where, 1.0)
    with pytest.raises(CheckpointExistsError):
        CheckpointWriter.begin(where)
    with pytest.raises(InvalidOptionError, match="overwrite='yes'"):
        CheckpointWriter.begin(where, overwrite="yes")


def test_an_exception_inside_the_writer_leaves_the_previous_checkpoint(where):
    _save(where, 1.0)
    with pytest.raises(RuntimeError):
        with CheckpointWriter.begin(where, overwrite=True) as w:
            a = w.open_array(array_path_for("w"), SPEC)
            w.wait([w.write(a, (0, 0), np.zeros((2, 4), np.float32))])
            raise RuntimeError("a rank failed")
    assert w.state == "aborted"
    out = np.empty((4, 4), np.float32)
    r = CheckpointReader.open(where)
    r.wait([r.read_into(r.array("w"), (0, 0), out)])
    assert out[0, 0] == 1.0


def test_a_replacement_during_a_read_is_seen(where):
    _save(where, 1.0)
    r = CheckpointReader.open(where)
    _save(where, 5.0, overwrite=True)
    with pytest.raises(LoadFailedError, match="replaced"):
        r.check_unchanged()


def test_a_read_failing_because_of_a_replacement_says_so(tmp_path):
    """Reads that fail because another save replaced the checkpoint (its arrays gone under
    the manifest read first) are LoadFailedError [SP-COMMIT-14], the failure as its cause,
    not a damaged checkpoint: from opening an array and from waiting for a read. (Files:
    on an object store a replaced save's objects stay readable under its own prefix, so
    the reads succeed and :meth:`check_unchanged` tells.)"""
    where = str(tmp_path / "ck")
    _save(where, 1.0)
    r = CheckpointReader.open(where)
    a = r.array("w")
    _save_other(where)
    out = np.empty((2, 4), np.float32)
    with pytest.raises(LoadFailedError, match="replaced") as e:
        r.wait([r.read_into(a, (2, 0), out)])
    assert e.value.spec_id == "SP-COMMIT-14" and e.value.__cause__ is not None
    with pytest.raises(LoadFailedError, match="replaced"):
        r.array("w")


def _save_other(path: str) -> None:
    """A checkpoint at ``path`` (replacing it) whose one tensor is ``v``, not ``w``."""
    entry = TensorEntry("v", array_path_for("v"), SPEC.shape, SPEC.dtype, SPEC.chunk_shape)
    with CheckpointWriter.begin(path, overwrite=True) as w:
        a = w.open_array(entry.array, SPEC)
        w.wait([w.write(a, (0, 0), np.zeros((4, 4), np.float32))])
        w.flush()
        w.commit(Manifest({"dict": [["v", {"tensor": "v"}]]}, {"v": entry}, {},
                          save_world_size=1))


def test_only_the_coordinator_commits(where):
    w0 = CheckpointWriter.begin(where)
    w1 = CheckpointWriter.join(where, w0.staging)
    with w0:
        with pytest.raises(InvalidOptionError, match="only the coordinator"):
            w1.commit(_manifest(1.0))
    assert w0.state == "aborted"          # a block that never committed aborts
    with pytest.raises(CheckpointNotFoundError):
        CheckpointReader.open(where)
