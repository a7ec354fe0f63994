"""shardpoint_jax writes whole chunks straight to their files (no TensorStore on the write
path): every file it writes must be byte for byte what TensorStore's writer makes of the same
tree (plain chunks, shards of inner chunks, 0-d arrays, bf16, blocks of a sharded array, and a
last chunk clipped by the array's edge, its inner chunks past the edge left absent)."""
from __future__ import annotations

import filecmp
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("jax", reason="shardpoint_jax needs jax (pip install -e '.[jax]')")

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import shardpoint_jax as sj
    from shardpoint_jax import direct, grid
    direct.available = {available}
    grid.LOCAL_CHUNK_BYTES = 2 << 20         # numpy arrays: chunks of 43 rows of 48 KB
    rng = np.random.default_rng(0)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    full = rng.standard_normal((12, 7), np.float32)          # 3 rows on each of 4 devices
    edge = rng.standard_normal((100, 12000), np.float32)     # 43 + 43 + 14 rows: clipped
    tree = {{"sharded": jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("x")),
                                                     lambda i: full[i]),
             "edge": edge,                                   # shards of 1-row inner chunks
             "big": jnp.asarray(rng.standard_normal((700, 1000), np.float32)),   # a shard
             "bf": jnp.asarray(rng.standard_normal((5, 3), np.float32)).astype(jnp.bfloat16),
             "s": jnp.asarray(2.5, jnp.float32), "np": np.arange(12, dtype=np.int16),
             "step": 3}}
    sj.save(sys.argv[1], tree)
    back = sj.load(sys.argv[1])
    assert np.asarray(back["sharded"]).tobytes() == full.tobytes()
    assert back["edge"].tobytes() == edge.tobytes()
""")


def _save(path, available):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", SCRIPT.format(available=available), str(path)],
                       capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr


def test_direct_chunk_files_are_byte_for_byte_tensorstores(tmp_path):
    _save(tmp_path / "direct", "lambda: True")
    _save(tmp_path / "ts", "lambda: False")
    files = sorted(os.path.relpath(os.path.join(d, f), tmp_path / "direct")
                   for d, _, fs in os.walk(tmp_path / "direct") for f in fs)
    assert {"tensors/sharded/c/3/0", "tensors/edge/c/2/0", "tensors/s/c"} <= set(files)
    ts_files = sorted(os.path.relpath(os.path.join(d, f), tmp_path / "ts")
                      for d, _, fs in os.walk(tmp_path / "ts") for f in fs)
    assert files == ts_files
    chunks = [f for f in files if f != "manifest.msgpack"]
    _match, mismatch, errors = filecmp.cmpfiles(tmp_path / "direct", tmp_path / "ts", chunks,
                                               shallow=False)
    assert mismatch == [] and errors == []
    shard = (tmp_path / "direct" / "tensors" / "edge" / "c" / "2" / "0").read_bytes()
    index = np.frombuffer(shard[-(43 * 16 + 4):-4], "<u8").reshape(43, 2)
    assert (index[14:] == 2**64 - 1).all() and (index[:14, 1] == 48000 + 4).all()
