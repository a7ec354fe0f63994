"""Opening a local array of the per-array layout (``opening.open_local_array``, what both
front ends call before a read; the checkpoints here are saved with ``ZarrBackend()``, the
default being packed): one listing pass tells file kinds at every level ([SP-SEC-5]) without
blocking on a FIFO, a missing array or zarr.json is [SP-ARRAY-1], and the remembered check of
a zarr.json document never lets a second array past a check its own manifest entry fails.
The packed layout's objects get the same file-kind checks ([SP-PACK-6])."""

import glob
import json
import os
import shutil

import pytest
import torch

import shardpoint as sp
from shardpoint_core.format.errors import CorruptCheckpointError
from shardpoint_core.arrays import checks, opening
from shardpoint_testing.probes import error_within, vector_on_store

ZARR = sp.ZarrBackend()  # these cases are about the per-array layout's files


def _open(root, key="w", shape=(4, 6), dtype="float32", chunk=(4, 6)):
    return opening.open_local_array(str(root), f"tensors/{key}", shape, dtype, chunk, 4, key)


def _open_in_thread(root):
    return error_within(lambda: _open(root), what="the open")


def _fifo(p):
    os.remove(p) if os.path.isfile(p) else shutil.rmtree(p)
    os.mkfifo(p)


def _link_out(p, tmp_path):
    out = tmp_path / "outside"
    shutil.move(p, out)
    os.symlink(out, p)


def _dir(p):
    os.remove(p)
    os.mkdir(p)


DAMAGE = {
    "tensors dir is a symlink": ("tensors", _link_out),
    "array dir is a symlink": ("tensors/w", _link_out),
    "zarr.json is a symlink": ("tensors/w/zarr.json", _link_out),
    "zarr.json is a FIFO": ("tensors/w/zarr.json", lambda p, _t: _fifo(p)),
    "zarr.json is a directory": ("tensors/w/zarr.json", lambda p, _t: _dir(p)),
    "c is a symlink": ("tensors/w/c", _link_out),
    "a chunk dir is a FIFO": ("tensors/w/c/0", lambda p, _t: _fifo(p)),
    "a chunk file is a symlink": ("tensors/w/c/0/0", _link_out),
    "a stray FIFO beside zarr.json": ("tensors/w/stray", lambda p, _t: os.mkfifo(p)),
}


@pytest.mark.parametrize("what", list(DAMAGE))
def test_every_file_kind_is_checked_without_blocking(tmp_ckpt, tmp_path, what):
    sp.save({"w": torch.ones(4, 6)}, tmp_ckpt, backend=ZARR)
    _open(tmp_ckpt)  # sound before the damage
    rel, damage = DAMAGE[what]
    damage(os.path.join(tmp_ckpt, rel), tmp_path)
    err = _open_in_thread(tmp_ckpt)
    assert isinstance(err, CorruptCheckpointError) and err.spec_id == "SP-SEC-5", (what, err)
    assert "'w'" in str(err)


def _object(root):
    return glob.glob(os.path.join(root, "packed", "*.bin"))[0]


PACKED_DAMAGE = {
    "packed dir is a symlink": lambda r, t: _link_out(os.path.join(r, "packed"), t),
    "packed dir is a FIFO": lambda r, t: _fifo(os.path.join(r, "packed")),
    "an object is a FIFO": lambda r, t: _fifo(_object(r)),
    "an object is a directory": lambda r, t: _dir(_object(r)),
}


@pytest.mark.parametrize("what", list(PACKED_DAMAGE))
def test_every_file_kind_of_a_packed_checkpoint_is_checked_without_blocking(
    tmp_ckpt, tmp_path, what
):
    """The default (packed) layout: its directory and data objects are checked by kind
    ([SP-SEC-5], [SP-PACK-6]) before a read, by load and by open, naming tensor and object;
    each load checks them again ([SP-PACK-7]: a sound load before the damage made the next
    one in the same process skip the checks, and block on a FIFO)."""
    sp.save({"w": torch.ones(4, 6)}, tmp_ckpt)
    assert torch.equal(sp.load(tmp_ckpt)["w"], torch.ones(4, 6))  # sound before the damage
    PACKED_DAMAGE[what](tmp_ckpt, tmp_path)

    def open_read():
        with sp.open(tmp_ckpt) as ck:
            ck["w"].to_torch()

    for read in (lambda: sp.load(tmp_ckpt), open_read):
        err = error_within(read, what="the read")
        assert isinstance(err, CorruptCheckpointError) and err.spec_id == "SP-SEC-5", (what, err)
        assert "'w'" in str(err) and "packed/" in str(err) and "not a regular" in str(err)


def test_verify_through_a_backend_a_load_used_checks_the_objects_again(tmp_ckpt):
    """A load never closed (the JAX loader's) left the data objects it found sound in the
    shared backend; verify through that backend checks them again ([SP-PACK-7]), so an
    object since replaced by a FIFO is reported, not blocked on."""
    from shardpoint_core.transactions.reader import CheckpointReader
    from shardpoint_core.transactions.resolve import get_backend
    from shardpoint_core.verify import verify_checkpoint

    sp.save({"w": torch.ones(4, 6)}, tmp_ckpt)
    CheckpointReader.open(tmp_ckpt).array("w")  # the objects checked, the reader not closed
    _fifo(_object(tmp_ckpt))
    box = {}

    def verify():
        box["rep"] = verify_checkpoint(tmp_ckpt, backend=get_backend())

    assert error_within(verify, what="verify") is None
    assert box["rep"].spec_ids == ["SP-SEC-5"] and "packed/" in box["rep"].problems[0][1]


