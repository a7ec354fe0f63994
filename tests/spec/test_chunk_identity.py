"""Chunk identity (format 1.3, [SP-MAN-7], [SP-READ-8]): a save records every stored unit's
crc32c per tensor, and chunks swapped between tensors or positions, which every crc32c
still passes, are refused by ``sp.load``, ``verify`` and the independent reader. In both
layouts: chunk files of the per-array one, chunk bytes inside the data objects of the packed
one (the default, format 1.4), where the records' crc32c are swapped along, so only the
chunk table can tell."""

import os
import shutil

import numpy as np
import pytest
import torch

import shardpoint as sp
from shardpoint_conformance import hostile, vectors
from shardpoint_core.format.packed import RECORD
from shardpoint_conformance.vector_damage import _reseal_index
from shardpoint_core.format import errors
from shardpoint_core.verify import verify_checkpoint
from shardpoint_core.transactions.backend import ZarrBackend


def _save(path, backend=None):
    """Two tensors of one dtype and chunk shape in plain chunks, two in shards of 4 inner
    chunks (4 chunks each)."""
    a = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    state = {"a": a, "b": a + 100, "s": a + 200, "t": a + 300}
    opts = sp.SaveOptions(plan=sp.PlanOptions(max_chunk_bytes=64, chunk_overhead_bytes=0))
    sp.save(state, path, options=opts, backend=backend)
    return state


LAYOUTS = {"per-array": ZarrBackend(), "packed": None}  # None: the default, packed


