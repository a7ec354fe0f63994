"""shardpoint_jax writes local chunks straight to their files with the core's direct writer
(``pwritev`` of the array's memory): every file must be byte for byte what the core's Zarr
layer writes for the same tree on any other store (here ``memory://``): plain chunks, shards
of inner chunks, 0-d arrays, bf16, blocks of a sharded array, and a last chunk clipped by the
array's edge, its inner chunks past the edge left absent."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("jax", reason="shardpoint_jax needs jax (pip install -e '.[jax]')")

SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import shardpoint_jax as sj
    from shardpoint_core.stores.location import locate
    from shardpoint_jax import grid
    grid.LOCAL_CHUNK_BYTES = 43 * 200_000    # numpy arrays: chunks of 43 rows of 200 KB
    rng = np.random.default_rng(0)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    full = rng.standard_normal((12, 7), np.float32)          # 3 rows on each of 4 devices
    edge = rng.standard_normal((100, 50000), np.float32)     # 43 + 43 + 14 rows: clipped
    tree = {"sharded": jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("x")),
                                                    lambda i: full[i]),
            "edge": edge,                                    # shards of inner chunks
            "big": jnp.asarray(rng.standard_normal((2200, 1000), np.float32)),  # a shard
            "bf": jnp.asarray(rng.standard_normal((5, 3), np.float32)).astype(jnp.bfloat16),
            "s": jnp.asarray(2.5, jnp.float32), "np": np.arange(12, dtype=np.int16),
            "step": 3}
    local, mem = sys.argv[1], "memory://direct-write/ck"
    sj.save(local, tree)
    sj.save(mem, tree)
    back = sj.load(local)
    assert np.asarray(back["sharded"]).tobytes() == full.tobytes()
    assert back["edge"].tobytes() == edge.tobytes()
    store, key = locate(mem).pair()
    lm, mm = sj.read_metadata(local), sj.read_metadata(mem)
    files = 0
    for k, t in lm.tensors.items():
        base = os.path.join(local, t.array)
        for d, _, fs in os.walk(base):
            for f in fs:
                rel = os.path.relpath(os.path.join(d, f), base).replace(os.sep, "/")
                other = store.get("/".join((key, mm.tensors[k].array, rel)))
                assert open(os.path.join(d, f), "rb").read() == other, (k, rel)
                files += 1
        objs = [i for i in store.list("/".join((key, mm.tensors[k].array)) + "/")]
        assert len(objs) == sum(len(fs) for _, _, fs in os.walk(base)), k
    print(files)
""")


def test_direct_chunk_files_are_byte_for_byte_the_zarr_layers(tmp_path):
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu"
    )
    path = tmp_path / "direct"
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.split()[-1]) >= 10
    files = {os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs}
    assert {"tensors/sharded/c/3/0", "tensors/edge/c/2/0", "tensors/s/c"} <= files
    import numpy as np
    from shardpoint_jax.loading import Checkpoint

    rows = Checkpoint(str(path)).array("edge").inner[0]
    shard = (path / "tensors" / "edge" / "c" / "2" / "0").read_bytes()
    n = 43 // rows
    index = np.frombuffer(shard[-(n * 16 + 4) : -4], "<u8").reshape(n, 2)
    inside = -(-14 // rows)  # inner chunks holding rows 86..99
    assert (index[inside:] == 2**64 - 1).all() and (index[:inside] != 2**64 - 1).all()
