"""shardpoint_jax loads read regions ahead of their use, a window of bytes at a time: the
result is the same whatever the window, numpy targets are still filled in place, and a
damaged chunk read ahead is reported for its own tensor, with no read left running (in
both layouts). Local reads straight into the destination give the Zarr layer's bytes
exactly and catch damage: the per-array layout's chunk files (``direct_read``) and the
packed layout's whole-tensor reads (``packed_direct``)."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("jax", reason="shardpoint_jax needs jax (pip install -e '.[jax]')")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import shardpoint_jax as sj  # noqa: E402
from shardpoint_core.transactions.backend import ZarrBackend  # noqa: E402
from shardpoint_core.transactions.resolve import read_metadata  # noqa: E402
from shardpoint_jax import loading  # noqa: E402


def tree():
    rng = np.random.default_rng(3)
    return {f"w{i}": jnp.asarray(rng.standard_normal((64, 32), np.float32)) for i in range(6)} | {
        "np": rng.integers(0, 9, (16, 8), np.int32),
        "bf": jnp.arange(40, dtype=jnp.bfloat16),
    }


def abstract(t):
    dev = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("x",)), P())
    return {
        k: np.zeros_like(v)
        if isinstance(v, np.ndarray)
        else jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=dev)
        for k, v in t.items()
    }


@pytest.mark.parametrize("window", [1, 10_000, 1 << 40])
def test_any_window_loads_the_same_bits_and_fills_numpy_in_place(tmp_path, monkeypatch, window):
    t = tree()
    sj.save(str(tmp_path / "ck"), t)
    monkeypatch.setattr(loading, "READ_AHEAD_BYTES", window)
    tgt = abstract(t)
    out = sj.load(str(tmp_path / "ck"), tgt)
    assert out["np"] is tgt["np"]  # filled in place, not replaced
    for k, v in t.items():
        assert np.asarray(out[k]).tobytes() == np.asarray(v).tobytes(), k
    whole = sj.load(str(tmp_path / "ck"))
    assert all(np.asarray(whole[k]).tobytes() == np.asarray(v).tobytes() for k, v in t.items())


def _flip(path: str, at: int) -> None:
    """One byte of the file at ``path`` flipped, its size unchanged."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("layout", ["per-array", "packed"])
def test_a_damaged_chunk_read_ahead_names_its_own_tensor(tmp_path, monkeypatch, layout):
    t = tree()
    p = str(tmp_path / "ck")
    if layout == "per-array":
        sj.save(p, t, backend=ZarrBackend())
        _flip(os.path.join(p, "tensors", "w4", "c", "0", "0"), 100)
    else:
        sj.save(p, t)  # the default: packed
        m = read_metadata(p)
        obj, off, _n, _crc = m.packed.array(m.tensors["w4"].array).chunk(0)
        _flip(os.path.join(p, obj), off + 100)  # inside w4's chunk in the data object
    started = []
    real = loading.ReadAhead._start

    def spy(self, upto):
        real(self, upto)
        started.append(set(self.started))

    monkeypatch.setattr(loading.ReadAhead, "_start", spy)
    monkeypatch.setattr(loading, "READ_AHEAD_BYTES", 1 << 40)
    with pytest.raises(sj.CorruptCheckpointError, match="'w4'") as e:
        sj.load(p, abstract(t))
    assert e.value.spec_id == "SP-READ-3"
    assert any(("w4", (0, 0), (64, 32)) in s for s in started)  # w4 was read ahead
    drained = []
    real_drain = loading.ReadAhead.drain
    monkeypatch.setattr(
        loading.ReadAhead,
        "drain",
        lambda self: (real_drain(self), drained.append(dict(self.started))),
    )
    with pytest.raises(sj.CorruptCheckpointError):
        sj.load(p, abstract(t))
    assert drained == [{}]  # nothing left reading


