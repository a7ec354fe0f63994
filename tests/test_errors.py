"""Bad input and damaged checkpoints raise documented errors with spec IDs, never garbage."""
import argparse
import glob
import hashlib
import json
import os

import msgpack
import numpy as np
import pytest
import torch

import shardpoint as sp
from shardpoint.cli import main as cli
from shardpoint.metadata import decode_manifest

STATE = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "b": torch.ones(3)}


def saved(path):
    sp.save(STATE, path)
    return path


def chunk_files(path, key="w"):
    return sorted(f for f in glob.glob(f"{path}/tensors/{key}/c/**", recursive=True)
                  if os.path.isfile(f))


def rewrite_manifest(path, edit):
    mpath = f"{path}/manifest.msgpack"
    env = msgpack.unpackb(open(mpath, "rb").read())
    body = msgpack.unpackb(env["body"], strict_map_key=False)
    edit(body)
    raw = msgpack.packb(body, use_bin_type=True)
    with open(mpath, "wb") as f:
        f.write(msgpack.packb({"sha256": hashlib.sha256(raw).digest(), "body": raw}))


def test_flipped_chunk_byte_is_detected(tmp_ckpt):
    f = chunk_files(saved(tmp_ckpt))[0]
    data = bytearray(open(f, "rb").read())
    data[5] ^= 0x01
    open(f, "wb").write(bytes(data))
    with pytest.raises(sp.CorruptCheckpointError) as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-READ-3"
    assert cli(["verify", tmp_ckpt]) == 1


def test_missing_chunk_is_an_error_not_zeros(tmp_ckpt):
    os.remove(chunk_files(saved(tmp_ckpt))[0])
    with pytest.raises(sp.CorruptCheckpointError) as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-READ-2"


def test_truncated_chunk(tmp_ckpt):
    f = chunk_files(saved(tmp_ckpt))[0]
    open(f, "r+b").truncate(10)
    with pytest.raises(sp.CorruptCheckpointError):
        sp.load(tmp_ckpt)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_manifest(tmp_ckpt, damage):
    m = f"{saved(tmp_ckpt)}/manifest.msgpack"
    data = bytearray(open(m, "rb").read())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x40
    open(m, "wb").write(bytes(data))
    with pytest.raises(sp.CorruptCheckpointError) as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-MAN-1"


def test_missing_manifest_and_missing_path(tmp_ckpt):
    os.remove(f"{saved(tmp_ckpt)}/manifest.msgpack")
    with pytest.raises(sp.IncompleteCheckpointError):
        sp.load(tmp_ckpt)
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.load(tmp_ckpt + "-nope")
    assert cli(["inspect", tmp_ckpt + "-nope"]) == 2


def test_unknown_major_version(tmp_ckpt):
    rewrite_manifest(saved(tmp_ckpt), lambda b: b.update(format_version=[2, 0]))
    with pytest.raises(sp.UnsupportedFormatError) as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-VER-2"


def test_unknown_fields(tmp_ckpt):
    rewrite_manifest(saved(tmp_ckpt), lambda b: b.update(future={"must_understand": False}))
    assert torch.equal(sp.load(tmp_ckpt)["b"], torch.ones(3))   # ignorable
    rewrite_manifest(tmp_ckpt, lambda b: b.update(future={"x": 1}))
    with pytest.raises(sp.UnsupportedFormatError) as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-VER-3"


@pytest.mark.parametrize("bad", ["../../etc", "/abs/path", "tensors/../../x", "a//b"])
def test_array_path_escaping_the_checkpoint_is_rejected(tmp_ckpt, bad):
    rewrite_manifest(saved(tmp_ckpt), lambda b: b["tensors"]["w"].update(array=bad))
    with pytest.raises(sp.CorruptCheckpointError) as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-SEC-1"


