"""shardpoint_jax loads read regions ahead of their use, a window of bytes at a time: the
result is the same whatever the window, numpy targets are still filled in place, and a
damaged chunk read ahead is reported for its own tensor, with no read left running."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("jax", reason="shardpoint_jax needs jax (pip install -e '.[jax]')")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import shardpoint_jax as sj  # noqa: E402
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


def test_a_damaged_chunk_read_ahead_names_its_own_tensor(tmp_path, monkeypatch):
    t = tree()
    p = str(tmp_path / "ck")
    sj.save(p, t)
    chunk = os.path.join(p, "tensors", "w4", "c", "0", "0")
    with open(chunk, "r+b") as f:  # same size, one flipped byte
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    started = []
    real = loading.ReadAhead._start

    def spy(self, upto):
        real(self, upto)
        started.append(set(self.started))

    monkeypatch.setattr(loading.ReadAhead, "_start", spy)
    monkeypatch.setattr(loading, "READ_AHEAD_BYTES", 1 << 40)
    with pytest.raises(sj.CorruptCheckpointError, match="'w4'"):
        sj.load(p, abstract(t))
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
    """Local regions are read by the core's direct reader (preadv into the destination);
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
    sj.save(p, t)
    regions = [
        ("big", [0, 0], [700, 1000]),
        ("big", [35, 0], [70, 1000]),
        ("big", [2130, 0], [70, 1000]),
        ("big", [3, 5], [100, 7]),
        ("odd", [0, 0], [37, 11]),
        ("bf", [0, 0], [5, 3]),
        ("s", [], []),
    ]
    from shardpoint_core.transactions import backend

    calls = []
    real = backend.read_region  # what the core's direct reader falls back to
    monkeypatch.setattr(
        backend,
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
