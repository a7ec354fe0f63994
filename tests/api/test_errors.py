"""Bad input and damaged checkpoints raise documented errors with spec IDs, never garbage."""

import argparse
import glob
import hashlib
import json
import math
import os

import msgpack
import numpy as np
import pytest
import torch

import shardpoint as sp
from shardpoint.tools.cli import main as cli
from shardpoint_core.format.manifest import decode_manifest
from shardpoint_testing.probes import error_within

STATE = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "b": torch.ones(3)}
# the packed layout (the default since 1.4) and the per-array one (on request): damage to a
# chunk is found in either
LAYOUTS = ["packed", "per-array"]


def backend_of(layout):
    return {"backend": sp.ZarrBackend()} if layout == "per-array" else {}


def saved(path, layout="packed", state=STATE):
    sp.save(state, path, **backend_of(layout))
    return path


def chunk_files(path, key="w"):
    return sorted(
        f for f in glob.glob(f"{path}/tensors/{key}/c/**", recursive=True) if os.path.isfile(f)
    )


def chunk_at(path, key="w"):
    """(file, offset, length) of the first stored chunk of ``key``: per-array its chunk file,
    packed its bytes in a data object (where the manifest's index says)."""
    e = sp.read_metadata(path).tensors[key]
    if e.packed is None:
        f = chunk_files(path, key)[0]
        return f, 0, os.path.getsize(f)
    obj, off, n, _crc = e.packed.chunk(0)
    return os.path.join(path, obj), off, n


