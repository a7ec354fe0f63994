"""Memory sized by what storage holds (issue 28): hostile checkpoints whose files declare more
than storage backs (a sparse chunk file, a sparse manifest with trailing garbage), or whose
manifest asks for per-array or per-chunk work out of all proportion to what is stored, end
in a documented error for every reader, within a bounded peak RSS, before allocating.

Each case runs every reader in a child process forked from the launcher's fork server
(torch and shardpoint already imported), under a memory cgroup where one can be made; the
child resets its peak RSS (``/proc/self/clear_refs``) before each reader and reports
``VmHWM`` after it, so each reader's own peak is measured, not the imports'.

The cases that edit a tensor's files (zarr.json, ``c/...``) save with ``ZarrBackend()``;
the packed layout (the default) has its twins: a sparse data object, holes of zeros that
load, and the manifest's per-array and per-chunk claims, refused when it is decoded."""

import json
import os

import numpy as np
import pytest
import torch

import shardpoint as sp
from shardpoint_conformance import hostile
from shardpoint_testing.launch import run_code

MiB = 1 << 20
BUDGET_MIB = 1024  # the bound on a reader's peak for a hostile checkpoint

READERS = r"""
import contextlib, io, os, sys, tempfile, traceback
import torch
import shardpoint as sp
from shardpoint.tools.cli import main as cli
from shardpoint_core.verify import verify_checkpoint
p, other, which = sys.argv[1], sys.argv[2], sys.argv[3].split(",")

def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) // 1024

def run_cli(*args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli(list(args))
    text = out.getvalue()
    ids = sorted({w.strip("[]():,.'") for w in text.split() if w.strip("[]():,.'")
                  .startswith("SP-")})
    raise SystemExit(f"exit {code} {','.join(ids)} {text[-300:]!r}")

def dcp_read():
    import torch.distributed.checkpoint as dcp
    from shardpoint.integrations.dcp import ShardpointReader
    meta = sp.read_metadata(p)
    sd = {k: torch.empty(e.shape, dtype=torch.uint8 if e.dtype == "bool" else
                         getattr(torch, e.dtype)) for k, e in meta.tensors.items()}
    dcp.load(sd, storage_reader=ShardpointReader(p))

def jax_load():
    import shardpoint_jax as spj
    spj.load(p)

def open_read():
    with sp.open(p) as ck:
        for k in ck.tensor_keys():
            ck[k].to_torch()

def verify():
    rep = verify_checkpoint(p)
    raise SystemExit("verify " + ",".join(rep.spec_ids))

readers = {
    "load": lambda: sp.load(p), "open": open_read, "jax": jax_load, "verify": verify,
    "dcp": dcp_read, "diff": lambda: run_cli("diff", p, other),
    "convert": lambda: run_cli("convert", p, os.path.join(tempfile.mkdtemp(), "out"),
                               "--to", "safetensors"),
}
if "jax" in which:
    import shardpoint_jax  # noqa: F401  (imported before the peaks are measured)
import torch.distributed.checkpoint  # noqa: F401
for name in which:
    open("/proc/self/clear_refs", "w").write("5")
    try:
        readers[name]()
        what = "ok"
    except SystemExit as e:
        what = str(e)
    except BaseException as e:  # noqa: BLE001 - reported
        fails = getattr(e, "failures", None)      # DCP's CheckpointException: its rank's error
        if fails:
            e = next(iter(fails.values()))
            e = e[0] if isinstance(e, tuple) else getattr(e, "exc", e)
        sid = getattr(e, "spec_id", None)
        while sid is None and (e.__cause__ is not None or e.__context__ is not None):
            inner = e.__cause__ or e.__context__
            if inner is None or inner is e:
                break
            e = inner
            sid = getattr(e, "spec_id", None)
        what = f"{type(e).__name__} {sid} {str(e)[:300]!r}"
    print(f"{name}|{peak()}|{what}", flush=True)
"""

ALL = ("load", "open", "jax", "verify", "dcp", "diff", "convert")


