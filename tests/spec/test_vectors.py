"""Golden vectors: bytes reproduce exactly, both reader paths read them, errors match,
and the dtype table of spec/format.md decodes the stored bytes."""

import filecmp
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import shardpoint as sp
from shardpoint_conformance import vectors

ROOT = Path(__file__).resolve().parents[2] / "spec" / "vectors"


def _files(d):
    return sorted(str(p.relative_to(d)) for p in Path(d).rglob("*") if p.is_file())


def test_regenerated_vectors_are_byte_identical(tmp_path):
    vectors.generate(str(tmp_path))
    assert _files(tmp_path) == _files(ROOT), "the set of vector files drifted"
    for rel in _files(ROOT):  # zarr.json, chunks, manifest.msgpack, expected.json
        assert filecmp.cmp(ROOT / rel, tmp_path / rel, shallow=False), f"bytes drifted: {rel}"


def test_every_vector_reads_as_expected_both_ways():
    ok, text = vectors.check_vectors(str(ROOT))
    assert ok, text
    n = len(os.listdir(ROOT / "valid")) + len(os.listdir(ROOT / "invalid"))
    assert text.count(": ok") == n >= 14, text


def test_required_cases_exist_and_cover_what_they_claim():
    valid = set(os.listdir(ROOT / "valid"))
    assert {
        "all_dtypes",
        "nested_tree",
        "multi_chunk",
        "empty_and_scalar",
        "key_escaping",
        "object_grid",
        "edge_chunks",
        "newer_minor",
    } <= valid
    exp = json.loads((ROOT / "valid" / "all_dtypes" / "expected.json").read_text())
    assert {t["dtype"] for t in exp["tensors"].values()} == set(vectors.DTYPES)
    grid = json.loads((ROOT / "valid/multi_chunk/checkpoint/tensors/grid/zarr.json").read_text())
    assert grid["codecs"][0]["name"] == "sharding_indexed"
    assert grid["shape"][0] % grid["chunk_grid"]["configuration"]["chunk_shape"][0] != 0
    nested = json.loads((ROOT / "valid" / "nested_tree" / "expected.json").read_text())
    assert len(nested["objects"]["rng"]) == 3
    keys = json.loads((ROOT / "valid" / "key_escaping" / "expected.json").read_text())
    assert {"~7", "7", "~-3/-3", "a%2Fb%20c", "%C3%BCn%C3%AF/%7Ex", "50%25"} <= set(keys["tensors"])


def test_independent_reader_catches_a_flipped_byte_that_it_did_not_write(tmp_path):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(ROOT / "valid" / "all_dtypes" / "checkpoint", ck)
    chunk = ck / "tensors" / "int32" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0x40
    chunk.write_bytes(bytes(data))
    with pytest.raises(vectors.VectorError, match="SP-READ-3"):
        vectors.read_independently(str(ck))


# ---- the dtype table, decoded from raw chunk bytes by its own words --------------------
def _fp8(u, exp_bits, bias, e4m3fn):
    s = np.where(u >> 7, -1.0, 1.0)
    man_bits = 7 - exp_bits
    e = (u >> man_bits) & ((1 << exp_bits) - 1)
    m = (u & ((1 << man_bits) - 1)).astype(np.float64)
    top = (1 << exp_bits) - 1
    val = np.where(
        e == 0,
        m / (1 << man_bits) * 2.0 ** (1 - bias),
        (1 + m / (1 << man_bits)) * 2.0 ** (e.astype(np.float64) - bias),
    )
    if e4m3fn:
        val = np.where((e == top) & (m == 7), np.nan, val)
    else:
        val = np.where(e == top, np.where(m == 0, np.inf, np.nan), val)
    return s * val