def _number(e, cidx):
    """The row-major number of chunk ``cidx`` of the 8x8 tensor entry ``e``."""
    return cidx[0] * (8 // e.chunk_shape[1]) + cidx[1]


def _where(ck, m, key, cidx):
    """(file, offset, length) of the stored bytes of chunk ``cidx`` of tensor ``key``."""
    e = m.tensors[key]
    if m.packed is None:
        f = os.path.join(ck, e.array, "c", *map(str, cidx))
        return f, 0, os.path.getsize(f)
    obj, off, n, _crc = e.packed.chunk(_number(e, cidx))
    return os.path.join(ck, obj), off, n


def _stored(ck, m, key, cidx):
    f, off, n = _where(ck, m, key, cidx)
    with open(f, "rb") as fh:
        fh.seek(off)
        return fh.read(n)


def _swap_chunks(ck, one, other):
    """Swap the stored bytes of chunks ``one`` and ``other`` (each ``(key, cidx)``): their
    files (per-array), or their bytes in the data objects and the crc32c of their records
    (packed), so that every check but the chunk table passes."""
    m = sp.read_metadata(ck)
    if m.packed is None:
        _swap(_where(ck, m, *one)[0], _where(ck, m, *other)[0])
        return
    (fa, oa, na), (fb, ob, nb) = _where(ck, m, *one), _where(ck, m, *other)
    assert na == nb, "swap chunks of one size"
    da, db = _stored(ck, m, *one), _stored(ck, m, *other)
    for f, off, data in ((fa, oa, db), (fb, ob, da)):
        with open(f, "r+b") as fh:
            fh.seek(off)
            fh.write(data)
    body = hostile.read_body(ck)
    rec = np.frombuffer(body["packed"]["index"], RECORD).copy()
    names = [name for name, _inner in body["packed"]["arrays"]]

    def row(key, cidx):
        e = m.tensors[key]
        at = (rec["array"] == names.index(e.array)) & (rec["chunk"] == _number(e, cidx))
        (i,) = np.nonzero(at)[0]
        return i

    i, j = row(*one), row(*other)
    rec["crc32c"][[i, j]] = rec["crc32c"][[j, i]]
    body["packed"]["index"] = rec.tobytes()
    hostile.write_body(ck, body)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_save_records_every_units_stored_crc32c(tmp_path, layout):
    ck = str(tmp_path / "ck")
    _save(ck, LAYOUTS[layout])
    m = sp.read_metadata(ck)
    assert tuple(m.format_version) == ((1, 3) if layout == "per-array" else (1, 4))  # [SP-VER-1]
    for key, e in m.tensors.items():
        n_chunks = (8 // e.chunk_shape[0]) * (8 // e.chunk_shape[1])
        assert len(e.chunk_crc32c) == 4 * n_chunks, key
        for i in range(8 // e.chunk_shape[0]):
            for j in range(8 // e.chunk_shape[1]):
                raw = _stored(ck, m, key, (i, j))
                u = i * (8 // e.chunk_shape[1]) + j
                assert e.chunk_crc32c[4 * u : 4 * u + 4] == raw[-4:], (key, i, j)


def test_sharded_units_are_recorded_inner_chunk_by_inner_chunk(tmp_path):
    ck = str(tmp_path / "ck")
    be = ZarrBackend(shard_above_bytes=32, inner_chunk_bytes=16)
    state = _save(ck, be)
    m = sp.read_metadata(ck)
    e = m.tensors["s"]
    raw = (tmp_path / "ck" / e.array / "c" / "0" / "0").read_bytes()
    n_inner = len(e.chunk_crc32c) // 4 // ((8 // e.chunk_shape[0]) * (8 // e.chunk_shape[1]))
    assert n_inner > 1, "the save sharded its chunks"
    idx = raw[len(raw) - 16 * n_inner - 4 : -4]
    for j in range(n_inner):
        off = int.from_bytes(idx[16 * j : 16 * j + 8], "little")
        nb = int.from_bytes(idx[16 * j + 8 : 16 * j + 16], "little")
        assert e.chunk_crc32c[4 * j : 4 * j + 4] == raw[off + nb - 4 : off + nb]
    assert torch.equal(sp.load(ck, backend=be)["s"], state["s"])


def _swap(p, q):
    tmp = p + ".x"
    os.rename(p, tmp)
    os.rename(q, p)
    os.rename(tmp, q)


def _refused_everywhere(ck, backend=None):
    with pytest.raises(errors.CorruptCheckpointError, match="SP-READ-8") as ei:
        sp.load(ck, backend=backend)
    assert ei.value.spec_id == "SP-READ-8"
    rep = verify_checkpoint(ck, backend=backend) if backend is not None else verify_checkpoint(ck)
    assert not rep.ok and "SP-READ-8" in rep.spec_ids, rep.to_dict()
    if backend is None:
        with pytest.raises(vectors.VectorError, match="SP-READ-8"):
            vectors.read_independently(ck)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chunks_swapped_between_tensors_are_refused(tmp_path, layout):
    ck = str(tmp_path / "ck")
    _save(ck, LAYOUTS[layout])
    _swap_chunks(ck, ("a", (1, 0)), ("b", (1, 0)))
    _refused_everywhere(ck)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chunks_swapped_between_positions_are_refused(tmp_path, layout):
    ck = str(tmp_path / "ck")
    _save(ck, LAYOUTS[layout])
    _swap_chunks(ck, ("a", (0, 0)), ("a", (1, 0)))
    _refused_everywhere(ck)


def test_inner_chunks_swapped_inside_a_shard_are_refused(tmp_path):
    ck = str(tmp_path / "ck")
    be = ZarrBackend(shard_above_bytes=32, inner_chunk_bytes=16)
    _save(ck, be)
    e = sp.read_metadata(ck).tensors["s"]
    n = len(e.chunk_crc32c) // 4 // ((8 // e.chunk_shape[0]) * (8 // e.chunk_shape[1]))
    p = os.path.join(ck, e.array, "c", "0", "0")
    data = bytearray(open(p, "rb").read())

    def swap01(idx):
        idx[0:16], idx[16:32] = idx[16:32], idx[0:16]

    open(p, "wb").write(bytes(_reseal_index(data, n, swap01)))
    _refused_everywhere(ck)


def test_swapped_chunks_are_refused_on_an_object_store():
    url = "memory://chunk-identity/ck"
    be = ZarrBackend()
    _save(url, be)
    m = sp.read_metadata(url, backend=be)
    from shardpoint_core.stores.registry import bucket_store

    store, prefix = bucket_store(url, "open")
    ka = f"{prefix}/{m.tensors['a'].array}/c/0/0"
    kb = f"{prefix}/{m.tensors['b'].array}/c/0/0"
    da, db = store.get(ka), store.get(kb)
    store.put(ka, db)
    store.put(kb, da)
    _refused_everywhere(url, be)


def test_a_checkpoint_without_tables_still_reads(tmp_path):
    """A writer MAY omit the table ([SP-MAN-7]): writes through TensorStore record no crc32c,
    so their tensors carry none and the manifest says [1, 1]."""
    ck = str(tmp_path / "ck")
    state = _save(ck, ZarrBackend(direct_writes=False))
    m = sp.read_metadata(ck)
    assert all(e.chunk_crc32c is None for e in m.tensors.values())
    assert tuple(m.format_version) == (1, 1)
    assert torch.equal(sp.load(ck)["b"], state["b"])
    shutil.rmtree(ck)


def _two_rank_save(rank, world, base):
    import torch
    import shardpoint as sp

    rows = torch.arange(64.0).view(8, 8)
    lo, hi = rank * 4, rank * 4 + 4
    st = {
        "t": sp.ShardedTensor(rows[lo:hi].clone(), (8, 8), (lo, 0)),
        "u": sp.ShardedTensor(rows[lo:hi] + 100, (8, 8), (lo, 0)),
    }
    opts = sp.SaveOptions(plan=sp.PlanOptions(max_chunk_bytes=64, chunk_overhead_bytes=0))
    sp.save(st, f"{base}/sync", async_save=True, options=opts).wait()  # commit in background
    return True


def test_ranks_send_their_units_crc32c_with_their_commit_report(tmp_path):
    """Each rank writes its own chunks; the coordinator's table holds every rank's."""
    from shardpoint_testing.launch import run_world

    assert run_world(2, _two_rank_save, str(tmp_path), timeout=120) == [True, True]
    for name in ("sync",):
        ck = str(tmp_path / name)
        m = sp.read_metadata(ck)
        assert tuple(m.format_version) == (1, 4)  # the default layout, packed
        assert len(m.packed.objects) == 2  # one data object per rank
        for e in m.tensors.values():
            n = (8 // e.chunk_shape[0]) * (8 // e.chunk_shape[1])
            assert n >= 2 and e.chunk_crc32c is not None and len(e.chunk_crc32c) == 4 * n
        assert torch.equal(sp.load(ck)["u"], torch.arange(64.0).view(8, 8) + 100)
    ck = str(tmp_path / "sync")
    m = sp.read_metadata(ck)
    last = tuple((8 // c) - 1 for c in m.tensors["t"].chunk_shape)
    _swap_chunks(ck, ("t", last), ("u", last))  # written by rank 1
    _refused_everywhere(ck)