def test_direct_reads_from_the_files_match_the_zarr_layer_and_catch_damage(tmp_path, monkeypatch):
    """Per-array layout: local regions are read by the core's direct reader (preadv into the destination);
    they must give the Zarr layer's bytes exactly: edge chunks padded in the file, shards of
    inner chunks, regions cutting inner chunks, 0-d arrays, bf16. An intact checkpoint never
    needs the Zarr layer; a damaged inner chunk goes to it, which names the rule."""
    from shardpoint_jax.loading import Checkpoint

    rng = np.random.default_rng(5)
    big = rng.standard_normal((2200, 1000), np.float32)  # 8.8 MB: a shard of inner chunks
    t = {
        "big": big,
        "odd": rng.integers(0, 255, (37, 11), np.uint8),
        "bf": jnp.asarray(rng.standard_normal((5, 3), np.float32)).astype(jnp.bfloat16),
        "s": jnp.asarray(3.5, jnp.float32),
    }
    p = str(tmp_path / "ck")
    sj.save(p, t, backend=ZarrBackend())  # the per-array layout: chunk files
    regions = [
        ("big", [0, 0], [700, 1000]),
        ("big", [35, 0], [70, 1000]),
        ("big", [2130, 0], [70, 1000]),
        ("big", [3, 5], [100, 7]),
        ("odd", [0, 0], [37, 11]),
        ("bf", [0, 0], [5, 3]),
        ("s", [], []),
    ]
    from shardpoint_core.transactions import backend, backend_handles

    calls = []
    # what the core's direct reader falls back to, looked up where ZarrBackend's reads start
    real = backend_handles.read_region
    monkeypatch.setattr(
        backend_handles,
        "read_region",
        lambda store, path, lay, off, view, *a: (
            calls.append((direct, list(off))),
            real(store, path, lay, off, view, *a),
        )[1],
    )
    got = {}
    for direct in (True, False):
        ck = Checkpoint(p)
        for k in t:
            arr = ck.array(k)
            assert isinstance(arr.handle, backend._DirectHandle), k
            if not direct:
                arr.handle = arr.handle.arr  # the Zarr layer over the FileStore
        got[direct] = [ck.read(k, o, s).tobytes() for k, o, s in regions]
    assert got[True] == got[False] and not [c for c in calls if c[0]]
    assert len(calls) == len(regions)  # the Zarr layer did read them, once each
    calls.clear()
    direct = True
    assert got[True][1] == big[35:105].tobytes() and got[True][2] == big[2130:].tobytes()
    assert got[True][3] == big[3:103, 5:12].tobytes()
    rows = Checkpoint(p).array("big").inner[0]
    shard = os.path.join(p, "tensors", "big", "c", "0", "0")
    with open(shard, "r+b") as f:  # one byte of inner chunk 1
        n = -(-2200 // rows)
        f.seek(-(16 * n + 4), 2)
        pos = int(np.frombuffer(f.read(16 * n), "<u8").reshape(n, 2)[1, 0])
        f.seek(pos + 10)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(
        sj.CorruptCheckpointError, match=r"'big'.*inner chunk \[1, 0\].*crc32c"
    ) as e:
        Checkpoint(p).read("big", [rows, 0], [rows, 1000])
    assert e.value.spec_id == "SP-READ-3" and calls == [(True, [rows, 0])]


def test_packed_whole_reads_into_the_destination_match_the_zarr_layer_and_catch_damage(
    tmp_path, monkeypatch
):
    """Packed layout (the default): a tensor of big chunks read whole on local files goes
    straight into the destination (``packed_direct``, one preadv per inner chunk); it must
    give the Zarr layer's bytes over the data object exactly: a shard with an edge inner
    chunk, a plain uint8 chunk of odd width, bf16; small tensors (a 0-d one) are read from
    merged runs. A damaged inner chunk is caught on the direct path, naming the tensor, the
    data object and the rule; a region that avoids it still reads."""
    from shardpoint_core.arrays import packed_direct
    from shardpoint_jax.loading import Checkpoint

    rng = np.random.default_rng(5)
    t = {
        "big": rng.standard_normal((2201, 1000), np.float32),  # a shard, its last inner chunk cut
        "odd": rng.integers(0, 255, (1100, 1001), np.uint8),
        "bf": jnp.asarray(rng.standard_normal((700, 1000), np.float32)).astype(jnp.bfloat16),
        "s": jnp.asarray(3.5, jnp.float32),
    }
    p = str(tmp_path / "ck")
    sj.save(p, t)
    m = read_metadata(p)
    assert m.packed is not None and dict(m.packed.arrays)[m.tensors["big"].array]
    direct = []
    real = packed_direct.read_whole
    monkeypatch.setattr(
        packed_direct, "read_whole", lambda v, *a: (direct.append(v.key), real(v, *a))[1]
    )
    got = {}
    for straight in (True, False):
        if not straight:  # every read through the Zarr layer over the data object
            monkeypatch.setattr(packed_direct, "applies", lambda *a: False)
        ck = Checkpoint(p)
        got[straight] = {
            k: ck.read(k, [0] * np.ndim(v), np.shape(v)).tobytes() for k, v in t.items()
        }
    assert sorted(direct) == ["bf", "big", "odd"]  # only the first pass went straight
    assert got[True] == got[False] == {k: np.asarray(v).tobytes() for k, v in t.items()}
    monkeypatch.undo()

    part = m.packed.array(m.tensors["big"].array)
    obj, off, n, _crc = part.chunk(0)
    rows = part.inner[0]
    ninner = -(-2201 // rows)
    with open(os.path.join(p, obj), "rb") as f:  # the shard's index, at the record's end
        f.seek(off + n - (16 * ninner + 4))
        index = np.frombuffer(f.read(16 * ninner), "<u8").reshape(ninner, 2)
    _flip(os.path.join(p, obj), off + int(index[1, 0]) + 10)  # one byte of inner chunk 1
    direct.clear()
    monkeypatch.setattr(
        packed_direct, "read_whole", lambda v, *a: (direct.append(v.key), real(v, *a))[1]
    )
    with pytest.raises(sj.CorruptCheckpointError, match=r"'big'.*inner chunk.*crc32c") as e:
        Checkpoint(p).read("big", [0, 0], [2201, 1000])
    assert e.value.spec_id == "SP-READ-3" and obj in str(e.value) and direct == ["big"]
    later = Checkpoint(p).read("big", [2 * rows, 0], [rows, 1000])  # inner chunk 2 only
    assert later.tobytes() == t["big"][2 * rows : 3 * rows].tobytes()