def _decode(name, raw):
    """spec/format.md section 5, applied to little-endian bytes."""
    if name == "bool":
        assert set(raw) <= {0, 1}
        return np.frombuffer(raw, np.uint8).astype(np.float64)
    if name == "bfloat16":
        u = np.frombuffer(raw, "<u2").astype(np.uint32) << 16
        return u.astype("<u4").view("<f4").astype(np.float64)
    if name == "float8_e4m3fn":
        return _fp8(np.frombuffer(raw, np.uint8).astype(np.int64), 4, 7, True)
    if name == "float8_e5m2":
        return _fp8(np.frombuffer(raw, np.uint8).astype(np.int64), 5, 15, False)
    code = {
        "float16": "<f2",
        "float32": "<f4",
        "float64": "<f8",
        "complex64": "<c8",
        "complex128": "<c16",
    }.get(name)
    if code:
        return np.frombuffer(raw, code).astype(np.complex128 if "complex" in name else np.float64)
    kind = "u" if name.startswith("uint") else "i"  # two's complement / unsigned
    return np.frombuffer(raw, f"<{kind}{vectors.DTYPES[name]}")


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if np.iscomplexobj(a):
        return _same(a.real, b.real) and _same(a.imag, b.imag)
    if a.dtype.kind == "f":
        nan = np.isnan(a)
        return (
            np.array_equal(nan, np.isnan(b))
            and np.array_equal(a[~nan], b[~nan])
            and np.array_equal(np.signbit(a[~nan]), np.signbit(b[~nan]))
        )
    return np.array_equal(a, b)


@pytest.mark.parametrize("name", sorted(vectors.DTYPES))
def test_dtype_table_decodes_the_stored_bytes(name):
    ck = ROOT / "valid" / "all_dtypes" / "checkpoint"
    chunk = (ck / "tensors" / name / "c" / "0" / "0").read_bytes()
    raw, crc = chunk[:-4], int.from_bytes(chunk[-4:], "little")
    assert vectors.crc32c(raw) == crc, "chunk = little-endian elements + crc32c (LE)"
    assert len(raw) == 15 * vectors.DTYPES[name]
    spec_vals = _decode(name, raw)
    t = sp.load(str(ck))[name].reshape(-1)
    if t.dtype == torch.bool or t.dtype.is_floating_point and t.element_size() < 4:
        t = t.to(torch.float64)  # exact for every value of these types
    ref = t.numpy()
    assert _same(spec_vals, ref.astype(spec_vals.dtype)), f"{name}: spec decoding != torch"
    if name in ("float16", "bfloat16", "float32", "float64", "float8_e5m2", "float8_e4m3fn"):
        assert np.signbit(spec_vals[0]) and spec_vals[0] == 0, "first element is -0.0"
        assert math.isnan(spec_vals[1])


# ---- load semantics on the vectors -----------------------------------------------------
def test_sharded_object_of_count_three_loads_by_index_and_refuses_another_count():
    ck = str(ROOT / "valid" / "nested_tree" / "checkpoint")
    for i in range(3):
        got = sp.load(ck, {"rng": sp.ShardedObject(None, i, 3)})
        assert got["rng"]["seed"] == 42 + i and got["rng"]["pos"] == (i, "epoch")
    with pytest.raises(sp.LayoutMismatchError) as e:
        sp.load(ck, {"rng": sp.ShardedObject(None, 0, 2)})
    assert e.value.spec_id == "SP-OBJ-2" and "3" in str(e.value) and "2" in str(e.value)


def test_subset_and_strict_loads_on_a_vector():
    ck = str(ROOT / "valid" / "nested_tree" / "checkpoint")
    w = torch.empty(4, 3)
    got = sp.load(ck, {"model": {"layers.0.weight": w}})
    assert got["model"]["layers.0.weight"] is w
    assert (
        vectors.hashlib.sha256(w.numpy().tobytes()).hexdigest()
        == json.loads((ROOT / "valid/nested_tree/expected.json").read_text())["tensors"][
            "model/layers.0.weight"
        ]["sha256"]
    )
    with pytest.raises(sp.LayoutMismatchError) as e:
        sp.load(ck, {"model": {"layers.0.weight": torch.empty(3, 4)}})
    assert e.value.spec_id == "SP-LOAD-1"
    with pytest.raises(sp.LayoutMismatchError):
        sp.load(ck, {"nope": torch.empty(1)})
    rep = sp.LoadReport()
    sp.load(ck, {"nope": torch.empty(1)}, strict=False, report=rep)
    assert rep.missing_keys and "nope" in rep.missing_keys[0]


def test_object_grid_vector_is_format_1_1_and_loads_cell_by_cell():
    ck = str(ROOT / "valid" / "object_grid" / "checkpoint")
    assert sp.read_metadata(ck).format_version == (1, 1)
    for s in range(2):
        for t in range(3):
            got = sp.load(ck, {"rng": sp.ShardedObject(None, (s, t), (2, 3))})
            assert got["rng"] == {"stage": s, "tp": t, "seed": 10 * s + t}
    with pytest.raises(sp.LayoutMismatchError) as e:
        sp.load(ck, {"rng": sp.ShardedObject(None, 0, 6)})
    assert e.value.spec_id == "SP-OBJ-2" and "(2, 3)" in str(e.value) and "6" in str(e.value)
    assert sp.load(ck)["rng"][1][2]["seed"] == 12