def rewrite_manifest(path, edit):
    mpath = f"{path}/manifest.msgpack"
    env = msgpack.unpackb(open(mpath, "rb").read())
    body = msgpack.unpackb(env["body"], strict_map_key=False)
    edit(body)
    raw = msgpack.packb(body, use_bin_type=True)
    with open(mpath, "wb") as f:
        f.write(msgpack.packb({"sha256": hashlib.sha256(raw).digest(), "body": raw}))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flipped_chunk_byte_is_detected(tmp_ckpt, layout):
    f, off, _n = chunk_at(saved(tmp_ckpt, layout))
    data = bytearray(open(f, "rb").read())
    data[off + 5] ^= 0x01
    open(f, "wb").write(bytes(data))
    with pytest.raises(sp.CorruptCheckpointError) as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-READ-3"
    assert cli(["verify", tmp_ckpt]) == 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_missing_chunk_is_an_error_not_zeros(tmp_ckpt, layout):
    os.remove(chunk_at(saved(tmp_ckpt, layout))[0])  # packed: the data object holding it
    with pytest.raises(sp.CorruptCheckpointError) as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-READ-2"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_truncated_chunk(tmp_ckpt, layout):
    f, off, _n = chunk_at(saved(tmp_ckpt, layout))
    open(f, "r+b").truncate(off + 10)
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
    assert torch.equal(sp.load(tmp_ckpt)["b"], torch.ones(3))  # ignorable
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
    z = f"{saved(tmp_ckpt, 'per-array')}/tensors/w/zarr.json"  # packed: no zarr.json
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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cli_verify_reports_spec_ids_and_inspect_json(tmp_ckpt, capsys, layout):
    saved(tmp_ckpt, layout)
    assert cli(["inspect", "--json", tmp_ckpt]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tensors"]["w"]["shape"] == [8, 8]
    assert cli(["verify", "--strict", tmp_ckpt]) == 0
    os.remove(chunk_at(tmp_ckpt)[0])  # packed: the one data object, w's and b's chunks
    capsys.readouterr()
    assert cli(["verify", "--json", tmp_ckpt]) == 1
    rep = json.loads(capsys.readouterr().out)
    hit = ["b", "w"] if layout == "packed" else ["w"]
    assert [p["spec_id"] for p in rep["problems"]] == ["SP-READ-2"] * len(hit)
    assert sorted(p["message"].split("'")[1] for p in rep["problems"]) == hit


def test_verify_reports_writer_rules_by_id(tmp_ckpt):
    from shardpoint_core.verify import verify_checkpoint

    z = f"{saved(tmp_ckpt, 'per-array')}/tensors/b/zarr.json"  # packed: no zarr.json
    meta = json.load(open(z))
    meta["fill_value"] = 1.0
    json.dump(meta, open(z, "w"))
    os.makedirs(f"{tmp_ckpt}/tensors/stray")
    json.dump(meta, open(f"{tmp_ckpt}/tensors/stray/zarr.json", "w"))
    ids = sorted(s for s, _ in verify_checkpoint(tmp_ckpt, strict=True))
    assert ids == ["SP-ARRAY-3", "SP-LAYOUT-3"]
    assert [s for s, _ in verify_checkpoint(tmp_ckpt)] == ["SP-ARRAY-3"]


@pytest.mark.parametrize(
    "edit, sid",
    [
        # 1.3: a dtype that is not a str is a malformed field (SP-MAN-3), a str naming no dtype
        # of the table is SP-DTYPE-1 (unsupported)
        (lambda b: b["tensors"]["w"].update(dtype=["float32"]), "SP-MAN-3"),
        (lambda b: b["tensors"]["w"].update(dtype="float128"), "SP-DTYPE-1"),
        (lambda b: b["tree"]["dict"].append(b["tree"]["dict"][0]), "SP-MAN-4"),
        (lambda b: b["tree"]["dict"].append(["v", {"value": [1, 2]}]), "SP-MAN-4"),
        (lambda b: b["tree"]["dict"].append(["v", {"value": 1, "x": 2}]), "SP-MAN-4"),
        (lambda b: b.update(save_world_size="4"), "SP-MAN-2"),
    ],
)
def test_malformed_manifest_bodies_raise_documented_errors(tmp_ckpt, edit, sid):
    rewrite_manifest(saved(tmp_ckpt), edit)
    with pytest.raises(sp.ShardpointError) as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == sid


# ------------------------------------------------------------------ more damage and refusals
def write_manifest(path, m):
    from shardpoint_core.format.manifest import encode_manifest

    with open(f"{path}/manifest.msgpack", "wb") as f:
        f.write(encode_manifest(m))


def test_manifests_built_with_the_encoder_unknown_major_and_must_understand(tmp_ckpt):
    import dataclasses

    m = sp.read_metadata(saved(tmp_ckpt))
    write_manifest(tmp_ckpt, dataclasses.replace(m, format_version=(1, 7)))
    assert torch.equal(sp.load(tmp_ckpt)["b"], torch.ones(3))  # a newer minor reads
    for v in ((2, 0), (0, 9)):
        write_manifest(tmp_ckpt, dataclasses.replace(m, format_version=v))
        with pytest.raises(sp.UnsupportedFormatError) as e:
            sp.load(tmp_ckpt)
        assert e.value.spec_id == "SP-VER-2"
    write_manifest(tmp_ckpt, dataclasses.replace(m, extensions={"zstd": {"level": 3}}))
    with pytest.raises(sp.UnsupportedFormatError, match="zstd"):
        sp.load(tmp_ckpt)
    write_manifest(
        tmp_ckpt, dataclasses.replace(m, extensions={"hint": {"must_understand": False, "x": 1}})
    )
    assert torch.equal(sp.load(tmp_ckpt)["b"], torch.ones(3))


def test_unknown_field_in_a_tensor_entry(tmp_ckpt):
    rewrite_manifest(saved(tmp_ckpt), lambda b: b["tensors"]["w"].update(quant="int4"))
    with pytest.raises(sp.UnsupportedFormatError, match="quant") as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-VER-3"


def test_dtype_outside_the_table_in_a_manifest(tmp_ckpt):
    rewrite_manifest(saved(tmp_ckpt), lambda b: b["tensors"]["w"].update(dtype="int4"))
    with pytest.raises(sp.UnsupportedFormatError) as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-DTYPE-1" and "'w'" in str(e.value)


@pytest.mark.parametrize(
    "edit",
    [
        lambda b: b["tensors"].pop("w"),  # tree names it
        lambda b: b["tree"]["dict"].pop(0),  # entry not in tree
        lambda b: b.pop("tensors"),
        lambda b: b["tensors"]["w"].update(shape=[8, -1]),
        lambda b: b["tensors"]["w"].update(chunk_shape=[0, 8]),
        lambda b: b.update(format="safetensors"),
        lambda b: b["tensors"].update({"../x": b["tensors"]["w"]}),
    ],
)
def test_malformed_manifest_bodies_are_corrupt(tmp_ckpt, edit):
    rewrite_manifest(saved(tmp_ckpt), edit)
    with pytest.raises(sp.CorruptCheckpointError):
        sp.load(tmp_ckpt)


def test_dot_dot_array_path_names_sp_sec_1(tmp_ckpt):
    rewrite_manifest(saved(tmp_ckpt), lambda b: b["tensors"]["w"].update(array="../x"))
    with pytest.raises(sp.CorruptCheckpointError, match="SP-SEC-1"):
        sp.read_metadata(tmp_ckpt)


def sharded_save(path):
    from shardpoint_core.transactions.backend import ZarrBackend

    be = ZarrBackend(shard_above_bytes=1 << 10, inner_chunk_bytes=1 << 8)
    w = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)
    sp.save({"w": w}, path, backend=be)
    return w