def run_readers(path: str, other: str, which=ALL, timeout: float = 240) -> dict:
    """``{reader: (peak MiB, outcome)}`` for each reader, in a child process (the JAX reader
    only where JAX is installed: the README's install has no JAX; CI's second step does)."""
    import importlib.util

    which = tuple(w for w in which if w != "jax" or importlib.util.find_spec("jax"))
    code = f"import sys; sys.argv = ['r', {path!r}, {other!r}, {','.join(which)!r}]\n" + READERS
    if hostile.supports_memory_cgroup():  # a regression is killed, not the machine
        r = hostile.run_bounded(code, memory_bytes=3 << 30, timeout=timeout, forked=True)
    else:
        r = run_code(code, timeout=timeout)
    assert r.returncode == 0, f"a reader crashed (rc {r.returncode}): {r.stderr[-3000:]}"
    out = {}
    for line in r.stdout.splitlines():
        if line.count("|") >= 2:
            name, hwm, what = line.split("|", 2)
            out[name] = (int(hwm), what)
    assert set(out) == set(which), (r.stdout, r.stderr[-3000:])
    return out


ZARR = sp.ZarrBackend()  # the per-array layout, for the cases that edit its files


def _base(p: str, backend=None) -> None:
    sp.save({"w": torch.ones(1000), "v": torch.ones(1 << 20)}, p, backend=backend)


def _edit_array(p: str, name: str, **changes) -> None:
    """Change tensor ``name``'s manifest entry and zarr.json alike (``shape``,
    ``chunk_shape``), so only the rule under test can object (packed: the entry only)."""
    body = hostile.read_body(p)
    body["tensors"][name].update(changes)
    hostile.write_body(p, body)
    if "packed" in body:
        return
    zj = f"{p}/tensors/{name}/zarr.json"
    meta = json.load(open(zj))
    if "shape" in changes:
        meta["shape"] = changes["shape"]
    if "chunk_shape" in changes:
        meta["chunk_grid"]["configuration"]["chunk_shape"] = changes["chunk_shape"]
        meta["codecs"] = [
            {"name": "bytes", "configuration": {"endian": "little"}},
            {"name": "crc32c"},
        ]
    with open(zj, "w") as f:
        json.dump(meta, f)


@pytest.fixture
def pair(tmp_path):
    """(a path for the hostile checkpoint, a sound one to diff it with)."""
    good = str(tmp_path / "good")
    _base(good)
    return str(tmp_path / "bad"), good


def _on_disk(p: str) -> int:
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _s, fs in os.walk(p) for f in fs)


def _assert_refused(out: dict, spec_id: str, needle: str = "") -> None:
    for name, (hwm, what) in out.items():
        assert hwm < BUDGET_MIB, (name, hwm, what)
        if name in ("diff", "convert"):
            assert what.startswith("exit ") and not what.startswith("exit 0"), (name, what)
            assert spec_id in what.split()[2], (name, what)
        elif name == "verify":
            assert what.split()[1].split(",") == [spec_id], (name, what)
        else:
            assert what.split()[:2] == ["CorruptCheckpointError", spec_id], (name, what)
            assert needle in what, (name, what)


# --------------------------------------------------------------- a sparse chunk file
def _sparse_chunk(p: str, n: int = 1 << 30) -> None:
    """Tensor ``w`` declares ``n`` float32 elements in one plain chunk whose file is sparse:
    the right size for every size rule, storage holding 4 KiB of it."""
    _base(p, ZARR)
    _edit_array(p, "w", shape=[n], chunk_shape=[n])
    os.truncate(f"{p}/tensors/w/c/0", n * 4 + 4)