def test_zarr_json_disagreeing_with_manifest(tmp_ckpt):
    z = f"{saved(tmp_ckpt)}/tensors/w/zarr.json"
    meta = json.load(open(z))
    meta["codecs"] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    json.dump(meta, open(z, "w"))
    with pytest.raises(sp.CorruptCheckpointError, match="crc32c") as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-ARRAY-2"


@pytest.mark.parametrize("leaf", [argparse.Namespace(lr=1), {1, 2}, lambda x: x, object()])
def test_unsupported_leaf_names_the_path_and_the_fix(tmp_ckpt, leaf):
    with pytest.raises(sp.UnsupportedValueError, match=r"state\['cfg'\]\['x'\].*convert"):
        sp.save({"cfg": {"x": leaf}}, tmp_ckpt)
    assert not os.path.exists(tmp_ckpt)


@pytest.mark.parametrize("key", ["", ".", ".."])
def test_keys_that_could_escape_are_refused(tmp_ckpt, key):
    with pytest.raises(sp.InvalidKeyError):
        sp.save({key: torch.ones(1)}, tmp_ckpt)


def test_dtype_outside_the_table(tmp_ckpt):
    with pytest.raises(sp.UnsupportedValueError, match="dtype"):
        sp.save({"q": torch.ones(2, dtype=torch.float8_e4m3fnuz)}, tmp_ckpt)


def test_big_endian_numpy_is_stored_little_endian(tmp_ckpt):
    a = np.arange(5, dtype=">i4")
    sp.save({"a": a}, tmp_ckpt)
    back = sp.load(tmp_ckpt)["a"]
    assert back.dtype == np.dtype("<i4") and back.tolist() == a.tolist()


def test_manifest_decode_never_unpickles():
    evil = b"\x80\x04\x95" + b"cos\nsystem\n(S'echo pwned'\ntR."
    with pytest.raises(sp.CorruptCheckpointError):
        decode_manifest(evil)


def test_cli_verify_reports_spec_ids_and_inspect_json(tmp_ckpt, capsys):
    saved(tmp_ckpt)
    assert cli(["inspect", "--json", tmp_ckpt]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tensors"]["w"]["shape"] == [8, 8]
    assert cli(["verify", "--strict", tmp_ckpt]) == 0
    os.remove(chunk_files(tmp_ckpt)[0])
    capsys.readouterr()
    assert cli(["verify", "--json", tmp_ckpt]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert [p["spec_id"] for p in rep["problems"]] == ["SP-READ-2"]


def test_verify_reports_writer_rules_by_id(tmp_ckpt):
    from shardpoint.verify import verify_checkpoint
    z = f"{saved(tmp_ckpt)}/tensors/b/zarr.json"
    meta = json.load(open(z))
    meta["fill_value"] = 1.0
    json.dump(meta, open(z, "w"))
    os.makedirs(f"{tmp_ckpt}/tensors/stray")
    json.dump(meta, open(f"{tmp_ckpt}/tensors/stray/zarr.json", "w"))
    ids = sorted(s for s, _ in verify_checkpoint(tmp_ckpt, strict=True))
    assert ids == ["SP-ARRAY-3", "SP-LAYOUT-3"]
    assert [s for s, _ in verify_checkpoint(tmp_ckpt)] == ["SP-ARRAY-3"]


@pytest.mark.parametrize("edit, sid", [
    (lambda b: b["tensors"]["w"].update(dtype=["float32"]), "SP-DTYPE-1"),
    (lambda b: b["tree"]["dict"].append(b["tree"]["dict"][0]), "SP-MAN-4"),
    (lambda b: b["tree"]["dict"].append(["v", {"value": [1, 2]}]), "SP-MAN-4"),
    (lambda b: b["tree"]["dict"].append(["v", {"value": 1, "x": 2}]), "SP-MAN-4"),
    (lambda b: b.update(save_world_size="4"), "SP-MAN-2"),
])
def test_malformed_manifest_bodies_raise_documented_errors(tmp_ckpt, edit, sid):
    rewrite_manifest(saved(tmp_ckpt), edit)
    with pytest.raises(sp.ShardpointError) as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == sid