@pytest.mark.parametrize("damage", ["flip_inner", "truncate", "delete", "flip_index"])
def test_damage_inside_a_sharded_chunk(tmp_ckpt, damage):
    sharded_save(tmp_ckpt)
    meta = json.load(open(f"{tmp_ckpt}/tensors/w/zarr.json"))
    assert meta["codecs"][0]["name"] == "sharding_indexed"
    f = chunk_files(tmp_ckpt)[0]
    data = bytearray(open(f, "rb").read())
    if damage == "flip_inner":
        data[3] ^= 0x10
    elif damage == "flip_index":
        data[-6] ^= 0x10
    elif damage == "truncate":
        data = data[: len(data) - 7]
    if damage == "delete":
        os.remove(f)
    else:
        open(f, "wb").write(bytes(data))
    with pytest.raises(sp.CorruptCheckpointError):
        sp.load(tmp_ckpt)
    # a partial read that touches the damaged shard fails too; never zeros
    with pytest.raises(sp.CorruptCheckpointError):
        sp.load(tmp_ckpt, like={"w": sp.ShardedTensor(torch.empty(1, 16), (64, 16), (0, 0))})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_deleted_chunk_of_an_all_zero_tensor_is_still_an_error(tmp_ckpt, layout):
    saved(tmp_ckpt, layout, {"z": torch.zeros(4, 4)})
    f, off, n = chunk_at(tmp_ckpt, "z")
    assert n == 4 * 16 + 4, "an all-zero chunk is stored (and its crc32c), not left to the fill"
    os.remove(f)
    with pytest.raises(sp.CorruptCheckpointError):
        sp.load(tmp_ckpt)


def test_missing_manifest_message_and_file_path(tmp_ckpt, tmp_path):
    os.remove(f"{saved(tmp_ckpt)}/manifest.msgpack")
    with pytest.raises(sp.IncompleteCheckpointError) as e:
        sp.read_metadata(tmp_ckpt)
    assert e.value.spec_id == "SP-COMMIT-3"
    f = tmp_path / "plainfile"
    f.write_bytes(b"x")
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.load(str(f))


def test_leaves_refused_in_nested_containers_name_their_path(tmp_ckpt):
    with pytest.raises(sp.UnsupportedValueError, match=r"state\['opt'\]\[0\]\['x'\]"):
        sp.save({"opt": [{"x": {1, 2}}]}, tmp_ckpt)
    with pytest.raises(sp.UnsupportedValueError, match=r"state\['f'\].*function"):
        sp.save({"f": lambda: 0}, tmp_ckpt)
    assert not os.path.exists(tmp_ckpt)


@pytest.mark.parametrize(
    "bad",
    [
        torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8),
        torch.ones(2, dtype=torch.float8_e5m2fnuz),
        np.zeros(2, dtype=np.float128),
        np.zeros(2, dtype="U3"),
        np.zeros(2, dtype=[("a", "i4")]),
    ],
)
def test_dtypes_outside_the_table_are_refused_with_the_path(tmp_ckpt, bad):
    with pytest.raises(sp.UnsupportedValueError) as e:
        sp.save({"m": {"q": bad}}, tmp_ckpt)
    assert e.value.spec_id == "SP-DTYPE-1" and "state['m']['q']" in str(e.value)
    assert not os.path.exists(tmp_ckpt)


def test_big_endian_uint16_is_sensible(tmp_ckpt):
    a = np.arange(70000, 70010, dtype=np.uint32).astype(">u2")
    sp.save({"a": a}, tmp_ckpt)
    assert sp.read_metadata(tmp_ckpt).tensors["a"].dtype == "uint16"
    back = sp.load(tmp_ckpt)["a"]
    assert back.dtype == np.uint16 and back.tolist() == a.tolist()