@pytest.mark.parametrize("rel", ["tensors/w", "tensors/w/zarr.json", "tensors"])
def test_a_missing_array_or_zarr_json_is_sp_array_1(tmp_ckpt, rel):
    sp.save({"w": torch.ones(4, 6)}, tmp_ckpt, backend=ZARR)
    p = os.path.join(tmp_ckpt, rel)
    os.remove(p) if os.path.isfile(p) else shutil.rmtree(p)
    with pytest.raises(CorruptCheckpointError) as e:
        _open(tmp_ckpt)
    assert e.value.spec_id == "SP-ARRAY-1" and "zarr.json" in str(e.value)


def test_stray_regular_files_are_allowed_and_not_counted_as_chunks(tmp_ckpt):
    sp.save({"w": torch.ones(4, 6), "s": torch.tensor(2.5)}, tmp_ckpt, backend=ZARR)
    with open(f"{tmp_ckpt}/tensors/w/notes.txt", "wb") as f:
        f.write(b"x" * 1000)
    raw, chunks = checks.scan_array(tmp_ckpt, "tensors/w", "w")
    assert [os.path.relpath(e.path, tmp_ckpt) for e in chunks] == ["tensors/w/c/0/0"]
    assert json.loads(raw)["shape"] == [4, 6]
    _, chunks = checks.scan_array(tmp_ckpt, "tensors/s", "s")  # 0-d: the chunk is "c"
    assert [os.path.relpath(e.path, tmp_ckpt) for e in chunks] == ["tensors/s/c"]
    out = sp.load(tmp_ckpt)
    assert torch.equal(out["w"], torch.ones(4, 6)) and out["s"].item() == 2.5


def test_a_remembered_zarr_json_is_still_checked_against_each_manifest_entry(tmp_ckpt):
    # Two arrays with byte-identical zarr.json: the first passes and is remembered; the
    # second's manifest entry says another shape, which must still be refused.
    sp.save({"w": torch.ones(4, 6)}, tmp_ckpt, backend=ZARR)
    meta = _open(tmp_ckpt)
    assert _open(tmp_ckpt) is meta  # remembered: parsed once
    with pytest.raises(CorruptCheckpointError) as e:
        _open(tmp_ckpt, shape=(4, 7), chunk=(4, 7))
    assert e.value.spec_id == "SP-ARRAY-2"
    with pytest.raises(CorruptCheckpointError) as e:
        _open(tmp_ckpt, dtype="int32")
    assert e.value.spec_id == "SP-ARRAY-2"


def test_a_refused_zarr_json_is_refused_every_time(tmp_ckpt):
    sp.save({"w": torch.ones(4, 6)}, tmp_ckpt, backend=ZARR)
    z = f"{tmp_ckpt}/tensors/w/zarr.json"
    with open(z, "rb") as f:
        raw = f.read()
    with open(z, "wb") as f:  # the same document with a name repeated
        f.write(raw[:-1] + b',"zarr_format":3}')
    for _ in range(2):
        with pytest.raises(CorruptCheckpointError) as e:
            _open(tmp_ckpt)
        assert e.value.spec_id == "SP-ARRAY-6"


def test_chunk_sizes_are_checked_from_the_listing(tmp_ckpt):
    sp.save({"w": torch.ones(4, 6)}, tmp_ckpt, backend=ZARR)
    chunk = glob.glob(f"{tmp_ckpt}/tensors/w/c/0/0")[0]
    with open(chunk, "ab") as f:
        f.write(b"\0")
    with pytest.raises(CorruptCheckpointError) as e:
        _open(tmp_ckpt)
    assert e.value.spec_id == "SP-READ-3" and "extra bytes" in str(e.value)


VECTORS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "spec",
    "vectors",
    "invalid",
)


@pytest.mark.parametrize(
    "case",
    [
        "zarr_json_repeated_name",
        "zarr_json_too_deep",
        "fill_value_minus_zero",
        "bad_zarr_json",
        "unknown_codec",
    ],
)
def test_zarr_json_rules_hold_on_a_store_without_files(case):
    """The zarr.json vectors uploaded to ``memory://`` fail as on files: the object-store
    path parses by [SP-ARRAY-6] too (it took plain ``json.loads``, which accepted a
    repeated name, ``-0`` and any depth up to a RecursionError)."""
    url = f"memory://torch-vectors/{case}"
    exp = vector_on_store(os.path.join(VECTORS, case), url)
    with pytest.raises(sp.ShardpointError) as e:
        sp.load(url)
    assert (type(e.value).__name__, e.value.spec_id) == (exp["error"], exp["spec_id"]), e.value


def test_a_zarr_json_nested_past_the_recursion_limit_on_a_store_without_files():
    from shardpoint_core.stores.registry import bucket_store

    url = "memory://torch-deep/ckpt"
    sp.save({"w": torch.ones(3)}, url, backend=ZARR)
    store, key = bucket_store(url, "open")
    z = f"{key}/{sp.read_metadata(url).tensors['w'].array}/zarr.json"
    meta = json.loads(store.get_range(z, 0, 1 << 20))
    deep = b"[" * 100_000 + b"]" * 100_000
    store.put(z, json.dumps(meta).encode()[:-1] + b',"attributes":{"x":' + deep + b"}}")
    with pytest.raises(CorruptCheckpointError) as e:
        sp.load(url)
    assert e.value.spec_id == "SP-ARRAY-6"
