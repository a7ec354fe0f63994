"""shardpoint_jax reads regions that cut through chunks (plain and sharded) with the core's
Zarr layer, not TensorStore: exact bytes against numpy, and a damaged or missing chunk is the
JAX front end's CorruptCheckpointError with the spec's rule."""

from __future__ import annotations

import os

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import shardpoint_jax as spj  # noqa: E402
from shardpoint_jax.loading import Checkpoint  # noqa: E402


def _saved(tmp_path, a, backend=None):
    path = str(tmp_path / "ck")
    spj.save(path, {"w": a}, backend=backend)
    return path, Checkpoint(path).manifest.tensors["w"].array


@pytest.mark.parametrize("shape", [(300, 70), (2400, 1000)], ids=["plain", "sharded"])
def test_cut_through_regions_match_numpy(tmp_path, shape):
    a = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    path, _array = _saved(tmp_path, a)
    arr = Checkpoint(path).array("w")
    assert (arr.layout.inner is not None) == (shape == (2400, 1000)), arr.layout
    for off, sh in (((3, 5), (101, 7)), ((0, 0), shape), ((shape[0] - 1, 1), (1, shape[1] - 1))):
        got = arr.read(off, sh)
        assert np.array_equal(got, a[off[0] : off[0] + sh[0], off[1] : off[1] + sh[1]])


@pytest.mark.parametrize("layout", ["per-array", "packed"])
def test_damaged_and_missing_chunks(tmp_path, layout):
    """A flipped byte in the first chunk (per array: its file; packed: its record in the
    data object), then that file removed (packed: the data object)."""
    from shardpoint_core.transactions.backend import ZarrBackend

    a = np.arange(300 * 70, dtype=np.float32).reshape(300, 70)
    if layout == "per-array":
        path, array = _saved(tmp_path, a, ZarrBackend())
        cdir = os.path.join(path, array, "c")
        first = os.path.join(cdir, *sorted(os.listdir(cdir))[:1])
        while os.path.isdir(first):
            first = os.path.join(first, sorted(os.listdir(first))[0])
        at = 7
    else:
        path, array = _saved(tmp_path, a)  # the default: packed
        obj, at, _n, _crc = Checkpoint(path).manifest.tensors["w"].packed.chunk(0)
        first, at = os.path.join(path, obj), at + 7
    raw = bytearray(open(first, "rb").read())
    raw[at] ^= 1
    open(first, "wb").write(bytes(raw))
    with pytest.raises(spj.CorruptCheckpointError) as e:
        Checkpoint(path).array("w").read((1, 1), (5, 5))
    assert e.value.spec_id == "SP-READ-3", str(e.value)
    os.remove(first)
    with pytest.raises(spj.CorruptCheckpointError) as e:
        Checkpoint(path).array("w").read((1, 1), (5, 5))
    assert e.value.spec_id == "SP-READ-2", str(e.value)


def test_jax_save_and_load_without_tensorstore(tmp_path):
    """With tensorstore's import failing, a JAX save (zarr.json by the core's layer, chunks
    direct) and load (direct, and through chunks by the core's layer) run bit for bit."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['tensorstore'] = None\n"
        "import numpy as np, shardpoint_jax as spj, jax.numpy as jnp\n"
        "from shardpoint_jax.loading import Checkpoint\n"
        "a = np.random.default_rng(0).standard_normal((2400, 1000)).astype(np.float32)\n"
        "spj.save('ck', {'w': jnp.asarray(a), 'b': np.array([True, False])})\n"
        "out = spj.load('ck')\n"
        "assert np.array_equal(np.asarray(out['w']), a) and list(out['b']) == [True, False]\n"
        "assert Checkpoint('ck').array('w').inner is not None\n"
        "assert np.array_equal(Checkpoint('ck').array('w').read((3, 5), (700, 9)),"
        " a[3:703, 5:14])\n"
        "print('ok')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


@pytest.mark.parametrize("fails", [False, True], ids=["loaded", "damaged"])
def test_a_load_leaves_nothing_of_its_reads_in_the_backend(tmp_path, fails):
    """A load closes its reader, whatever its outcome, as the torch load does: the shared
    backend keeps nothing for the checkpoint's location (memory stays flat over loads)."""
    from shardpoint_core.transactions.resolve import backend_for

    path, _array = _saved(tmp_path, np.ones((4, 4), np.float32))
    if fails:  # a damaged chunk: refused once its array was opened and read
        obj, at, _n, _crc = Checkpoint(path).manifest.tensors["w"].packed.chunk(0)
        with open(os.path.join(path, obj), "r+b") as f:
            f.seek(at + 5)
            b = f.read(1)
            f.seek(at + 5)
            f.write(bytes([b[0] ^ 1]))
        with pytest.raises(spj.CorruptCheckpointError, match="'w'"):
            spj.load(path)
    else:
        assert spj.load(path)["w"].tolist() == np.ones((4, 4)).tolist()
    kept = backend_for(path).zarr._locations
    assert path not in kept, list(kept)