# ---- spec 1.1: portable array paths ([SP-LAYOUT-4]) ---------------------------------------
def test_keys_differing_in_case_long_or_reserved_get_distinct_portable_array_paths(tmp_ckpt):
    from shardpoint_core.format.manifest import array_path_for
    from shardpoint_core.verify import verify_checkpoint

    state = {
        "Encoder": torch.ones(2),
        "encoder": torch.zeros(2),
        "con": torch.arange(3),
        "x" * 300: torch.ones(1),
        "dot.": torch.ones(1),
    }
    sp.save(state, tmp_ckpt)
    m = sp.read_metadata(tmp_ckpt)
    paths = [e.array for e in m.tensors.values()]
    assert len({p.lower() for p in paths}) == len(paths)
    assert m.tensors["Encoder"].array == "tensors/Encoder~1" == array_path_for("Encoder")
    assert m.tensors["encoder"].array == "tensors/encoder"
    for k in ("con", "x" * 300, "dot."):
        assert m.tensors[k].array.startswith("tensors/~h/")
    assert all(len(c) <= 255 for p in paths for c in p.split("/"))
    got = sp.load(tmp_ckpt)
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert verify_checkpoint(tmp_ckpt, strict=True).ok


# ---- spec 1.1: files, sizes, depth ([SP-SEC-5], [SP-SEC-2], [SP-MAN-5]) -------------------
def _load_in_thread(path):
    return error_within(lambda: sp.load(path), what="the load")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_fifo_in_place_of_a_chunk_is_refused_without_blocking(tmp_ckpt, layout):
    chunk = chunk_at(saved(tmp_ckpt, layout, {"w": torch.ones(4)}))[0]  # or the data object
    os.remove(chunk)
    os.mkfifo(chunk)
    err = _load_in_thread(tmp_ckpt)
    assert isinstance(err, sp.CorruptCheckpointError) and err.spec_id == "SP-SEC-5"
    assert "FIFO" in str(err) or "special" in str(err)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_symlinks_inside_a_checkpoint_are_refused(tmp_ckpt, tmp_path, layout):
    chunk = chunk_at(saved(tmp_ckpt, layout, {"w": torch.ones(4)}))[0]  # or the data object
    outside = tmp_path / "outside"
    outside.write_bytes(open(chunk, "rb").read())
    os.remove(chunk)
    os.symlink(outside, chunk)
    err = _load_in_thread(tmp_ckpt)
    assert isinstance(err, sp.CorruptCheckpointError) and err.spec_id == "SP-SEC-5"
    m = f"{tmp_ckpt}/manifest.msgpack"
    os.rename(m, tmp_path / "m")
    os.symlink(tmp_path / "m", m)
    with pytest.raises(sp.CorruptCheckpointError) as e:
        sp.read_metadata(tmp_ckpt)
    assert e.value.spec_id == "SP-SEC-5"


def test_a_symlinked_checkpoint_root_is_fine(tmp_ckpt, tmp_path):
    sp.save({"w": torch.ones(4)}, tmp_ckpt)
    os.symlink(tmp_ckpt, tmp_path / "alias")
    assert torch.equal(sp.load(str(tmp_path / "alias"))["w"], torch.ones(4))


def test_oversized_manifest_and_zarr_json_are_refused_before_reading(tmp_ckpt):
    saved(tmp_ckpt, "per-array", {"w": torch.ones(4)})  # packed: no zarr.json
    z = f"{tmp_ckpt}/tensors/w/zarr.json"
    meta = json.load(open(z))
    meta["attributes"] = {"pad": "x" * (1 << 20)}
    json.dump(meta, open(z, "w"))
    with pytest.raises(sp.CorruptCheckpointError) as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-SEC-2" and "zarr.json" in str(e.value)
    with open(f"{tmp_ckpt}/manifest.msgpack", "r+b") as f:
        f.truncate((1 << 30) + 1)  # sparse: nothing is written
    with pytest.raises(sp.CorruptCheckpointError) as e:
        sp.read_metadata(tmp_ckpt)
    assert e.value.spec_id == "SP-SEC-2"


def test_writers_refuse_a_tree_deeper_than_the_format_allows(tmp_ckpt):
    deep = torch.ones(1)
    for _ in range(90):
        deep = {"d": deep}
    with pytest.raises(sp.ShardpointError) as e:
        sp.save(deep, tmp_ckpt)
    assert e.value.spec_id == "SP-MAN-5" and not os.path.exists(tmp_ckpt)
    ok = 1
    for _ in range(80):
        ok = {"d": ok}
    sp.save(ok, tmp_ckpt)
    assert sp.read_metadata(tmp_ckpt).tree