def _sparse_record(p: str, n: int = 1 << 30) -> str:
    """The packed twin: ``w`` declares ``n`` float32 elements in one plain chunk whose
    record lies at the end of its data object, the object extended to hold it as a hole:
    every rule of the index holds ([SP-PACK-4], [SP-PACK-5]), storage holds 4 MiB of it.
    Returns the object's path."""
    from shardpoint_core.format.packed import RECORD

    _base(p)
    body = hostile.read_body(p)
    body["tensors"]["w"].update(shape=[n], chunk_shape=[n])
    packed = body["packed"]
    ((path, size),) = packed["objects"]
    rec = np.frombuffer(packed["index"], RECORD).copy()
    w = [i for i, (name, _inner) in enumerate(packed["arrays"]) if name == "tensors/w"][0]
    at = rec["array"] == w
    offset = -(-size // 4096) * 4096
    rec["offset"][at], rec["length"][at] = offset, n * 4 + 4
    packed["objects"] = [[path, offset + n * 4 + 4]]
    packed["index"] = rec.tobytes()
    hostile.write_body(p, body)
    os.truncate(os.path.join(p, path), offset + n * 4 + 4)
    return os.path.join(p, path)


@pytest.mark.parametrize("layout", ["per-array", "packed"])
def test_sparse_chunk_file_is_refused_by_every_reader_before_allocating(pair, layout):
    bad, good = pair
    if layout == "per-array":
        _sparse_chunk(bad)
        assert os.path.getsize(f"{bad}/tensors/w/c/0") == (4 << 30) + 4
    else:
        assert os.path.getsize(_sparse_record(bad)) > 4 << 30
    assert _on_disk(bad) < 8 * MiB
    out = run_readers(bad, bad)
    _assert_refused(out, "SP-READ-3", "sparse")
    if layout == "packed":  # the readers that raise name the object, not a chunk file
        for name in set(out) & {"load", "open", "jax", "dcp"}:
            assert "packed/" in out[name][1] and "'w'" in out[name][1], (name, out[name])


# ----------------------------------------- a sparse 1 GiB manifest with trailing garbage
def test_sparse_manifest_with_trailing_garbage_is_refused_from_its_headers(pair):
    """Before: 4.3 GiB of RSS for load and the DCP reader, 2.1-2.3 GiB for the others (the
    whole file read, then the decoder's copy of the extra bytes)."""
    bad, good = pair
    _base(bad)
    os.truncate(f"{bad}/manifest.msgpack", 1 << 30)
    out = run_readers(bad, good)
    _assert_refused(out, "SP-MAN-1", "trailing bytes")


def test_manifest_bytes_with_trailing_garbage_are_refused_before_decoding():
    """The same rule on bytes from any store (object stores read the manifest whole)."""
    from shardpoint_core.format.manifest import decode_manifest
    import msgpack
    import hashlib

    raw = msgpack.packb({"format": "shardpoint"})
    env = msgpack.packb({"sha256": hashlib.sha256(raw).digest(), "body": raw})
    for data, what in ((env + bytes(1000), "trailing"), (env[:-3], "cut short")):
        with pytest.raises(sp.CorruptCheckpointError) as e:
            decode_manifest(data)
        assert e.value.spec_id == "SP-MAN-1" and what in str(e.value)


@pytest.mark.parametrize("layout", ["per-array", "packed"])
def test_sparse_but_sound_chunk_still_loads(tmp_path, layout):
    """Holes are not damage: zeros a file system keeps as holes (ZFS with compression,
    ``rsync -S``) read back, their checksums checked from the bytes stored (packed: the
    zeros of one chunk inside a data object, [SP-PACK-7])."""
    p = str(tmp_path / "ck")
    z = torch.zeros(1 << 20)  # 4 MiB of zeros, one plain chunk
    sp.save({"z": z, "w": torch.arange(10.0)}, p, backend=ZARR if layout == "per-array" else None)
    if layout == "per-array":
        f, lo, hi = f"{p}/tensors/z/c/0", 0, 4 * (1 << 20) + 4
    else:
        rec = sp.read_metadata(p).tensors["z"].packed.records[0]
        (f,) = [os.path.join(p, o) for o, _s in sp.read_metadata(p).packed.objects]
        lo, hi = int(rec["offset"]), int(rec["offset"]) + int(rec["length"])
    data = open(f, "rb").read()
    os.remove(f)
    with open(f, "wb") as fh:  # the zeros as a hole, the crc32c and the rest stored
        fh.write(data[:lo])
        fh.truncate(len(data))
        fh.seek(hi - 4096)
        fh.write(data[hi - 4096 :])
    assert os.stat(f).st_blocks * 512 < len(data) // 2
    assert torch.equal(sp.load(p)["z"], z) and torch.equal(sp.load(p)["w"], torch.arange(10.0))
    from shardpoint_core.verify import verify_checkpoint

    assert verify_checkpoint(p).ok


def _punch(path: str, lo: int, hi: int) -> None:
    """Rewrite ``path`` with ``[lo, hi)`` (block aligned inward) as a hole."""
    data = open(path, "rb").read()
    lo, hi = -(-lo // 4096) * 4096, hi // 4096 * 4096
    os.remove(path)
    with open(path, "wb") as f:
        f.write(data[:lo])
        f.seek(hi)
        f.write(data[hi:])
        f.truncate(len(data))
    assert os.stat(path).st_blocks * 512 <= len(data) - (hi - lo) + 8192


def test_sparse_shard_holes_are_checked_per_inner_chunk(tmp_path):
    """A shard of 8 inner chunks of zeros: holes inside inner chunks (their crc32c stored)
    read back as the zeros they are; an inner chunk wholly in a hole, its crc32c read as
    0, is refused before anything is allocated, by every local reader path."""
    from shardpoint_core.verify import verify_checkpoint

    p = str(tmp_path / "ck")
    os.makedirs(p)
    inner = (1 << 18) * 4 + 4
    hostile.memory_bomb(p, entries=8, inner_elems=1 << 18, alias=False)
    f = f"{p}/tensors/w/c/0"
    _punch(f, inner + 100, 2 * inner - 4)  # inside inner chunk 1
    _punch(f, 3 * inner, 4 * inner - 4)  # inner chunk 3 but its crc32c
    assert torch.equal(sp.load(p)["w"], torch.zeros(8 << 18))
    assert verify_checkpoint(p).ok
    _punch(f, 0, 2 * inner + 4000)  # inner chunks 0 and 1 whole
    with pytest.raises(sp.CorruptCheckpointError) as e:
        sp.load(p)
    assert e.value.spec_id == "SP-READ-3" and "lies in a hole" in str(e.value)
    assert f in str(e.value) and "'w'" in str(e.value)
    assert verify_checkpoint(p).spec_ids == ["SP-READ-3"]


def test_sparse_shard_with_damage_next_to_a_hole_is_refused(tmp_path):
    """Bytes that are stored but wrong beside a hole: the inner chunk's crc32c over stored
    bytes and zeros does not match."""
    p = str(tmp_path / "ck")
    os.makedirs(p)
    inner = (1 << 18) * 4 + 4
    hostile.memory_bomb(p, entries=8, inner_elems=1 << 18, alias=False)
    f = f"{p}/tensors/w/c/0"
    _punch(f, 2 * inner + 100, 3 * inner - 4)
    with open(f, "r+b") as fh:
        fh.seek(2 * inner + 10)
        fh.write(b"\x01")
    with pytest.raises(sp.CorruptCheckpointError) as e:
        sp.load(p)
    assert e.value.spec_id == "SP-READ-3" and "fails its crc32c" in str(e.value)


def test_crc_over_zeros_matches_the_library():
    import random

    import crc32c

    from shardpoint_core.arrays.sparse import crc32c_zeros

    for n in (0, 1, 3, 4095, 4096, 12345, 1 << 20):
        c = random.getrandbits(32)
        assert crc32c_zeros(c, n) == crc32c.crc32c(bytes(n), c), n


# ------------------------------- per-array and per-chunk work that storage does not back
def _absent_arrays(p: str, count: int, backend=ZARR) -> None:
    """``count`` more tensors in the manifest, none of them stored."""
    _base(p, backend)
    body = hostile.read_body(p)
    for i in range(count):
        k = f"layer{i}.weight"
        body["tensors"][k] = {
            "array": f"tensors/{k}",
            "shape": [1000],
            "dtype": "float32",
            "chunk_shape": [1000],
        }
        body["tree"]["dict"].append([k, {"tensor": k}])
    hostile.write_body(p, body)


def _reached(*_a, **_k):
    raise AssertionError("planned or allocated before the storage checks")


@pytest.fixture
def no_planning(monkeypatch):
    """Planning fails the test if reached: the checks must come first."""
    import shardpoint.api.loading as loading

    monkeypatch.setattr(loading, "plan_load_auto", _reached)


@pytest.fixture
def no_targets(monkeypatch, no_planning):
    """Allocating the targets of a whole load fails the test too."""
    import shardpoint.api.loading as loading

    monkeypatch.setattr(loading, "full_targets", _reached)


@pytest.mark.parametrize("layout,rule", [("per-array", "SP-ARRAY-1"), ("packed", "SP-PACK-2")])
def test_absent_arrays_are_found_before_planning(tmp_path, no_targets, layout, rule):
    """Before: 200k absent arrays cost load 1.9 GiB and 80 s of targets and planning before
    the first open said SP-ARRAY-1. Now before the targets are allocated. Packed: tensor
    entries the index does not list are refused when the manifest is decoded."""
    p = str(tmp_path / "ck")
    _absent_arrays(p, 2000, ZARR if layout == "per-array" else None)
    with pytest.raises(sp.CorruptCheckpointError) as e:
        sp.load(p)
    assert e.value.spec_id == rule and "tensors/layer0.weight" in str(e.value)
    w = torch.zeros(1000)
    with pytest.raises(sp.CorruptCheckpointError) as e:  # through like= as well
        sp.load(p, like={"w": torch.zeros(1000), "layer7.weight": w}, strict=False)
    assert e.value.spec_id == rule and "layer" in str(e.value)
    if layout == "per-array":
        assert "layer7.weight" in str(e.value)


@pytest.mark.parametrize("layout", ["per-array", "packed"])
def test_chunk_shape_1_on_a_large_tensor_is_refused_before_planning(tmp_path, no_planning, layout):
    """Before: 1.8 GiB and tens of seconds of per-chunk plans for 1M chunks, then
    SP-READ-3 for the one 4 MiB chunk file that should be 8 bytes. Packed: the index has
    one record for the 1M chunks, refused by its count when the manifest is decoded."""
    p = str(tmp_path / "ck")
    _base(p, ZARR if layout == "per-array" else None)
    _edit_array(p, "v", chunk_shape=[1])
    with pytest.raises(sp.CorruptCheckpointError) as e:
        sp.load(p)
    if layout == "per-array":
        assert e.value.spec_id == "SP-READ-3" and "tensors/v/c/0" in str(e.value)
    else:
        assert e.value.spec_id == "SP-PACK-4" and "1048577 chunks" in str(e.value)
        assert "manifest.msgpack" in str(e.value)  # and the tensor whose records fall short
        assert "tensor 'v' (array 'tensors/v') has 1 records for its 1048576" in str(e.value)


def test_a_large_grid_missing_its_chunk_files_is_refused_before_planning(tmp_path, no_planning):
    p = str(tmp_path / "ck")
    _base(p, ZARR)
    _edit_array(p, "v", chunk_shape=[1])
    c = f"{p}/tensors/v/c/0"
    os.remove(c)
    with open(c, "wb") as f:  # one sound 8-byte chunk of the 1M the grid has
        import crc32c

        f.write(b"\0\0\x80\x3f" + crc32c.crc32c(b"\0\0\x80\x3f").to_bytes(4, "little"))
    with pytest.raises(sp.CorruptCheckpointError) as e:
        sp.load(p)
    assert e.value.spec_id == "SP-READ-2" and "1 chunk files of the 1048576" in str(e.value)


@pytest.mark.slow  # minutes: 200k entries decoded by each reader
@pytest.mark.parametrize("case", ["absent_200k", "chunk_shape_1"])
def test_per_array_and_per_chunk_cases_stay_within_the_budget(pair, case):
    bad, good = pair
    if case == "absent_200k":
        _absent_arrays(bad, 200_000)  # per-array: packed refuses these when decoding
        assert os.path.getsize(f"{bad}/manifest.msgpack") > 20 * MiB
        sid = "SP-ARRAY-1"
    else:
        _base(bad, ZARR)
        _edit_array(bad, "v", shape=[3 << 20], chunk_shape=[1])
        sid = "SP-READ-3"
    # DCP is left out of the absent-arrays case: its caller allocates every target (the
    # state dict) and DCP plans per tensor before a storage reader is asked for anything.
    which = ("load", "open", "jax", "verify") + (("dcp",) if case == "chunk_shape_1" else ())
    out = run_readers(bad, bad, which=which, timeout=600)
    for name, (hwm, what) in out.items():
        assert hwm < BUDGET_MIB, (name, hwm, what)
        assert sid in what, (name, what)
