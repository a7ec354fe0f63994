"""Multi-process conversion (``convert(..., procs=N)``, ``shardpoint convert --procs N``): the
result is the same bytes as one process writes, from sources written by their own libraries
(a 2-rank gloo ``dcp.save`` with sharded DTensors, a Hugging Face directory written by the
``safetensors`` package), bf16 and fp8 included; a failing or silent worker fails the whole
conversion with the key named and leaves nothing at the destination."""

import json
import subprocess
import sys
import time
import os

import msgpack
import pytest
import torch

import shardpoint as sp
from shardpoint.tools.cli import main as cli
from shardpoint.tools.convert import convert, open_source
from shardpoint.tools.convert.base import TensorInfo, key_of
from shardpoint.tools.convert.native import tensor_entry
from shardpoint.tools.convert.parallel import WorkItem, plan_shares, start_workers_early
from shardpoint_testing.launch import run_world
from shardpoint_testing.tensors import random_bits as full, same_bits

SMALL_CHUNKS = 64  # bytes: tensors of a few hundred bytes get many chunk rows to share out


def files_of(root):
    """{relative path: bytes} of every file under ``root``; the manifest decoded, without
    its creation time (the only thing two conversions of one source may differ in). A
    packed checkpoint (the default layout) is compared chunk by chunk: its data objects
    (one or more per writer, named at random) become ``<array>@<chunk>: stored bytes``, and
    its index the arrays' inner chunk shapes and each chunk's crc32c, not where chunks lie."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            rel = os.path.relpath(p, root)
            with open(p, "rb") as f:
                out[rel] = f.read()
    if "manifest.msgpack" in out:
        m = msgpack.unpackb(out["manifest.msgpack"], raw=False, strict_map_key=False)
        body = msgpack.unpackb(m["body"], raw=False, strict_map_key=False)
        body.pop("created_unix")
        packed = body.pop("packed", None)
        if packed is not None:
            index = sp.read_metadata(root).packed
            body["packed arrays"] = packed["arrays"]
            for r in index.records:
                path = index.objects[int(r["object"])][0]
                name = index.arrays[int(r["array"])][0]
                data = out[path][int(r["offset"]) : int(r["offset"]) + int(r["length"])]
                assert len(data) == int(r["length"]) and data[-4:] == int(r["crc32c"]).to_bytes(
                    4, "little"
                )
                out[f"{name}@{int(r['chunk'])}"] = data
            for path, _size in index.objects:
                del out[path]
        out["manifest.msgpack"] = body
    return out


def no_leftovers(parent):
    return [n for n in os.listdir(parent) if ".shardpoint-" in n] == []


def split_keys(src, procs):
    """Keys whose rows the conversion shares among several workers (what the test covers)."""
    with open_source(src, trust_pickle=True) as s:
        steps = {t.path: tensor_entry(t, SMALL_CHUNKS).chunk_shape[0] for t in s.tensors if t.shape}
        shares = plan_shares(s.tensors, procs, steps)
        rows = {t.path: t.shape[0] if t.shape else 0 for t in s.tensors}
    return {
        key_of(i.path) for items in shares for i in items if (i.start, i.stop) != (0, rows[i.path])
    }


# ------------------------------------------------------------------------------- planning
def test_plan_shares_covers_every_row_once_balanced_by_bytes():
    ts = [
        TensorInfo(("big",), (100, 8), torch.float32),  # 3200 B: split by rows
        TensorInfo(("mid",), (10, 8), torch.bfloat16),  # 160 B
        TensorInfo(("s",), (), torch.float8_e4m3fn),  # 0-d: never split
        TensorInfo(("e",), (0, 3), torch.float32),  # empty
        TensorInfo(("one",), (1, 900), torch.float32),
    ]  # 3600 B, one row
    shares = plan_shares(ts, 3, {("big",): 8})
    rows: dict = {}
    for items in shares:
        for it in items:
            assert isinstance(it, WorkItem)
            rows.setdefault(it.path, []).append((it.start, it.stop))
            if it.path == ("big",) and it.stop != 100:
                assert it.start % 8 == 0 and it.stop % 8 == 0  # whole chunk rows
    for t in ts:
        got = sorted(rows[t.path])
        want = t.shape[0] if t.shape else 0
        assert got[0][0] == 0 and got[-1][1] == want
        assert all(a[1] == b[0] for a, b in zip(got, got[1:])), (t.path, got)
    assert len(rows[("big",)]) > 1 and rows[("one",)] == [(0, 1)]
    by = {t.path: t for t in ts}

    def nbytes(it):
        t = by[it.path]
        return (
            t.nbytes
            if not t.shape[:1] or not t.shape[0]
            else (it.stop - it.start) * (t.nbytes // t.shape[0])
        )

    loads = [sum(map(nbytes, items)) for items in shares]
    assert sum(loads) == sum(t.nbytes for t in ts)
    assert max(loads) - min(loads) <= 3600, loads  # within the largest unsplittable piece
    assert plan_shares(ts, 1, {}) == [
        [WorkItem(t.path, 0, t.shape[0] if t.shape else 0) for t in ts]
    ]


# ------------------------------------------------------------------------------- DCP source
def expected():
    return {
        "emb": full("pemb", (40, 8), torch.bfloat16),  # Shard(0)
        "proj": full("pproj", (80, 12), torch.float8_e4m3fn),  # Shard(1)
        "e5": full("pe5", (30, 4), torch.float8_e5m2),  # plain, replicated
        "norm": full("pnorm", (6,), torch.float32),
        "scalar": full("pscalar", (), torch.float64),
    }


def dcp_job(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    exp = expected()

    def shard(t, dim):  # this rank's torch.chunk piece (gloo cannot scatter fp8)
        local = torch.chunk(t, world, dim)[rank].contiguous()
        return DTensor.from_local(
            local, mesh, [Shard(dim)], run_check=False, shape=t.shape, stride=t.stride()
        )

    state = {
        "model": {
            "emb": shard(exp["emb"], 0),
            "proj": shard(exp["proj"], 1),
            "e5": exp["e5"].clone(),
            "norm": exp["norm"].clone(),
        },
        "scalar": exp["scalar"].clone(),
        "step": 31,
        "tag": b"\x01raw",
    }
    dcp.save(state, checkpoint_id=path)
    return rank


def test_dcp_two_ranks_with_three_procs_equals_one_proc(tmp_path, capsys):
    src = str(tmp_path / "dcp")
    start_workers_early()  # the fork server imports torch while the ranks save
    assert run_world(2, dcp_job, src, timeout=120) == [0, 1]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    convert(src, one, max_chunk_bytes=SMALL_CHUNKS, trust_pickle=True)
    rep = convert(src, two, procs=3, max_chunk_bytes=SMALL_CHUNKS, trust_pickle=True)
    assert rep.procs == 3 and rep.skipped == [] and rep.tensors == 5
    assert split_keys(src, 3) == {"model/emb", "model/proj"}  # bf16 and fp8 by rows
    a, b = files_of(one), files_of(two)
    assert sorted(a) == sorted(b) and len(a) > 20
    assert [k for k in a if a[k] != b[k]] == []  # byte for byte, chunk by chunk
    assert sp.read_metadata(two).tensors["model/emb"].chunk_shape[0] < 40  # rows were shared
    exp = expected()
    with sp.open(two) as ck:
        for k in ("emb", "proj", "e5", "norm"):
            assert same_bits(ck[f"model/{k}"].to_torch(), exp[k]), k
        assert same_bits(ck["scalar"].to_torch(), exp["scalar"])
        assert ck["step"] == 31 and ck["tag"] == b"\x01raw"
    assert cli(["diff", one, two]) == 0
    capsys.readouterr()

    # A worker that cannot read its share: the whole conversion fails, naming the key, and
    # nothing appears at the destination (no staging left behind either).
    with open(os.path.join(src, "__1_0.distcp"), "r+b") as f:
        f.truncate(16)
    with pytest.raises(
        sp.ConversionError,
        match=r"conversion worker \d failed converting "
        r"tensor 'model/(emb|proj|e5|norm)'.*dcp.load",
    ):
        convert(
            src, str(tmp_path / "bad"), procs=2, max_chunk_bytes=SMALL_CHUNKS, trust_pickle=True
        )
    assert not os.path.exists(tmp_path / "bad") and no_leftovers(tmp_path)


# ------------------------------------------------------------------------------- safetensors
DTYPES = (
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float32,
    torch.int64,
    torch.bool,
    torch.float16,
)


def test_hf_directory_with_procs_equals_one_proc_both_ways(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    rows = (200, 300, 40, 27, 28, 29, 30)
    tensors = {
        f"model.layers.{i}.w": full(f"hp{i}", (rows[i], 6), dt) for i, dt in enumerate(DTYPES)
    }
    tensors["model.scalar"] = full("hps", (), torch.float32)
    tensors["model.empty"] = torch.empty((0, 3), dtype=torch.bfloat16)
    hf = tmp_path / "hf"
    hf.mkdir()
    names = sorted(tensors)
    wm = {}
    for i, part in enumerate([names[:4], names[4:]]):
        fn = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, hf / fn, metadata={"format": "pt"})
        wm.update({k: fn for k in part})
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))

    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    convert(str(hf), one, max_chunk_bytes=SMALL_CHUNKS)
    assert split_keys(str(hf), 4) == {"model.layers.0.w", "model.layers.1.w"}  # bf16, fp8
    assert (
        cli(
            [
                "convert",
                str(hf),
                two,
                "--procs",
                "4",
                "--max-chunk-size",
                f"{SMALL_CHUNKS}B",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["procs"] == 4
    a, c = files_of(one), files_of(two)
    assert sorted(a) == sorted(c) and [k for k in a if a[k] != c[k]] == []
    assert cli(["diff", one, two]) == 0
    with sp.open(two) as ck:
        assert all(same_bits(ck[k].to_torch(), v) for k, v in tensors.items())

    # Back to a sharded Hugging Face directory with two workers: the same files as with one.
    out1, out2 = tmp_path / "out1", tmp_path / "out2"
    convert(one, str(out1), to="safetensors", max_shard_size="2KB")
    convert(one, str(out2), to="safetensors", max_shard_size="2KB", procs=3)
    f1, f2 = files_of(str(out1)), files_of(str(out2))
    assert len(f1) > 3 and sorted(f1) == sorted(f2) and [k for k in f1 if f1[k] != f2[k]] == []
    index = json.loads(f2["model.safetensors.index.json"])
    for fn in set(index["weight_map"].values()):
        for k, v in load_file(out2 / fn).items():
            assert same_bits(v, tensors[k]), k
    capsys.readouterr()


def test_torch_save_source_with_procs(tmp_path):
    state = {
        "model": {f"w{i}": full(f"tp{i}", (64, 5), dt) for i, dt in enumerate(DTYPES)},
        "step": 9,
    }
    torch.save(state, tmp_path / "ckpt.pt")
    convert(str(tmp_path / "ckpt.pt"), str(tmp_path / "one"), max_chunk_bytes=SMALL_CHUNKS)
    convert(str(tmp_path / "ckpt.pt"), str(tmp_path / "two"), procs=3, max_chunk_bytes=SMALL_CHUNKS)
    a, b = files_of(str(tmp_path / "one")), files_of(str(tmp_path / "two"))
    assert sorted(a) == sorted(b) and [k for k in a if a[k] != b[k]] == []
    got = sp.load(str(tmp_path / "two"))
    assert got["step"] == 9 and all(
        same_bits(got["model"][k], v) for k, v in state["model"].items()
    )


def test_megatron_source_with_procs(tmp_path):
    """Megatron torch_dist: DCP tensors, sharded objects and a tensor in common.pt."""
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "iter_0000010"
    state = {
        "decoder.qkv.weight": full("mq", (48, 4), torch.bfloat16),
        "decoder.fc.weight": full("mf", (40, 4), torch.float8_e4m3fn),
        "rng_state/shard_0_2": [1, 7],
        "rng_state/shard_1_2": [2, 7],
    }
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    torch.save({"iteration": 10, "ema": full("me", (30, 2), torch.float32)}, path / "common.pt")
    convert(str(path), str(tmp_path / "one"), max_chunk_bytes=SMALL_CHUNKS, trust_pickle=True)
    convert(
        str(path), str(tmp_path / "two"), procs=3, max_chunk_bytes=SMALL_CHUNKS, trust_pickle=True
    )
    a, b = files_of(str(tmp_path / "one")), files_of(str(tmp_path / "two"))
    assert sorted(a) == sorted(b) and [k for k in a if a[k] != b[k]] == []
    with sp.open(str(tmp_path / "two")) as ck:
        assert same_bits(ck["decoder.fc.weight"].to_torch(), state["decoder.fc.weight"])
        assert ck["iteration"] == 10 and ck["rng_state"] == [[1, 7], [2, 7]]
        assert ck["ema"].to_torch().shape == (30, 2)


# ------------------------------------------------------------------------------- refusals
def test_refusals(tmp_path, capsys):
    sp.save({"w": full("rw", (16, 4), torch.bfloat16), "v": 1}, str(tmp_path / "c"))
    with pytest.raises(sp.ConversionError, match="DCP output is written by one process"):
        convert(str(tmp_path / "c"), str(tmp_path / "d"), to="dcp", procs=2)
    with pytest.raises(sp.ConversionError, match="whole number >= 1"):
        convert(str(tmp_path / "c"), str(tmp_path / "d"), to="safetensors", procs=0)
    assert (
        cli(["convert", str(tmp_path / "c"), str(tmp_path / "d"), "--to", "dcp", "--procs", "3"])
        == 1
    )
    err = capsys.readouterr().err
    assert "ConversionError" in err and "--procs" in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "d")


def test_a_worker_stuck_on_its_read_is_stopped(tmp_path):
    """A worker blocked in a read (here: its DCP data file is a FIFO nobody writes) reports
    nothing; ``worker_timeout`` seconds after it started on its tensor the conversion stops it
    and fails, naming the key, instead of hanging; nothing appears at the destination."""
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    dcp.save({"w": full("stuck", (8, 4), torch.bfloat16)}, checkpoint_id=str(src), no_dist=True)
    (data,) = [n for n in os.listdir(src) if n.endswith(".distcp")]
    os.remove(src / data)
    os.mkfifo(src / data)
    with pytest.raises(
        sp.ConversionError,
        match=r"worker \d reported nothing for 2s while "
        r"converting tensor 'w'",
    ):
        convert(str(src), str(tmp_path / "out"), procs=2, worker_timeout=2, trust_pickle=True)
    assert not os.path.exists(tmp_path / "out") and no_leftovers(tmp_path)


# ------------------------------------------------------------------------------- memory
@pytest.mark.slow
def test_worker_memory_stays_bounded(tmp_path):
    """Each worker's peak RSS growth while converting a 384 MiB checkpoint (24 tensors of
    16 MiB) stays within the bounds the one-process test holds (a few tensors; DCP's 64 MiB
    read batch), whatever the checkpoint's size."""
    n, mib = 24, 16
    sp.save(
        {f"layer{i}": torch.full((mib << 18,), float(i)) for i in range(n)}, str(tmp_path / "big")
    )
    convert(str(tmp_path / "big"), str(tmp_path / "big_dcp"), to="dcp")
    to_st = convert(str(tmp_path / "big"), str(tmp_path / "st"), to="safetensors", procs=2)
    from_dcp = convert(str(tmp_path / "big_dcp"), str(tmp_path / "sp"), procs=2, trust_pickle=True)
    st_mib = [b >> 20 for b in to_st.worker_peak_bytes]
    dcp_mib = [b >> 20 for b in from_dcp.worker_peak_bytes]
    print(
        f"worker peak RSS growth over a {n * mib} MiB checkpoint: to safetensors {st_mib} "
        f"MiB, DCP to shardpoint {dcp_mib} MiB"
    )
    assert len(st_mib) == 2 and len(dcp_mib) == 2
    assert max(st_mib) < 4 * mib and max(dcp_mib) < 64 + 4 * mib, (st_mib, dcp_mib)
    with sp.open(str(tmp_path / "sp")) as ck:
        assert float(ck["layer23"][5:7].to_torch()[0]) == 23.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_a_worker_dies_with_its_parent(tmp_path):
    """A conversion worker's parent is the fork server, which exits with the coordinator; a
    worker that called die_with_parent() is killed then, instead of writing on alone."""
    pidfile = tmp_path / "child"
    script = f"""
import os, sys, time
sys.path[:0] = {sys.path!r}
from shardpoint.tools.convert.base import die_with_parent
if os.fork() == 0:
    ok = die_with_parent()
    open({str(pidfile)!r} + ".tmp", "w").write(f"{{os.getpid()}} {{int(ok)}}")
    os.rename({str(pidfile)!r} + ".tmp", {str(pidfile)!r})
    time.sleep(120)
    os._exit(0)
time.sleep(120)
"""
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        for _ in range(600):
            if pidfile.exists():
                break
            time.sleep(0.05)
        pid, ok = map(int, pidfile.read_text().split())
        assert ok == 1 and _alive(pid)
    finally:
        parent.kill()
        parent.wait(30)
    for _ in range(200):
        if not _alive(pid):
            break
        time.sleep(0.05)
    assert not _alive(pid), "the worker outlived its parent"


def _alive(pid: int) -> bool:
    """Running (a zombie nobody has reaped yet counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