def test_the_1_0_vectors_stay_1_0_checkpoints():
    for case in ("all_dtypes", "nested_tree", "multi_chunk", "empty_and_scalar", "key_escaping"):
        assert sp.read_metadata(str(ROOT / "valid" / case / "checkpoint")).format_version == (1, 0)


# ---- spec 1.1: what the vectors and the spec text promise ------------------------------
SPEC = ROOT.parent


def test_every_invalid_vector_documents_its_damage_and_is_listed():
    listing = (ROOT / "README.md").read_text()
    for d in sorted((ROOT / "invalid").iterdir()):
        exp = json.loads((d / "expected.json").read_text())
        assert len(exp["damage"]) > 15 and exp["base"] in os.listdir(ROOT / "valid")
        assert f"| `{d.name}` | `{exp['base']}` |" in listing
    for sid in (
        "SP-MAN-5",
        "SP-KEY-2",
        "SP-KEY-3",
        "SP-DTYPE-1",
        "SP-ARRAY-1",
        "SP-ARRAY-3",
        "SP-VALUE-2",
        "SP-MAN-4",
        "SP-OBJ-4",
        "SP-MAN-1",
        "SP-READ-3",
    ):
        assert f"| {sid} |" in listing, sid


def test_valid_vectors_exercise_what_readers_must_accept():
    from shardpoint_conformance.vector_damage import read_body

    b = read_body(str(ROOT / "valid" / "newer_minor" / "checkpoint"))
    assert b["format_version"] == [1, 2] and b["later_field"]["must_understand"] is False
    raw = (ROOT / "valid/newer_minor/checkpoint/manifest.msgpack").read_bytes()
    assert b"\xca" in raw  # float 32 in the body
    z = json.loads((ROOT / "valid/newer_minor/checkpoint/tensors/u8/zarr.json").read_text())
    assert z["codecs"][0] == {"name": "bytes"} and z["vendor.extension"]["must_understand"] is False
    shard = (ROOT / "valid/edge_chunks/checkpoint/tensors/sharded/c/1/1").read_bytes()
    entries = [int.from_bytes(shard[len(shard) - 68 + 8 * i :][:8], "little") for i in range(8)]
    assert entries[2:] == [(1 << 64) - 1] * 6 and entries[1] == 2 * 4 * 4 + 4
    assert len(list((ROOT / "valid/edge_chunks/checkpoint/tensors/plain/c").rglob("*"))) == 12


def test_spec_is_self_contained():
    for p in SPEC.glob("*.md"):
        text = p.read_text()
        for bad in (
            "conformance/",
            "reference/",
            "tests/",
            ".py",
            "shardpoint verify",
            "python -m",
        ):
            assert bad not in text, f"{p.name} points into code: {bad!r}"


def test_crc32c_check_value_in_the_spec():
    assert vectors.crc32c(b"123456789") == 0xE3069283
    assert "0xE3069283" in (SPEC / "format.md").read_text()


BIT_PATTERNS = [  # (dtype, value, bytes as format.md Appendix A spells them)
    ("bool", True, "01"),
    ("int16", -2, "fe ff"),
    ("uint32", 1, "01 00 00 00"),
    ("float16", 1.0, "00 3c"),
    ("float16", -0.0, "00 80"),
    ("bfloat16", 1.0, "80 3f"),
    ("bfloat16", -2.0, "00 c0"),
    ("bfloat16", float("nan"), "c0 7f"),
    ("float32", 1.0, "00 00 80 3f"),
    ("float64", 1.0, "00 00 00 00 00 00 f0 3f"),
    ("complex64", 1 + 2j, "00 00 80 3f 00 00 00 40"),
    ("float8_e4m3fn", 1.0, "38"),
    ("float8_e4m3fn", 448.0, "7e"),
    ("float8_e4m3fn", float("nan"), "7f"),
    ("float8_e4m3fn", -0.0, "80"),
    ("float8_e5m2", 1.0, "3c"),
    ("float8_e5m2", 57344.0, "7b"),
    ("float8_e5m2", float("inf"), "7c"),
]


