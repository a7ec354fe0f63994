"""Direct chunk reads (backend fast path): bitwise equal to TensorStore's reads for whole,
partial, edge, strided, sharded and 0-d regions, without touching the TensorStore fallback;
damage still falls back and raises the documented error."""

import os

import numpy as np
import pytest
import torch

import shardpoint as sp
from shardpoint_core.format.manifest import decode_manifest
from shardpoint_core.format.spec import ArraySpec
from shardpoint.tree.views import to_numpy
from shardpoint_core.transactions.backend import ZarrBackend

BE = ZarrBackend(shard_above_bytes=4096, inner_chunk_bytes=1024)
FAST = ZarrBackend(direct_reads=False)
SMALL = sp.SaveOptions(plan=sp.PlanOptions(max_chunk_bytes=1500))  # many chunks, ragged edges


def _state():
    g = torch.Generator().manual_seed(3)
    return {
        "a": torch.randn(37, 29, generator=g),  # edge chunks
        "b": torch.randn(64, 48, generator=g).to(torch.bfloat16),  # sharded
        "c": torch.tensor(3.5, dtype=torch.float64),  # 0-d
        "d": torch.randint(0, 255, (5, 7, 9), generator=g, dtype=torch.uint8),
        "e": torch.zeros(0, 4),
    }


def _open(path, key, be):
    m = decode_manifest(open(os.path.join(path, "manifest.msgpack"), "rb").read())
    e = m.tensors[key]
    return be.open_array_for_read(path, e.array, ArraySpec(e.shape, e.dtype, e.chunk_shape), key), e


@pytest.mark.parametrize("key", ["a", "b", "c", "d"])
def test_direct_regions_match_tensorstore(tmp_ckpt, key):
    st = _state()
    full = st[key]
    sp.save(st, tmp_ckpt, backend=BE, options=SMALL if key in ("a", "d") else None)
    h, e = _open(tmp_ckpt, key, BE)
    ref, _ = _open(tmp_ckpt, key, FAST)
    assert type(h).__name__ == "_DirectHandle"
    rng = np.random.default_rng(0)
    regions = [((0,) * full.dim(), tuple(full.shape))]
    for _ in range(12):
        lo = tuple(int(rng.integers(0, n)) for n in full.shape)
        hi = tuple(int(rng.integers(a + 1, n + 1)) for a, n in zip(lo, full.shape))
        regions.append((lo, tuple(b - a for a, b in zip(lo, hi))))
    for off, shape in regions:
        out = torch.full(shape, 7, dtype=full.dtype)
        BE.wait([BE.read_into(h, off, to_numpy(out))])
        want = full[tuple(slice(o, o + s) for o, s in zip(off, shape))]
        assert torch.equal(out.view(torch.uint8) if out.dtype == torch.uint8 else out, want)
        # a strided destination (a column slice of a wider buffer) too
        if shape:
            wide = torch.zeros(shape[:-1] + (shape[-1] + 3,), dtype=full.dtype)
            dst = wide[..., 1 : 1 + shape[-1]]
            BE.wait([BE.read_into(h, off, to_numpy(dst))])
            assert torch.equal(dst, want) and not wide[..., 0].any()
        theirs = torch.empty(shape, dtype=full.dtype)
        FAST.wait([FAST.read_into(ref, off, to_numpy(theirs))])
        assert torch.equal(theirs, out)
    assert h._ts is None, "a fallback to TensorStore happened on an intact checkpoint"


def test_load_uses_direct_reads_and_round_trips(tmp_ckpt):
    st = _state()
    sp.save(st, tmp_ckpt, backend=BE)
    like = {k: torch.empty_like(v) for k, v in st.items()}
    sp.load(tmp_ckpt, like=like, backend=BE)
    assert all(torch.equal(like[k], st[k]) for k in st)
    back = sp.load(tmp_ckpt, backend=BE)
    assert all(torch.equal(back[k], st[k]) for k in st)


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_damage_falls_back_and_raises(tmp_ckpt, how):
    st = _state()
    sp.save(st, tmp_ckpt, backend=BE)
    for key in ("a", "b"):
        cdir = os.path.join(tmp_ckpt, "tensors", key, "c")
        f = os.path.join(cdir, sorted(os.listdir(cdir))[0])
        f = os.path.join(f, sorted(os.listdir(f))[0]) if os.path.isdir(f) else f
        if how == "flip":
            b = bytearray(open(f, "rb").read())
            b[1] ^= 0x10
            open(f, "wb").write(bytes(b))
        elif how == "truncate":
            os.truncate(f, os.path.getsize(f) - 3)
        else:
            os.remove(f)
        like = {key: torch.empty_like(st[key])}
        with pytest.raises(sp.CorruptCheckpointError) as ei:
            sp.load(tmp_ckpt, like=like, backend=BE)
        assert ei.value.spec_id in ("SP-READ-2", "SP-READ-3")


def _load_in_child(path, q):
    like = {"a": torch.empty(37, 29)}
    sp.load(path, like=like, backend=BE)
    q.put(float(like["a"].sum()))


def test_a_forked_child_reads_with_a_pool_of_its_own(tmp_ckpt):
    import multiprocessing as mp

    st = _state()
    sp.save(st, tmp_ckpt, backend=BE)
    sp.load(tmp_ckpt, like={"a": torch.empty(37, 29)}, backend=BE)  # parent's pool exists
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_load_in_child, args=(tmp_ckpt, q))
    p.start()
    p.join(60)
    if p.is_alive():
        p.kill()
        pytest.fail("the forked child hung reading through the inherited pool")
    assert q.get(timeout=5) == pytest.approx(float(st["a"].sum()))
