"""The checkpoint transactions (shardpoint_core.transactions): one writer and one reader for
every store, with the same outcomes on files, ``memory://`` and S3 (the local test server)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from shardpoint_core.format.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    InvalidOptionError,
    LoadFailedError,
)
from shardpoint_core.format.manifest import Manifest, TensorEntry, array_path_for
from shardpoint_core.format.spec import ArraySpec
from shardpoint_core.transactions.backend import ZarrBackend
from shardpoint_core.transactions.packed import PackedBackend
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


def _save(path: str, value: float, overwrite=False, backend=None) -> None:
    """Two writers, as two ranks would: the coordinator begins, the other joins (here in one
    process, sharing the backend: the packed one keeps each writer's index part)."""
    w0 = CheckpointWriter.begin(path, overwrite=overwrite, backend=backend)
    w1 = CheckpointWriter.join(path, w0.staging, backend=backend)
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


@pytest.mark.parametrize("layout", ["packed", "per-array"])
def test_a_read_failing_because_of_a_replacement_says_so(tmp_path, layout):
    """Reads that fail because another save replaced the checkpoint (its arrays or data
    objects gone under the manifest read first) are LoadFailedError [SP-COMMIT-14], the
    failure as its cause, not a damaged checkpoint: from waiting for a read, and from
    opening an array where that reads storage (per-array: its zarr.json; packed: the
    manifest's index, so the read after it tells). (Files: on an object store a replaced
    save's objects stay readable under its own prefix, so the reads succeed and
    :meth:`check_unchanged` tells.)"""
    where = str(tmp_path / "ck")
    _save(where, 1.0, backend=None if layout == "packed" else ZarrBackend())
    r = CheckpointReader.open(where)
    a = r.array("w")
    _save_other(where)
    out = np.empty((2, 4), np.float32)
    with pytest.raises(LoadFailedError, match="replaced") as e:
        r.wait([r.read_into(a, (2, 0), out)])
    assert e.value.spec_id == "SP-COMMIT-14" and e.value.__cause__ is not None
    with pytest.raises(LoadFailedError, match="replaced") as e:
        b = r.array("w")  # per-array: raises here
        r.wait([r.read_into(b, (0, 0), out)])  # packed: here
    assert e.value.spec_id == "SP-COMMIT-14"
    if layout == "packed":
        assert "'w'" in str(e.value.__cause__) and "packed/" in str(e.value.__cause__)


def _save_other(path: str) -> None:
    """A checkpoint at ``path`` (replacing it) whose one tensor is ``v``, not ``w``."""
    entry = TensorEntry("v", array_path_for("v"), SPEC.shape, SPEC.dtype, SPEC.chunk_shape)
    with CheckpointWriter.begin(path, overwrite=True) as w:
        a = w.open_array(entry.array, SPEC)
        w.wait([w.write(a, (0, 0), np.zeros((4, 4), np.float32))])
        w.flush()
        w.commit(Manifest({"dict": [["v", {"tensor": "v"}]]}, {"v": entry}, {}, save_world_size=1))


def test_only_the_coordinator_commits(where):
    w0 = CheckpointWriter.begin(where)
    w1 = CheckpointWriter.join(where, w0.staging)
    with w0:
        with pytest.raises(InvalidOptionError, match="only the coordinator"):
            w1.commit(_manifest(1.0))
    assert w0.state == "aborted"  # a block that never committed aborts
    with pytest.raises(CheckpointNotFoundError):
        CheckpointReader.open(where)


def _save_many(path: str, n: int) -> None:
    """One writer saves ``n`` small tensors, then they are read back through a reader."""
    spec = ArraySpec((2, 4), "float32", (2, 4))
    keys = [f"t{i}" for i in range(n)]
    entries = {
        k: TensorEntry(k, array_path_for(k), spec.shape, spec.dtype, spec.chunk_shape) for k in keys
    }
    with CheckpointWriter.begin(path) as w:
        ops = [
            w.write(w.open_array(array_path_for(k), spec), (0, 0), np.full((2, 4), i, np.float32))
            for i, k in enumerate(keys)
        ]
        w.wait(ops)
        w.flush()
        w.commit(Manifest({"dict": [[k, {"tensor": k}] for k in keys]}, entries, {}))
    with CheckpointReader.open(path) as r:
        out = np.empty((n, 2, 4), np.float32)
        r.wait([r.read_into(r.array(k), (0, 0), out[i]) for i, k in enumerate(keys)])
        r.check_unchanged()
    assert out[:, 0, 0].tolist() == list(range(n))


@pytest.mark.parametrize("kind", ["files", "memory"])
def test_a_path_becomes_a_store_and_key_once_per_save_not_once_per_array(
    kind, tmp_path, monkeypatch
):
    """Issue 29: each array opened for a write or a read located its root again; the
    backend keeps the location of a save's (a load's) root until its flush (its end)."""
    from shardpoint_core.stores import location
    from shardpoint_core.transactions.resolve import backend_for

    calls: list = []
    real = location.locate

    def counting(path, *a, **kw):
        calls.append(str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(location, "locate", counting)
    import shardpoint_core.transactions.backend as backend_module

    if hasattr(backend_module, "locate"):  # bound by name there: counted as well
        monkeypatch.setattr(backend_module, "locate", counting)
    base = str(tmp_path) if kind == "files" else f"memory://loc-{uuid.uuid4().hex[:8]}"
    counts = []
    for n in (1, 50):
        calls.clear()
        _save_many(f"{base}/n{n}", n)
        counts.append(len(calls))
    assert counts[0] == counts[1], (counts, calls)
    # nothing of either save or load stays in the backend (memory stays flat): the
    # default packed one's per-save state, and the locations of the Zarr one it reads with
    be = backend_for(base)
    assert isinstance(be, PackedBackend)
    for kept in (be._writers, be._crcs, be._own, be._bases, be.zarr._locations):
        assert not [k for k in kept if k.startswith(base)], kept


def test_locations_never_released_stay_bounded(tmp_path):
    """A reader that is never closed leaves its root's location behind; at most a few."""
    be = ZarrBackend()
    _save_many(str(tmp_path / "c"), 1)
    e = CheckpointReader.open(str(tmp_path / "c"), backend=be).manifest.tensors["t0"]
    for i in range(ZarrBackend._LOCATIONS_KEPT + 10):
        be.open_array_for_read(f"{tmp_path}/c/./{'./' * i}", e.array, e.spec, "t0")
    assert len(be._locations) == ZarrBackend._LOCATIONS_KEPT