def _claim(m, shape, chunk):
    """Give tensor w of manifest ``m`` this shape and chunk shape; a packed one's index
    record and data object claim the one chunk's size to match (as a hostile writer would,
    so the index's own checks pass and the claim reaches the reader's limits)."""
    import dataclasses

    e = m.tensors["w"]
    e.shape, e.chunk_shape = shape, chunk
    if m.packed is not None:
        n = 4 * math.prod(chunk) + 4  # float32, then the crc32c
        rec = m.packed.records.copy()
        rec["length"][0] = n
        obj, size = m.packed.objects[0]
        m.packed = dataclasses.replace(m.packed, records=rec, objects=[(obj, max(size, n))])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rank_limit_and_unallocatable_tensors(tmp_ckpt, layout):
    from shardpoint_core.format.manifest import decode_manifest, encode_manifest

    saved(tmp_ckpt, layout, {"w": torch.ones(4)})
    mpath = f"{tmp_ckpt}/manifest.msgpack"
    m = decode_manifest(open(mpath, "rb").read())
    _claim(m, (1,) * 65, (1,) * 65)
    open(mpath, "wb").write(encode_manifest(m))
    with pytest.raises(sp.CorruptCheckpointError) as err:
        sp.read_metadata(tmp_ckpt)
    assert err.value.spec_id == "SP-SEC-2"
    big = (1 << 50, 1 << 10)  # packed: as one chunk (an index of 2^60 records cannot be)
    _claim(m, big, (1, 1) if m.packed is None else big)
    open(mpath, "wb").write(encode_manifest(m))
    with pytest.raises(sp.ResourceLimitError, match="'w'") as err:
        sp.load(tmp_ckpt)
    assert err.value.category == "resource-limit"


@pytest.mark.parametrize(
    "cls, category",
    [
        (sp.CorruptCheckpointError, "corrupt"),
        (sp.IncompleteCheckpointError, "incomplete"),
        (sp.UnsupportedFormatError, "unsupported"),
        (sp.LayoutMismatchError, "layout-mismatch"),
        (sp.ResourceLimitError, "resource-limit"),
        (sp.InvalidShardingError, "caller-error"),
    ],
)
def test_every_error_class_names_its_spec_category(cls, category):
    assert cls.category == category
    spec = open(os.path.join(os.path.dirname(__file__), "..", "..", "spec", "format.md")).read()
    assert f"*{category.replace('-', ' ')}*" in spec


def test_replacing_leaves_no_staging_or_old_directory_behind(tmp_ckpt):
    # [SP-COMMIT-6]: after the exchange the previous checkpoint sits under the -tmp- name
    # until the writer deletes it; nothing of either name may be left after a save returns.
    sp.save({"w": torch.zeros(2)}, tmp_ckpt)
    sp.save({"w": torch.ones(3)}, tmp_ckpt, overwrite=True)
    parent, name = os.path.split(tmp_ckpt)
    assert [n for n in os.listdir(parent) if n.startswith(f".{name}.shardpoint-")] == []
    assert torch.equal(sp.load(tmp_ckpt)["w"], torch.ones(3))
    os.makedirs(f"{tmp_ckpt}2")
    open(f"{tmp_ckpt}2/user_file", "w").write("x")
    with pytest.raises(sp.CheckpointExistsError):  # [SP-COMMIT-5]: never without consent
        sp.save({"w": torch.zeros(2)}, f"{tmp_ckpt}2")
    assert os.listdir(f"{tmp_ckpt}2") == ["user_file"]


@pytest.mark.parametrize("bad", [-1, True, (), (0, -2), "a", 1.0])
def test_replica_id_is_checked_when_assigned_after_construction(bad):
    """Megatron-style code sets ``replica_id`` after building the piece: a bad one must fail
    there with the documented error, not as a TypeError deep inside a save."""
    st = sp.ShardedTensor(torch.zeros(2), (4,), (0,))
    so = sp.ShardedObject({"a": 1}, 0, 2)
    for x in (st, so):
        with pytest.raises(sp.InvalidShardingError, match="replica_id"):
            x.replica_id = bad
    st.replica_id = (1, 0)
    so.replica_id = 3
    assert st.replica_id == (1, 0) and so.replica_id == (3,)


def test_full_disk_while_writing_the_manifest_names_the_file(tmp_path):
    """ENOSPC from write(2)/fsync(2) names no file; the error must (issue 21)."""
    import subprocess
    from shardpoint_core.transactions.backend import ZarrBackend

    disk = tmp_path / "disk"
    disk.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        with pytest.raises(OSError) as e:
            ZarrBackend().write_manifest(str(disk), bytes(1 << 20))
        assert e.value.errno == 28 and e.value.filename == f"{disk}/manifest.msgpack.partial"
        from shardpoint_core.stores.fsutil import os_error_text

        assert "manifest.msgpack.partial" in os_error_text(e.value)
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
