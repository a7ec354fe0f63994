"""``shardpoint inspect`` / ``verify`` on real checkpoints, sound and damaged: exit codes, spec
IDs in the output, JSON that parses, one clean error line instead of a traceback."""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

import shardpoint as sp
from shardpoint.tools.cli import main as cli
from shardpoint_core.verify import verify_checkpoint


def make(path):
    """A small checkpoint: a multi-chunk sharded-indexed tensor, a 0-d tensor, values, an
    object, a nested key that needs escaping."""
    backend = __import__("shardpoint_core.transactions.backend", fromlist=["_"]).ZarrBackend(
        shard_above_bytes=128, inner_chunk_bytes=64
    )  # chunks with shard indexes
    small = sp.SaveOptions(plan=sp.PlanOptions(max_chunk_bytes=256))  # several chunks
    state = {
        "model": {
            "w": torch.arange(256, dtype=torch.float32).reshape(16, 16),
            "a b": torch.ones(3, dtype=torch.bfloat16),
        },
        "scale": torch.tensor(2.5, dtype=torch.float64),
        "step": 7,
        "name": "run-1",
        "blob": b"\x00\x01",
        "rng": sp.ShardedObject({"seed": 3, "state": torch.arange(4)}, 0, 1),
    }
    sp.save(state, path, backend=backend, options=small)
    return path


def chunk_files(path, key="model/w"):
    """The chunk files of an array (a 0-d array's single chunk is the file ``c``)."""
    base = f"{path}/tensors/{key}/c"
    return sorted(f for f in [base] + glob.glob(base + "/**", recursive=True) if os.path.isfile(f))


