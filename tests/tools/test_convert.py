"""Conversion round trips against the real peer libraries: each source is written by its own
library (a 2-rank gloo ``dcp.save`` with sharded DTensors, ``torch.save``, the ``safetensors``
package) and each result is read back by that library, bit for bit, bf16 and fp8 included."""

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

import shardpoint as sp
from shardpoint.tools.cli import main as cli
from shardpoint.tools.convert import convert, detect_format
from shardpoint_testing.launch import run_world
from shardpoint_testing.tensors import random_bits, same_bits


@pytest.fixture
def torch_default_safe_globals():
    """torch.load(weights_only=True) with torch's own allowlist, as in a fresh `shardpoint
    convert` process: `import megatron.core` (done in-process by other tests of this worker)
    adds argparse.Namespace and a dozen more classes to that process-wide list."""
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    yield
    torch.serialization.add_safe_globals(saved)


DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int64,
    torch.bool,
    torch.float16,
)


full = random_bits  # deterministic contents of any dtype (NaN payloads and all)


# ------------------------------------------------------------------------------- DCP, 2 ranks
def expected_dcp():
    return {
        "model": {
            "emb": full("emb", (9, 6), torch.bfloat16),  # Shard(0), uneven
            "proj": full("proj", (4, 10), torch.float8_e4m3fn),  # Shard(1)
            "norm": full("norm", (6,), torch.float32),  # plain, replicated
            "e5": full("e5", (3, 2), torch.float8_e5m2),
        },
        "scalar": full("scalar", (), torch.float64),
    }


