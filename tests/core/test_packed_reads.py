"""Reads that fit the packed layout (issue 30 item 3, [SP-PACK-6]): a load reads only the
byte ranges its boxes need, the small chunks of every tensor merged into large ranged reads
(one ``preadv`` on files, one ranged GET on object stores, a gap limit between chunks),
counted on the real files and on the real S3 server; values bit for bit."""

from __future__ import annotations

import os

import numpy as np
import pytest

import shardpoint as sp
from shardpoint_core.arrays import packed_runs
from shardpoint_core.format.manifest import Manifest, TensorEntry, array_path_for
from shardpoint_core.transactions.backend import ZarrBackend
from shardpoint_core.transactions.packed import PackedBackend
from shardpoint_core.transactions.reader import CheckpointReader
from shardpoint_core.transactions.resolve import backend_for, read_metadata
from shardpoint_core.transactions.writer import CheckpointWriter


def _small(n: int = 40) -> dict:
    return {
        f"t{i:02d}": np.full((64, 16), i, np.float32) + np.arange(16, dtype=np.float32)
        for i in range(n)
    }


def _same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        g = np.asarray(got[k])
        assert g.dtype == v.dtype and g.shape == v.shape and g.tobytes() == v.tobytes(), k


def _count_preadv(monkeypatch) -> list:
    """Every ``preadv`` of a data object (``packed/*.bin``), as (offset, bytes): the real
    call, watched."""
    seen: list = []
    real = os.preadv

    def preadv(fd, bufs, offset, *a):
        try:
            if "/packed/" in os.readlink(f"/proc/self/fd/{fd}"):
                seen.append((offset, sum(len(memoryview(b).cast("B")) for b in bufs)))
        except OSError:
            pass
        return real(fd, bufs, offset, *a)

    monkeypatch.setattr(os, "preadv", preadv)
    return seen


def test_a_load_of_many_small_tensors_on_files_is_one_preadv(tmp_ckpt, monkeypatch):
    """Forty small tensors, back to back in one data object: one ``preadv`` for all of
    them (each tensor read on its own before, one ``preadv`` each)."""
    state = _small()
    sp.save(state, tmp_ckpt, backend=PackedBackend())
    seen = _count_preadv(monkeypatch)
    got = sp.load(tmp_ckpt, backend=PackedBackend())
    _same(got, state)
    size = read_metadata(tmp_ckpt).packed.objects[0][1]
    assert seen == [(0, size)], seen


