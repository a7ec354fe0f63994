"""shardpoint_jax writes local chunks straight to their files with the core's direct writer
(``pwritev`` of the array's memory): in the per-array layout (``backend=ZarrBackend()``)
every file must be byte for byte what the core's Zarr layer writes for the same tree on any
other store (here ``memory://``): plain chunks, shards of inner chunks, 0-d arrays, bf16,
blocks of a sharded array, and a last chunk clipped by the array's edge, its inner chunks
past the edge left absent.

The packed layout (the default) has the same invariant for its two writers, on files (each
chunk a ``pwritev`` at an offset reserved in the process's data file, big chunks aligned,
zeros between) and on object stores (chunks copied into segments that are PUT): every
chunk's record holds the same bytes in both, and those are the per-array layout's chunk
file, byte for byte; the indexes agree but for where the records lie, and a data file holds
nothing but its records and zeros."""

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
    from shardpoint_core.transactions.backend import ZarrBackend
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
    sj.save(local, tree, backend=ZarrBackend())
    sj.save(mem, tree, backend=ZarrBackend())
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

    # the packed layout (the default): files and memory://, against the chunk files above
    plocal, pmem = sys.argv[2], "memory://direct-write/packed"
    sj.save(plocal, tree)
    sj.save(pmem, tree)
    assert sj.load(plocal)["edge"].tobytes() == edge.tobytes()
    pl, pm = sj.read_metadata(plocal), sj.read_metadata(pmem)
    pstore, pkey = locate(pmem).pair()
    assert pl.format_version == pm.format_version == (1, 4)
    assert sorted(os.listdir(plocal)) == ["manifest.msgpack", "packed"]
    same = ("array", "chunk", "length", "crc32c")
    assert (pl.packed.records[list(same)] == pm.packed.records[list(same)]).all()
    assert [i for _a, i in pl.packed.arrays] == [i for _a, i in pm.packed.arrays]
    records = 0
    spans = {}
    for k, t in pl.tensors.items():
        assert t.chunk_crc32c == pm.tensors[k].chunk_crc32c == lm.tensors[k].chunk_crc32c, k
        grid_ = [-(-n // c) for n, c in zip(t.shape, t.chunk_shape)]
        for c in range(len(t.packed.records)):
            obj, off, n, crc = t.packed.chunk(c)
            with open(os.path.join(plocal, obj), "rb") as f:
                f.seek(off)
                ours = f.read(n)
            spans.setdefault(obj, []).append((off, n))
            mobj, moff, mn, mcrc = pm.tensors[k].packed.chunk(c)
            assert (mn, mcrc) == (n, crc), (k, c)
            assert pstore.get_range(f"{pkey}/{mobj}", moff, mn) == ours, (k, c)
            rel = "/".join(["c"] + [str(i) for i in np.unravel_index(c, grid_)]) if grid_ else "c"
            with open(os.path.join(local, t.array, rel), "rb") as f:
                assert f.read() == ours, (k, rel)  # the per-array layout's chunk file
            records += 1
    for obj, sp in spans.items():  # nothing but the records and the zeros between them
        data = bytearray(open(os.path.join(plocal, obj), "rb").read())
        for off, n in sp:
            data[off : off + n] = bytes(n)
        assert len(data) == max(o + n for o, n in sp) and not any(data), obj
    assert records == files - len(lm.tensors)  # every chunk file once (less the zarr.json)
    print(files, records)
""")


def test_direct_chunk_files_are_byte_for_byte_the_zarr_layers(tmp_path):
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu"
    )
    path = tmp_path / "direct"
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path), str(tmp_path / "packed")],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    files, records = (int(x) for x in r.stdout.split()[-2:])
    assert files >= 10 and records >= 10
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