def dcp_save_job(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    exp = expected_dcp()
    m = exp["model"]

    def shard(t, dim):  # this rank's torch.chunk piece (gloo cannot scatter fp8)
        local = torch.chunk(t, world, dim)[rank].contiguous()
        return DTensor.from_local(
            local, mesh, [Shard(dim)], run_check=False, shape=t.shape, stride=t.stride()
        )

    state = {
        "model": {
            "emb": shard(m["emb"], 0),
            "proj": shard(m["proj"], 1),
            "norm": m["norm"].clone(),
            "e5": m["e5"].clone(),
        },
        "scalar": exp["scalar"].clone(),
        "step": 1200,
        "sched": {"lr": 3e-4, "warmup": [1, 2]},
        "tag": b"\x00raw",
        "args": argparse.Namespace(lr=1.0),
    }  # needs full pickle: reported
    dcp.save(state, checkpoint_id=path)
    return rank


def test_dcp_two_ranks_to_shardpoint_and_back(tmp_path, capsys, torch_default_safe_globals):
    src, mid, back = str(tmp_path / "dcp"), str(tmp_path / "sp"), str(tmp_path / "dcp2")
    assert run_world(2, dcp_save_job, src, timeout=120) == [0, 1]
    assert detect_format(src) == "dcp"
    assert cli(["convert", src, mid, "--json", "--trust-pickle"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["src_format"] == "dcp" and rep["dst_format"] == "shardpoint"
    assert [s["key"] for s in rep["skipped"]] == ["args"]
    assert "weights_only" in rep["skipped"][0]["reason"]
    assert "Namespace" in rep["skipped"][0]["reason"]
    got = sp.load(mid)
    exp = expected_dcp()
    for k, v in exp["model"].items():
        assert same_bits(got["model"][k], v), k
    assert same_bits(got["scalar"], exp["scalar"])
    assert got["step"] == 1200 and got["sched"] == {"lr": 3e-4, "warmup": [1, 2]}
    assert got["tag"] == b"\x00raw" and "args" not in got
    assert sp.read_metadata(mid).tensors["model/emb"].dtype == "bfloat16"

    assert cli(["convert", mid, back, "--to", "dcp"]) == 0
    assert "converted" in capsys.readouterr().out
    import torch.distributed.checkpoint as dcp

    like = {
        "model": {k: torch.zeros_like(v) for k, v in exp["model"].items()},
        "scalar": torch.zeros((), dtype=torch.float64),
        "step": 0,
        "sched": {"lr": 0.0, "warmup": []},
        "tag": b"",
    }
    dcp.load(like, checkpoint_id=back, no_dist=True)
    for k, v in exp["model"].items():
        assert same_bits(like["model"][k], v), k
    assert same_bits(like["scalar"], exp["scalar"])
    assert like["step"] == 1200 and like["sched"]["warmup"] == [1, 2] and like["tag"] == b"\x00raw"


# ------------------------------------------------------------------------------- torch.save
def test_torch_save_to_shardpoint(tmp_path):
    state = {
        "model": {f"w{i}": full(f"w{i}", (5, 3), dt) for i, dt in enumerate(DTYPES)},
        "layers": [full("l0", (2,)), full("l1", (3,), torch.bfloat16)],
        "step": 7,
        "name": "run",
        "betas": (0.9, 0.95),
    }
    torch.save(state, tmp_path / "ckpt.pt")
    assert detect_format(str(tmp_path / "ckpt.pt")) == "torch"
    rep = convert(str(tmp_path / "ckpt.pt"), str(tmp_path / "sp"))
    assert rep.tensors == len(DTYPES) + 2 and rep.skipped == []
    got = sp.load(str(tmp_path / "sp"))
    for k, v in state["model"].items():
        assert same_bits(got["model"][k], v), k
    assert same_bits(got["layers"][1], state["layers"][1])
    assert got["step"] == 7 and got["name"] == "run" and got["betas"] == (0.9, 0.95)


def test_torch_save_needing_pickle_is_refused(tmp_path, capsys, torch_default_safe_globals):
    torch.save({"w": torch.ones(2), "args": argparse.Namespace(lr=1)}, tmp_path / "bad.pt")
    with pytest.raises(sp.ConversionError, match="weights_only=True.*Namespace"):
        convert(str(tmp_path / "bad.pt"), str(tmp_path / "sp"))
    assert cli(["convert", str(tmp_path / "bad.pt"), str(tmp_path / "sp")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ConversionError" in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "sp")


# ------------------------------------------------------------------------------- safetensors
def test_safetensors_file_and_hf_directory(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    tensors = {f"model.layers.{i}.w": full(f"st{i}", (8, 4), dt) for i, dt in enumerate(DTYPES)}
    tensors["model.scalar"] = full("sc", (), torch.float32)
    save_file(tensors, tmp_path / "one.safetensors", metadata={"format": "pt"})
    convert(str(tmp_path / "one.safetensors"), str(tmp_path / "sp1"))
    assert set(sp.open(str(tmp_path / "sp1")).keys()) == set(tensors)  # names kept
    convert(str(tmp_path / "sp1"), str(tmp_path / "back.safetensors"))
    back = load_file(tmp_path / "back.safetensors")
    assert set(back) == set(tensors) and all(same_bits(back[k], v) for k, v in tensors.items())
    with safe_open(tmp_path / "back.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}

    # A Hugging Face directory: shards written by the package, the index as HF writes it.
    hf = tmp_path / "hf"
    hf.mkdir()
    names = sorted(tensors)
    parts = [names[:3], names[3:6], names[6:]]
    wm = {}
    for i, part in enumerate(parts):
        fn = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        save_file({k: tensors[k] for k in part}, hf / fn, metadata={"format": "pt"})
        wm.update({k: fn for k in part})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    (hf / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": wm}, indent=2)
    )
    assert detect_format(str(hf)) == "safetensors"
    convert(str(hf), str(tmp_path / "sp2"))
    out = tmp_path / "out"
    assert (
        cli(
            [
                "convert",
                str(tmp_path / "sp2"),
                str(out),
                "--to",
                "safetensors",
                "--max-shard-size",
                "100B",
            ]
        )
        == 0
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == total and set(index["weight_map"]) == set(tensors)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(os.listdir(out)) == sorted(files + ["model.safetensors.index.json"])
    for fn in files:
        shard = load_file(out / fn)
        assert all(
            index["weight_map"][k] == fn and same_bits(v, tensors[k]) for k, v in shard.items()
        )
        assert sum(v.numel() * v.element_size() for v in shard.values()) <= 100 or len(shard) == 1
        with safe_open(out / fn, "pt") as f:
            assert f.metadata() == {"format": "pt"}


def test_transformers_sharded_loader_reads_the_output(tmp_path):
    """Only where transformers is already installed (it is not a test dependency)."""
    tmu = pytest.importorskip("transformers.modeling_utils")

    def model():
        m = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 8))
        return m.to(torch.bfloat16)

    src = model()
    sp.save(src.state_dict(), str(tmp_path / "sp"))
    convert(str(tmp_path / "sp"), str(tmp_path / "hf"), to="safetensors", max_shard_size="1KB")
    dst = model()
    tmu.load_sharded_checkpoint(dst, str(tmp_path / "hf"), strict=True)
    for k, v in src.state_dict().items():
        assert same_bits(dst.state_dict()[k], v), k


# ------------------------------------------------------------------------------- Megatron
def test_megatron_torch_dist(tmp_path, torch_default_safe_globals):
    import io

    import torch.distributed.checkpoint as dcp

    path = tmp_path / "iter_0000100"
    w = full("qkv", (12, 4), torch.bfloat16)
    state = {
        "decoder.layers.self_attention.linear_qkv.weight": w,
        "embedding.word_embeddings.weight": full("emb", (10, 4)),
        "rng_state/shard_0_2": [1, 7],
        "rng_state/shard_1_2": [2, 7],
    }
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    (path / "metadata.json").write_text(
        json.dumps(
            {
                "sharded_backend": "torch_dist",
                "sharded_backend_version": 1,
                "common_backend": "torch",
            }
        )
    )
    torch.save({"iteration": 100, "checkpoint_version": 3.0}, path / "common.pt")
    assert detect_format(str(path)) == "megatron"
    rep = convert(str(path), str(tmp_path / "sp"), trust_pickle=True)
    assert rep.src_format == "megatron" and rep.skipped == []
    with sp.open(str(tmp_path / "sp")) as ck:
        assert same_bits(ck["decoder.layers.self_attention.linear_qkv.weight"].to_torch(), w)
        assert ck["iteration"] == 100 and ck["rng_state"] == [[1, 7], [2, 7]]
    buf = io.BytesIO()
    torch.save({"iteration": 100, "args": argparse.Namespace(tp=2)}, buf)
    (path / "common.pt").write_bytes(buf.getvalue())
    with pytest.raises(sp.ConversionError, match="common.pt.*Namespace.*--skip-common"):
        convert(str(path), str(tmp_path / "sp2"), trust_pickle=True)
    rep = convert(str(path), str(tmp_path / "sp2"), skip_common=True, trust_pickle=True)
    assert [k for k, _ in rep.skipped] == ["common.pt"]


def test_errors_name_the_key_and_reason(tmp_path):
    sp.save({"z": torch.ones(2, dtype=torch.complex128), "v": 1}, str(tmp_path / "c"))
    with pytest.raises(sp.ConversionError, match="'z'.*complex128.*safetensors"):
        convert(str(tmp_path / "c"), str(tmp_path / "o.safetensors"))
    assert not os.path.exists(tmp_path / "o.safetensors")
    with pytest.raises(sp.ConversionError, match="pass --to"):
        convert(str(tmp_path / "c"), str(tmp_path / "d"))
    (tmp_path / "junk").write_bytes(b"hello")
    with pytest.raises(sp.ConversionError, match="cannot tell the format"):
        convert(str(tmp_path / "junk"), str(tmp_path / "d"))
    sp.save({"w": torch.ones(2)}, str(tmp_path / "e"))
    with pytest.raises(sp.CheckpointExistsError):
        convert(str(tmp_path / "c"), str(tmp_path / "e"), to="dcp")


@pytest.mark.parametrize("to", ["shardpoint", "safetensors", "dcp"])
def test_overwrite_takes_one_type_before_anything_is_read(tmp_path, to):
    """``overwrite`` is False, True or "any" on every target (shardpoint_core's one type), a
    value read as a truth value refused before the source is even opened."""
    with pytest.raises(sp.InvalidOptionError, match="overwrite='yes'"):
        convert(str(tmp_path / "missing"), str(tmp_path / "out"), to=to, overwrite="yes")
    assert os.listdir(tmp_path) == []


def test_a_converted_checkpoint_has_chunk_tables(tmp_path):
    """A converted checkpoint records every chunk's crc32c ([SP-MAN-7], a 1.3 manifest) as
    ``sp.save`` does, so a load catches two chunks of one size swapped ([SP-READ-8])."""
    w = random_bits("w", (64, 4), torch.float32)
    torch.save({"w": w}, str(tmp_path / "t.pt"))
    ck = str(tmp_path / "c")
    convert(str(tmp_path / "t.pt"), ck, max_chunk_bytes=256)  # 4 chunks of 16 rows
    m = sp.read_metadata(ck)
    # the default layout, packed (1.4), with its chunk tables
    assert tuple(m.format_version) == (1, 4) and len(m.tensors["w"].chunk_crc32c) == 4 * 4
    assert same_bits(sp.load(ck)["w"], w)
    # chunks 0 and 1 swapped in the data object, and their records' crc32c along: only the
    # chunk table can tell
    import numpy as np

    from shardpoint_conformance import hostile
    from shardpoint_core.format.packed import RECORD

    (obj, o0, n, _c0), (_, o1, _n1, _c1) = (m.tensors["w"].packed.chunk(i) for i in (0, 1))
    with open(os.path.join(ck, obj), "r+b") as f:
        f.seek(o0)
        b0 = f.read(n)
        f.seek(o1)
        b1 = f.read(n)
        f.seek(o0)
        f.write(b1)
        f.seek(o1)
        f.write(b0)
    body = hostile.read_body(ck)
    rec = np.frombuffer(body["packed"]["index"], RECORD).copy()
    rec["crc32c"][[0, 1]] = rec["crc32c"][[1, 0]]  # one array: records 0, 1 are its chunks
    body["packed"]["index"] = rec.tobytes()
    hostile.write_body(ck, body)
    with pytest.raises(sp.CorruptCheckpointError) as e:
        sp.load(ck)
    assert e.value.spec_id == "SP-READ-8" and "chunk table" in str(e.value)


@pytest.mark.parametrize(
    "to,tables", [("shardpoint", True), ("safetensors", True), ("dcp", True), ("shardpoint", False)]
)
def test_a_source_replaced_while_it_is_converted_is_refused(tmp_path, to, tables):
    """Another save replaces the shardpoint source after its first tensor was read: the
    conversion fails with LoadFailedError [SP-COMMIT-14] (the reader's identity check), and
    nothing mixing the two checkpoints appears at the destination. With chunk tables
    ([SP-MAN-7], as sp.save writes) the next read fails them and the replacement is named;
    without (a converted checkpoint) the reads succeed and the check before the commit
    tells."""
    src = str(tmp_path / "src")
    dst = str(tmp_path / ("out.safetensors" if to == "safetensors" else "out"))
    first = {"a": torch.zeros(4), "b": torch.zeros(4)}
    if tables:
        sp.save(first, src)
    else:
        torch.save(first, str(tmp_path / "first.pt"))
        convert(str(tmp_path / "first.pt"), src)
        os.remove(tmp_path / "first.pt")
    replaced = []

    def progress(_n):
        if not replaced:
            replaced.append(sp.save({"a": torch.ones(4), "b": torch.ones(4)}, src, overwrite=True))

    with pytest.raises(sp.LoadFailedError, match="replaced") as e:
        convert(src, dst, to=to, progress=progress)
    assert e.value.spec_id == "SP-COMMIT-14" and replaced
    assert sorted(os.listdir(tmp_path)) == ["src"]  # no output, no staging left
    convert(src, dst, to=to)  # unchanged now: converts
    assert os.path.exists(dst)


# ------------------------------------------------------------------------------- memory
MEM_SCRIPT = r"""
import sys
from shardpoint.tools.convert import convert
from shardpoint.tools.convert.base import limit_heap_growth
assert limit_heap_growth()                               # what the CLI does
src, out = sys.argv[1], sys.argv[2]
convert(src + "/tiny", out + "/warm.safetensors")        # imports and pools warmed up
convert(src + "/tiny", out + "/warm_dcp", to="dcp")
def status(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])
def growth(fn):
    with open("/proc/self/clear_refs", "w") as f:     # resets VmHWM (peak RSS) to now
        f.write("5")
    base = status("VmRSS")
    fn()
    return (status("VmHWM") - base) // 1024          # MiB
a = growth(lambda: convert(src + "/big", out + "/big.safetensors"))
b = growth(lambda: convert(src + "/big", out + "/big_dcp", to="dcp"))
c = growth(lambda: convert(out + "/big_dcp", out + "/big_sp", trust_pickle=True))
print(a, b, c)
"""


@pytest.mark.slow
def test_conversion_memory_stays_bounded(tmp_path):
    """A 384 MiB checkpoint of 24 tensors of 16 MiB converts to safetensors, to DCP and back
    while the process's peak RSS grows by well under half the checkpoint: a tensor (or a
    block of rows) at a time, DCP's 64 MiB read batch, and TensorStore's buffers."""
    n, mib = 24, 16
    big = {f"layer{i}": torch.full((mib << 18,), float(i)) for i in range(n)}
    sp.save(big, str(tmp_path / "big"))
    sp.save({"t": torch.ones(4)}, str(tmp_path / "tiny"))
    del big
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-c", MEM_SCRIPT, str(tmp_path), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    to_st, to_dcp, from_dcp = map(int, r.stdout.split())
    print(
        f"peak RSS growth over a {n * mib} MiB checkpoint: to safetensors {to_st} MiB, "
        f"to DCP {to_dcp} MiB, DCP to shardpoint {from_dcp} MiB"
    )
    # Each bound is independent of n: a few tensors, DCP's 64 MiB batch, TensorStore buffers.
    assert to_st < 4 * mib and to_dcp < 4 * mib and from_dcp < 64 + 4 * mib, (
        to_st,
        to_dcp,
        from_dcp,
    )
    back = sp.open(str(tmp_path / "big_sp"))
    assert float(back["layer23"][5:7].to_torch()[0]) == 23.0