def test_reads_merge_across_small_gaps_and_not_across_big_ones(tmp_ckpt, monkeypatch):
    """Boxes of three tensors read together: the two whose chunks lie a few KiB apart in
    one ``preadv``, the one beyond a tensor that is not read in another: the skipped
    tensor's bytes are never read."""
    gap = packed_runs.GAP_FILES
    state = {
        "a": np.arange(1024, dtype=np.float32),  # 4 KiB
        "b": np.arange(512, dtype=np.float32),  # 2 KiB: skipped, under the gap limit
        "c": np.arange(1024, dtype=np.float32) * 2,
        "d": np.zeros(gap // 4 + 4096, np.float32),  # more than the gap limit: skipped
        "e": np.arange(300, dtype=np.float32) * 3,
    }
    entries = {
        k: TensorEntry(k, array_path_for(k), v.shape, "float32", v.shape) for k, v in state.items()
    }
    with CheckpointWriter.begin(tmp_ckpt, backend=PackedBackend(write_threads=1)) as wr:
        for k, v in state.items():  # one after the other: the object holds them in this order
            wr.wait([wr.write(wr.open_array(entries[k].array, entries[k].spec), (0,), v)])
        wr.flush()
        wr.commit(Manifest({"dict": [[k, {"tensor": k}] for k in state]}, entries, {}))
    m = read_metadata(tmp_ckpt)
    at = {k: m.packed.array(f"tensors/{k}").chunk(0)[1:3] for k in state}  # (offset, length)
    assert sorted(at, key=lambda k: at[k][0]) == list(state)
    r = CheckpointReader.open(tmp_ckpt, backend=PackedBackend())
    outs = {k: np.empty_like(state[k]) for k in ("a", "c", "e")}
    seen = _count_preadv(monkeypatch)
    r.wait([r.read_into(r.array(k), (0,), out) for k, out in outs.items()])
    for k, out in outs.items():
        assert out.tobytes() == state[k].tobytes(), k
    (a0, _an), (c0, cn), (e0, en) = at["a"], at["c"], at["e"]
    assert sorted(seen) == [(a0, c0 + cn - a0), (e0, en)], (seen, at)


def test_a_partial_read_on_s3_reads_only_its_own_chunks(s3_env):
    """One box of one small tensor through the reader: one ranged GET of that chunk's bytes
    (an aligned 8 MiB block of the data object before)."""
    from shardpoint_testing.s3 import Requests

    url = s3_env.url(s3_env.fresh_prefix("packed-reads") + "/ck")
    state = {**_small(8), "big": np.arange(3 << 20, dtype=np.float32)}  # 12 MiB after them
    sp.save(state, url, backend=PackedBackend())
    m = read_metadata(url)
    r = CheckpointReader.open(url)
    h = r.array("t03")
    out = np.empty((10, 16), np.float32)
    with Requests(backend_for(url), url) as log:
        r.wait([r.read_into(h, (5, 0), out)])
        reads = log.take()
    assert out.tobytes() == state["t03"][5:15].tobytes()
    _obj, off, n, _crc = m.packed.array(m.tensors["t03"].array).chunk(0)
    assert [(op, rng) for op, _k, rng, *_ in reads] == [
        ("GetObject", f"bytes={off}-{off + n - 1}")
    ], reads


def test_a_load_on_s3_reads_each_byte_once_in_one_get_per_object(s3_env):
    """A whole load of small tensors and a shard on the S3 server: one HEAD and one ranged
    GET per data object for all of them, the GET covering exactly the object (before: 8 MiB
    blocks for the small chunks and the shard's index, then the shard's inner chunks again:
    its bytes twice; and a HEAD per object for each tensor opened at the same time)."""
    from shardpoint_testing.s3 import Requests

    url = s3_env.url(s3_env.fresh_prefix("packed-reads") + "/whole")
    state = {**_small(8), "big": np.arange(5 << 19, dtype=np.float32)}  # a 10 MiB shard
    be = PackedBackend(ZarrBackend(shard_above_bytes=4 << 20, inner_chunk_bytes=2 << 20))
    sp.save(state, url, backend=be)
    m = read_metadata(url)
    assert dict(m.packed.arrays)[m.tensors["big"].array] is not None  # a shard
    with Requests(backend_for(url), url) as log:
        got = sp.load(url)
        reads = log.take()
    _same(got, state)
    objects = {f"save-*/{p.split('/', 1)[1]}": size for p, size in m.packed.objects}
    data = [(k, rng) for op, k, rng, *_ in reads if op == "GetObject" and "/packed/" in k]
    assert sorted(data) == sorted((k, f"bytes=0-{n - 1}") for k, n in objects.items()), data
    # [SP-PACK-7] once per object and load, however many tensors open at the same time
    heads = [k for op, k, *_ in reads if op == "HeadObject" and "/packed/" in k]
    assert sorted(heads) == sorted(objects), heads


@pytest.mark.parametrize("where", ["files", "memory"])
def test_reads_of_many_boxes_agree_with_the_stored_values(tmp_ckpt, where):
    """Boxes of several tensors (edge chunks, a shard, overlapping boxes of one tensor),
    read in one batch: bit for bit what was saved."""
    rng = np.random.default_rng(3)
    state = {
        "w": rng.standard_normal((37, 11)).astype(np.float32),
        "s": rng.standard_normal((64, 40)).astype(np.float32),
        "i": np.arange(7 * 5, dtype=np.int16).reshape(7, 5),
    }
    path = tmp_ckpt if where == "files" else "memory://packed-reads/boxes"
    be = PackedBackend(ZarrBackend(shard_above_bytes=2048, inner_chunk_bytes=512))
    sp.save(state, path, backend=be)
    r = CheckpointReader.open(path)
    boxes = [("w", (3, 2), (20, 9)), ("s", (0, 0), (64, 40)), ("s", (13, 7), (5, 30))]
    boxes += [("i", (6, 0), (1, 5)), ("w", (0, 0), (37, 11))]
    outs = [np.empty(shape, state[k].dtype) for k, _o, shape in boxes]
    r.wait([r.read_into(r.array(k), off, out) for (k, off, _s), out in zip(boxes, outs)])
    for (k, off, shape), out in zip(boxes, outs):
        want = state[k][tuple(slice(o, o + n) for o, n in zip(off, shape))]
        assert out.tobytes() == want.tobytes(), (k, off)


def test_a_big_box_holds_a_few_runs_at_a_time_not_the_whole_box(monkeypatch):
    """Memory stays flat: a 32 MiB box of 512 KiB plain chunks read in 2 MiB runs on an
    object store (memory://) drops each run once its chunks are taken, so the traced peak
    is a few runs, not a second copy of the box (a view that kept its runs held it all)."""
    import tracemalloc

    monkeypatch.setattr(packed_runs, "MAX_RUN", 2 << 20)
    w = np.arange(8 << 20, dtype=np.float32).reshape(512, -1)  # rows of 64 KiB
    entry = TensorEntry("w", array_path_for("w"), w.shape, "float32", (8, w.shape[1]))
    url = "memory://packed-reads/flat"
    with CheckpointWriter.begin(url, backend=PackedBackend()) as wr:
        h = wr.open_array(entry.array, entry.spec)
        wr.wait([wr.write(h, (0, 0), w)])
        wr.flush()
        wr.commit(Manifest({"dict": [["w", {"tensor": "w"}]]}, {"w": entry}, {}))
    r = CheckpointReader.open(url, backend=PackedBackend(ZarrBackend(concurrency=4)))
    a = r.array("w")
    out = np.empty_like(w)
    tracemalloc.start()
    try:
        r.wait([r.read_into(a, (0, 0), out)])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.tobytes() == w.tobytes()
    assert peak < w.nbytes // 2, peak


def test_start_reads_starts_the_held_reads_before_any_wait(tmp_ckpt):
    """Reads held back to be planned together start at ``start_reads`` (a caller that does
    other work before it waits: the dedup exchange, JAX's read-ahead), not only at wait."""
    from concurrent.futures import wait as wait_futures

    state = _small(4)
    sp.save(state, tmp_ckpt, backend=PackedBackend())
    r = CheckpointReader.open(tmp_ckpt)
    outs = {k: np.zeros_like(v) for k, v in state.items()}
    ops = [r.read_into(r.array(k), (0, 0), out) for k, out in outs.items()]
    assert not any(op.op.done() for op in ops)  # held: nothing read yet
    r.start_reads()
    done, _ = wait_futures([op.op for op in ops], timeout=120)
    assert len(done) == len(ops)
    r.wait(ops)
    _same(outs, state)