def run(capsys, *argv):
    rc = cli(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_inspect_table_shows_tree_shapes_dtypes_chunks_values(tmp_ckpt, capsys):
    make(tmp_ckpt)
    rc, out, err = run(capsys, "inspect", tmp_ckpt)
    assert rc == 0 and err == ""
    # the version of the bytes (1.3: [1, 3] where the manifest holds chunk tables, SP-VER-1)
    assert "shardpoint format %d.%d" % (1, 3) in out
    lines = out.splitlines()
    w = next(line for line in lines if line.strip().startswith("w "))
    assert "float32" in w and "16x16" in w and "1.0 KiB" in w and "tensors/model/w" in w
    ab = next(line for line in lines if line.strip().startswith("a b "))
    assert "bfloat16" in ab and "tensors/model/a%20b" in ab
    assert any(line.startswith("model/") for line in lines)  # a tree, not a flat list
    assert any("step" in line and "value" in line and " 7 " in line + " " for line in lines)
    assert any("rng" in line and "object" in line and "'seed': 3" in line for line in lines)
    assert "total: 3 tensors" in out and "1 sharded objects" in out


def test_inspect_json_parses_and_matches_the_manifest(tmp_ckpt, capsys):
    make(tmp_ckpt)
    rc, out, _ = run(capsys, "inspect", "--json", tmp_ckpt)
    assert rc == 0
    d = json.loads(out)
    m = sp.read_metadata(tmp_ckpt)
    assert d["format_version"] == list(m.format_version) == [1, 3]  # chunk tables: SP-VER-1
    assert set(d["tensors"]) == set(m.tensors) == {"model/w", "model/a%20b", "scale"}
    w = d["tensors"]["model/w"]
    assert w["shape"] == [16, 16] and w["dtype"] == "float32" and w["bytes"] == 1024
    assert w["array"] == "tensors/model/w"
    assert w["chunk_shape"] == list(m.tensors["model/w"].chunk_shape)
    assert w["chunks"] == len(chunk_files(tmp_ckpt)) >= 4  # one file per chunk
    assert d["total_chunks"] == sum(t["chunks"] for t in d["tensors"].values())
    assert d["tensors"]["scale"]["shape"] == [] and d["tensors"]["scale"]["chunks"] == 1
    assert d["total_bytes"] == 1024 + 6 + 8
    assert d["values"] == {"step": 7, "name": "run-1", "blob": {"$bytes": 2}}
    assert d["objects"]["rng"] == {
        "count": 1,
        "values": [{"seed": 3, "state": {"$array": "int64", "shape": [4]}}],
    }


def test_verify_sound_checkpoint(tmp_ckpt, capsys):
    make(tmp_ckpt)
    rc, out, _ = run(capsys, "verify", "--strict", tmp_ckpt)
    assert rc == 0 and out.startswith("OK:")
    rep = verify_checkpoint(tmp_ckpt, strict=True)
    assert rep.ok and rep.tensors == 3 and rep.objects == 1
    assert rep.chunks == rep.chunks_checked >= 3
    rc, out, _ = run(capsys, "verify", "--json", tmp_ckpt)
    d = json.loads(out)
    assert rc == 0 and d["ok"] and d["problems"] == [] and d["bytes"] == 1038


def test_flipped_byte_in_a_chunk(tmp_ckpt, capsys):
    f = chunk_files(make(tmp_ckpt))[0]
    data = bytearray(open(f, "rb").read())
    data[len(data) // 3] ^= 0x10
    open(f, "wb").write(bytes(data))
    rc, out, err = run(capsys, "verify", tmp_ckpt)
    assert rc == 1 and "FAILED" in out and "[SP-READ-3]" in out and "model/w" in out
    assert "Traceback" not in out + err


def test_every_damaged_chunk_is_reported_not_just_the_first(tmp_ckpt, capsys):
    make(tmp_ckpt)
    files = chunk_files(tmp_ckpt)
    assert len(files) >= 2
    os.remove(files[0])
    os.remove(chunk_files(tmp_ckpt, "model/a%20b")[0])
    f = chunk_files(tmp_ckpt, "scale")[0]
    open(f, "r+b").truncate(3)
    rep = verify_checkpoint(tmp_ckpt)
    by_key = {
        (s, next(k for k in ("model/w", "model/a%20b", "scale") if repr(k) in m)) for s, m in rep
    }
    assert by_key == {
        ("SP-READ-2", "model/w"),
        ("SP-READ-2", "model/a%20b"),
        ("SP-READ-3", "scale"),
    }
    rc, out, _ = run(capsys, "verify", "--json", tmp_ckpt)
    d = json.loads(out)
    assert rc == 1 and d["spec_ids"] == ["SP-READ-2", "SP-READ-3"] and len(d["problems"]) == 3


def test_truncated_manifest(tmp_ckpt, capsys):
    mpath = f"{make(tmp_ckpt)}/manifest.msgpack"
    data = open(mpath, "rb").read()
    open(mpath, "wb").write(data[: len(data) // 2])
    rc, out, err = run(capsys, "verify", tmp_ckpt)
    assert rc == 1 and "[SP-MAN-1]" in out and "Traceback" not in out + err
    rc, out, err = run(capsys, "inspect", tmp_ckpt)
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and "CorruptCheckpointError" in err and "SP-MAN-1" in err


def test_missing_manifest_and_missing_path(tmp_ckpt, capsys):
    os.remove(f"{make(tmp_ckpt)}/manifest.msgpack")
    rc, out, _ = run(capsys, "verify", tmp_ckpt)
    assert rc == 1 and "[SP-COMMIT-3]" in out
    rc, out, err = run(capsys, "inspect", tmp_ckpt)
    assert rc == 1 and err.count("\n") == 1 and "IncompleteCheckpointError" in err
    rc, out, err = run(capsys, "verify", tmp_ckpt + "-nope")
    assert rc == 2 and "[SP-LAYOUT-1]" in out and "does not exist" in out
    rc, out, err = run(capsys, "inspect", tmp_ckpt + "-nope")
    assert rc == 2 and err.count("\n") == 1 and "CheckpointNotFoundError" in err


def test_zarr_json_disagreeing_with_the_manifest(tmp_ckpt, capsys):
    z = f"{make(tmp_ckpt)}/tensors/scale/zarr.json"
    meta = json.load(open(z))
    meta["data_type"] = "float32"
    json.dump(meta, open(z, "w"))
    open(f"{tmp_ckpt}/tensors/model/a%20b/zarr.json", "w").write("{not json")
    rep = verify_checkpoint(tmp_ckpt)
    assert sorted(s for s, _ in rep) == ["SP-ARRAY-1", "SP-ARRAY-2"]
    assert rep.chunks_checked == rep.chunks - 2  # those two arrays were not read
    rc, out, _ = run(capsys, "verify", tmp_ckpt)
    assert rc == 1 and "[SP-ARRAY-1]" in out and "[SP-ARRAY-2]" in out


def test_strict_reports_strays_and_non_canonical_paths(tmp_ckpt, capsys):
    make(tmp_ckpt)
    os.makedirs(f"{tmp_ckpt}/tensors/old/w")
    with open(f"{tmp_ckpt}/tensors/old/w/zarr.json", "w") as f:
        f.write(open(f"{tmp_ckpt}/tensors/scale/zarr.json").read())
    os.makedirs(f"{tmp_ckpt}/tensors/junk")
    open(f"{tmp_ckpt}/tensors/model/notes.txt", "w").write("x")
    assert verify_checkpoint(tmp_ckpt).ok  # readers ignore them
    rep = verify_checkpoint(tmp_ckpt, strict=True)
    msgs = [m for s, m in rep if s == "SP-LAYOUT-3"]
    assert len(msgs) == 3 and len(rep.problems) == 3
    assert any("tensors/old/w" in m for m in msgs) and any("tensors/junk" in m for m in msgs)
    assert any("notes.txt" in m for m in msgs)
    rc, out, _ = run(capsys, "verify", "--strict", tmp_ckpt)
    assert rc == 1 and out.count("[SP-LAYOUT-3]") == 3


def test_strict_reports_an_array_outside_tensors_key(tmp_ckpt):
    import hashlib

    import msgpack

    make(tmp_ckpt)
    os.rename(f"{tmp_ckpt}/tensors/scale", f"{tmp_ckpt}/tensors/elsewhere")
    mpath = f"{tmp_ckpt}/manifest.msgpack"
    env = msgpack.unpackb(open(mpath, "rb").read())
    body = msgpack.unpackb(env["body"], strict_map_key=False)
    body["tensors"]["scale"]["array"] = "tensors/elsewhere"
    raw = msgpack.packb(body, use_bin_type=True)
    open(mpath, "wb").write(msgpack.packb({"sha256": hashlib.sha256(raw).digest(), "body": raw}))
    assert verify_checkpoint(tmp_ckpt).ok  # readers use the recorded path
    assert [s for s, _ in verify_checkpoint(tmp_ckpt, strict=True)] == ["SP-LAYOUT-2"]


def test_usage_errors_and_help(capsys):
    assert cli(["frobnicate"]) == 2
    assert cli(["verify"]) == 2
    assert cli(["--help"]) == 0
    out = capsys.readouterr().out
    assert "inspect" in out and "verify" in out and "conformance" in out


def test_conformance_delegates_or_says_it_is_missing(capsys, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("shardpoint_conformance.cli") is not None:
        assert cli(["conformance", "--help"]) == 0
        assert "usage" in capsys.readouterr().out.lower()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert cli(["conformance", "run"]) == 2
    assert "not installed" in capsys.readouterr().err


def test_console_script_prints_no_traceback(tmp_ckpt):
    """The installed entry point, in a real process: one line on stderr, exit 1."""
    mpath = f"{make(tmp_ckpt)}/manifest.msgpack"
    open(mpath, "wb").write(b"\x92\x01")
    r = subprocess.run(
        [sys.executable, "-m", "shardpoint.tools.cli", "inspect", tmp_ckpt],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "[SP-MAN-1]" in r.stderr, r.stderr


@pytest.mark.parametrize("garbage", [b"", b"\xc1", b"\x80"])
def test_verify_never_raises_on_garbage_manifests(tmp_ckpt, garbage):
    open(f"{make(tmp_ckpt)}/manifest.msgpack", "wb").write(garbage)
    rep = verify_checkpoint(tmp_ckpt, strict=True)
    assert not rep.ok and rep.spec_ids == ["SP-MAN-1"]


def test_verify_reads_zarr_json_even_after_a_failed_load_here(tmp_ckpt):
    """A failed load leaves the default backend's TensorStore metadata cached for this path;
    verify must not trust it (it uses a context of its own)."""
    import shutil

    os.remove(chunk_files(make(tmp_ckpt))[0])
    with pytest.raises(sp.CorruptCheckpointError):
        sp.load(tmp_ckpt)
    shutil.rmtree(tmp_ckpt)
    os.remove(f"{make(tmp_ckpt)}/tensors/model/w/zarr.json")
    assert [s for s, _ in verify_checkpoint(tmp_ckpt)] == ["SP-ARRAY-1"]


def _crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_absent_inner_chunk_behind_a_valid_shard_index(tmp_ckpt, capsys):
    """A shard whose index marks an inner chunk absent (checksum of the index still right) is
    damage [SP-READ-2], never fill values."""
    import struct

    f = chunk_files(make(tmp_ckpt))[0]
    meta = json.load(open(f"{tmp_ckpt}/tensors/model/w/zarr.json"))
    conf = meta["codecs"][0]["configuration"]
    assert meta["codecs"][0]["name"] == "sharding_indexed"
    k = 1
    for c, i in zip(meta["chunk_grid"]["configuration"]["chunk_shape"], conf["chunk_shape"]):
        k *= c // i
    d = bytearray(open(f, "rb").read())
    idx = d[-(16 * k + 4) : -4]
    assert _crc32c(bytes(idx)) == struct.unpack("<I", d[-4:])[0]
    idx[:16] = b"\xff" * 16
    d[-(16 * k + 4) :] = bytes(idx) + struct.pack("<I", _crc32c(bytes(idx)))
    open(f, "wb").write(bytes(d))
    rc, out, _ = run(capsys, "verify", tmp_ckpt)
    assert rc == 1 and "[SP-READ-2]" in out and "model/w" in out


def test_python_dash_m_shardpoint_is_the_console_script(tmp_ckpt, capsys):
    """``python -m shardpoint`` in a real process prints exactly what the CLI prints."""
    make(tmp_ckpt)
    r = subprocess.run(
        [sys.executable, "-m", "shardpoint", "inspect", tmp_ckpt, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    rc, out, _ = run(capsys, "inspect", tmp_ckpt, "--json")
    assert r.returncode == rc == 0, r.stderr
    assert r.stdout == out and "model/w" in json.loads(out)["tensors"]


# ---------------------------------------------------------------- issue 21: careless users
@pytest.mark.parametrize("kind", ["empty", "manager-root", "parent", "etc"])
def test_a_directory_that_is_not_a_checkpoint_says_so_exit_2(tmp_path, capsys, kind):
    path = str(tmp_path / "d")
    os.makedirs(path)
    if kind == "manager-root":
        with sp.CheckpointManager(path) as m:
            for step in (1, 2, 3):
                m.save(step, {"w": torch.ones(2)})
    elif kind == "parent":
        for name in ("run_a", "run_b"):
            sp.save({"w": torch.ones(2)}, os.path.join(path, name))
        os.utime(os.path.join(path, "run_a", "manifest.msgpack"), (1, 1))
    elif kind == "etc":
        path = "/etc"
    for cmd in ("inspect", "verify"):
        rc, out, err = run(capsys, cmd, path)
        assert rc == 2, (cmd, out, err)
        text = out + err
        assert "SP-COMMIT-3" not in text and "never committed" not in text
        if kind == "manager-root":
            assert "directory of 3 checkpoint(s)" in text and "step_00000003" in text
            assert text.index("step_00000003") < text.index("step_00000001")
        elif kind == "parent":
            assert "directory of 2 checkpoint(s)" in text
            assert text.index("run_b") < text.index("run_a")
        else:
            assert "no checkpoint at" in text
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.load(path)


def test_an_uncommitted_save_is_still_reported_as_one(tmp_ckpt, capsys):
    os.remove(f"{make(tmp_ckpt)}/manifest.msgpack")
    rc, out, _ = run(capsys, "verify", tmp_ckpt)
    assert rc == 1 and "[SP-COMMIT-3]" in out


def test_recover_a_typo_fails(tmp_path, capsys):
    rc, out, err = run(capsys, "recover", str(tmp_path / "chekpoints"))
    assert rc == 2 and "does not exist" in err and "nothing to recover" not in out


def test_inspect_values_of_a_missing_key_and_convert_procs_0_exit_2(tmp_ckpt, capsys):
    make(tmp_ckpt)
    rc, _, err = run(capsys, "inspect", tmp_ckpt, "--values", "model/nope")
    assert rc == 2 and "'model/nope' is not a key" in err
    rc, _, err = run(
        capsys, "convert", tmp_ckpt, tmp_ckpt + "-out", "--to", "safetensors", "--procs", "0"
    )
    assert rc == 2 and "--procs" in err and not os.path.exists(tmp_ckpt + "-out")


def test_inspect_never_cuts_key_names(tmp_ckpt):
    state = {
        "optimizer": {
            "state": {
                f"model.layers.{i}.mlp.up_proj.weight.{n}": torch.ones(2)
                for i in (1, 11)
                for n in ("exp_avg", "exp_avg_sq")
            }
        }
    }
    sp.save(state, tmp_ckpt)
    for cols in ("80", "40"):
        r = subprocess.run(
            [sys.executable, "-m", "shardpoint", "inspect", tmp_ckpt],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "COLUMNS": cols},
        )
        assert r.returncode == 0, r.stderr
        for i in (1, 11):
            for n in ("exp_avg", "exp_avg_sq"):
                assert f"model.layers.{i}.mlp.up_proj.weight.{n}" in r.stdout, r.stdout


def test_version(capsys):
    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and out.startswith("shardpoint ") and "format 1.1" in out


def test_diff_never_unpickles_dcp_metadata_without_trust(tmp_path, capsys):
    """DCP's .metadata is a pickle: one that writes a marker file when loaded must not run."""
    import pickle

    dcp = tmp_path / "dcp"
    dcp.mkdir()
    marker = tmp_path / "pwned"

    class Boom:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (dcp / ".metadata").write_bytes(pickle.dumps(Boom()))
    other = str(tmp_path / "sp")
    sp.save({"w": torch.ones(2)}, other)
    rc, _, err = run(capsys, "diff", str(dcp), other)
    assert rc == 2 and "--trust-pickle" in err and not marker.exists()
    rc, _, err = run(capsys, "diff", other, str(dcp))
    assert rc == 2 and not marker.exists()
    rc, _, err = run(capsys, "diff", str(dcp), other, "--trust-pickle")  # the opt-in reads it
    assert marker.exists() and rc == 2 and "not DCP's Metadata" in err