@pytest.mark.parametrize("dtype, value, hexbytes", BIT_PATTERNS)
def test_appendix_bit_patterns_match_torch(dtype, value, hexbytes):
    from shardpoint.tree import dtypes

    text = (SPEC / "format.md").read_text().split("## Appendix A")[1]
    row = next(line for line in text.splitlines() if line.startswith(f"| {dtype} |"))
    assert f"`{hexbytes}`" in row
    t = torch.tensor([value], dtype=dtypes.from_name(dtype).torch)
    assert t.view(torch.uint8).numpy().tobytes() == bytes.fromhex(hexbytes)


def test_array_faults_surface_only_when_read_manifest_faults_at_open():
    # [SP-ERR-3]: a subset load that does not touch the damaged tensor succeeds ...
    ck = str(ROOT / "invalid" / "missing_chunk" / "checkpoint")
    small = torch.empty(5, 3, dtype=torch.uint16)
    sp.load(ck, {"small": small})
    ref = sp.load(
        str(ROOT / "valid" / "multi_chunk" / "checkpoint"),
        {"small": torch.empty(5, 3, dtype=torch.uint16)},
    )["small"]
    assert torch.equal(small.view(torch.int16), ref.view(torch.int16))
    with pytest.raises(sp.CorruptCheckpointError):
        sp.load(ck, {"grid": torch.empty(37, 11)})
    # ... while a manifest fault fails whatever the load asks for.
    with pytest.raises(sp.UnsupportedFormatError) as e:
        sp.load(str(ROOT / "invalid" / "unknown_dtype" / "checkpoint"), {"iteration": 0})
    assert e.value.spec_id == "SP-DTYPE-1"


# ---- 1.1 clarifications (spec/CHANGELOG.md) ----------------------------------------------
def test_portable_paths_vector_pins_the_array_path_rule():
    from shardpoint_core.format.manifest import array_path_for
    from shardpoint_conformance.vector_damage import read_body

    body = read_body(str(ROOT / "valid" / "portable_paths" / "checkpoint"))
    paths = {k: e["array"] for k, e in body["tensors"].items()}
    assert all(array_path_for(k) == a for k, a in paths.items())
    from shardpoint_conformance.independent_reader import spec_array_path  # spec-only

    assert all(spec_array_path(k) == a for k, a in paths.items())
    assert paths["Encoder"] == "tensors/Encoder~1" and paths["aBC"] == "tensors/aBC~6"
    assert paths["%C3%BCnA"] == "tensors/%C3%BCnA~2"  # letters outside %XX only
    assert paths["CON"] == "tensors/CON~7" and paths["12"] == "tensors/12"
    for k in ("con", "Con.txt", "nul.x", "a."):
        assert paths[k].startswith("tensors/~h/"), k
    fits, over = (next(k for k in paths if k.startswith(f"long/{w}/")) for w in ("fits", "over"))
    assert len(paths[fits]) == 1024 and paths[fits] == "tensors/" + fits
    assert len(over) < 1024 and paths[over].startswith("tensors/~h/")  # tensors/ counts


def test_a_target_leaf_of_another_kind_fails_in_both_modes():
    ck = str(ROOT / "valid" / "nested_tree" / "checkpoint")
    for strict in (True, False):  # [SP-LOAD-3]
        for like in (
            {"rng": 0},
            {"iteration": torch.empty(1)},
            {"np": sp.ShardedObject(None, 0, 1)},
        ):
            with pytest.raises(sp.LayoutMismatchError) as e:
                sp.load(ck, like, strict=strict)
            assert e.value.spec_id == "SP-LOAD-1" and "holds a" in str(e.value)
    rep = sp.LoadReport()
    assert sp.load(ck, {"model": 5}, strict=False, report=rep) == {"model": 5}
    assert rep.missing_keys == ["value 'model'"]  # an inner node: missing


def test_a_region_outside_the_tensor_is_a_caller_error_reported_as_hold_1():
    ck = str(ROOT / "valid" / "multi_chunk" / "checkpoint")  # [SP-LOAD-3]
    rows_4_5 = sp.ShardedTensor(torch.empty(2, 3, dtype=torch.uint16), (5, 3), (4, 0))
    with pytest.raises(ValueError) as e:
        sp.load(ck, {"small": rows_4_5})
    assert e.value.spec_id == "SP-HOLD-1"
