"""shardpoint_jax in one process: every dtype bit for bit (NaN payloads, -0.0, subnormals),
0-d and empty arrays, values, sharded objects on 1-D and 2-D grids, abstract targets, numpy
targets filled in place, and the errors a bad tree or target gets."""

from __future__ import annotations


import numpy as np
import pytest

pytest.importorskip("jax", reason="shardpoint_jax needs jax (pip install -e '.[jax]')")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import shardpoint_jax as sj  # noqa: E402
from shardpoint_jax.dtypes import BY_NAME  # noqa: E402
from shardpoint_testing.tensors import random_array, same_bits  # noqa: E402


@pytest.fixture
def x64():
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("name", list(BY_NAME))
def test_every_dtype_round_trips_bitwise_as_jax_and_numpy(tmp_path, name, x64):
    a = random_array(len(name), (5, 3), BY_NAME[name])
    tree = {
        "j": jax.device_put(a),
        "n": a,
        "z": jax.device_put(a[0, 0]),
        "e": np.zeros((0, 3), BY_NAME[name]),
    }
    sj.save(tmp_path / "c", tree)
    back = sj.load(tmp_path / "c")
    assert isinstance(back["j"], jax.Array) and isinstance(back["n"], np.ndarray)
    assert same_bits(back["j"], a) and same_bits(back["n"], a) and same_bits(back["z"], a[0, 0])
    assert back["e"].shape == (0, 3)
    tgt = {"j": jax.ShapeDtypeStruct((5, 3), BY_NAME[name])}
    assert same_bits(sj.load(tmp_path / "c", tgt)["j"], a)


def test_64_bit_dtypes_without_x64_stay_numpy_and_are_never_narrowed(tmp_path):
    a = random_array(0, (4,), BY_NAME["float64"])
    sj.save(tmp_path / "c", {"d": a})
    back = sj.load(tmp_path / "c")["d"]
    assert isinstance(back, np.ndarray) and same_bits(back, a)
    with pytest.raises(sj.LayoutMismatchError, match="jax_enable_x64") as e:
        sj.load(tmp_path / "c", {"d": jax.ShapeDtypeStruct((4,), np.float64)})
    assert e.value.spec_id == "SP-DTYPE-2"


def test_values_objects_and_containers(tmp_path):
    tree = {
        "step": 7,
        "lr": 1e-3,
        "name": "run",
        "blob": b"\x00\xff",
        "none": None,
        "flag": True,
        "np_scalar": np.float32(1.5),
        3: "int key",
        "empty": [],
        "t": (1, (2.0, "x")),
        "rng": sj.ShardedObject({"s": np.arange(3), "p": (1, 2)}, 0, 1),
        "grid": [sj.ShardedObject(f"cell{i}", (0, i), (1, 3)) for i in range(3)],
    }
    tree["grid"] = sj.ShardedObject("cell0", (0, 0), (1, 1))
    sj.save(tmp_path / "c", tree)
    back = sj.load(tmp_path / "c")
    for k in ("step", "lr", "name", "blob", "none", "flag", 3, "empty", "t"):
        assert back[k] == tree[k] and type(back[k]) is type(tree[k]), k
    assert type(back["np_scalar"]) is np.float32 and back["np_scalar"] == 1.5
    assert back["rng"][0]["p"] == (1, 2) and same_bits(back["rng"][0]["s"], np.arange(3))
    assert back["grid"] == [["cell0"]]  # [SP-OBJ-4]: grids come back as nested lists
    assert list(back) == list(tree)  # dict order is kept


def test_object_grid_cells_and_grid_mismatch(tmp_path):
    sj.save(tmp_path / "c", {"o": sj.ShardedObject("only", (0, 0), (1, 1))})
    got = sj.load(tmp_path / "c", {"o": sj.ShardedObject(None, (0, 0), (1, 1))})["o"]
    assert got.value == "only"
    with pytest.raises(sj.LayoutMismatchError) as ei:
        sj.load(tmp_path / "c", {"o": sj.ShardedObject(None, 0, 1)})
    assert ei.value.spec_id == "SP-OBJ-2" and "(1, 1)" in str(ei.value)
    with pytest.raises(sj.InvalidShardingError) as ei:
        sj.save(tmp_path / "d", {"o": sj.ShardedObject("x", 0, 2)})
    assert ei.value.spec_id == "SP-OBJ-3"
    assert not (tmp_path / "d").exists()


def test_numpy_target_is_filled_in_place_and_subset_loads(tmp_path):
    a = random_array(0, (4, 6), BY_NAME["bfloat16"])
    sj.save(tmp_path / "c", {"m": {"w": a, "b": a[0]}, "step": 3})
    out = np.zeros_like(a)
    got = sj.load(tmp_path / "c", {"m": {"w": out}})
    assert got["m"]["w"] is out and same_bits(out, a)
    with pytest.raises(sj.LayoutMismatchError):
        sj.load(tmp_path / "c", {"m": {"w": np.zeros((4, 5), a.dtype)}})
    with pytest.raises(sj.LayoutMismatchError):
        sj.load(tmp_path / "c", {"nope": np.zeros(1)})
    assert sj.load(tmp_path / "c", {"nope": 5}, strict=False) == {"nope": 5}


def test_overwrite_and_refusals(tmp_path):
    sj.save(tmp_path / "c", {"a": np.ones(2)})
    with pytest.raises(sj.CheckpointExistsError):
        sj.save(tmp_path / "c", {"a": np.zeros(2)})
    sj.save(tmp_path / "c", {"a": np.zeros(3)}, overwrite=True)
    assert same_bits(sj.load(tmp_path / "c")["a"], np.zeros(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no staging or old left
    # [SP-COMMIT-5]: without consent a file or a user's directory is refused, with it replaced
    (tmp_path / "f").write_text("x")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "precious.txt").write_text("keep")
    for p in ("f", "mine"):
        with pytest.raises(sj.CheckpointExistsError):
            sj.save(tmp_path / p, {"a": np.ones(1)})
    assert (tmp_path / "f").read_text() == "x"
    assert (tmp_path / "mine" / "precious.txt").read_text() == "keep"
    # overwrite=True replaces checkpoints only (issue 21); 'any' a user's directory; never a file
    for ow in (True, "any"):
        with pytest.raises(sj.CheckpointExistsError):
            sj.save(tmp_path / "f", {"a": np.ones(1)}, overwrite=ow)
    with pytest.raises(sj.CheckpointExistsError):
        sj.save(tmp_path / "mine", {"a": np.ones(1)}, overwrite=True)
    assert (tmp_path / "mine" / "precious.txt").read_text() == "keep"
    sj.save(tmp_path / "mine", {"a": np.full(2, 5.0)}, overwrite="any")
    assert same_bits(sj.load(tmp_path / "mine")["a"], np.full(2, 5.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "f", "mine"]
    with pytest.raises(sj.UnsupportedValueError, match="obj"):
        sj.save(tmp_path / "d", {"obj": object()})
    with pytest.raises(sj.InvalidKeyError):
        sj.save(tmp_path / "d", {"..": 1})
    with pytest.raises(sj.IncompleteCheckpointError):
        sj.load(tmp_path)
    assert not (tmp_path / "d").exists()


def test_namedtuple_and_registered_nodes_round_trip_through_a_target(tmp_path):
    from collections import namedtuple

    State = namedtuple("State", "count mu")
    tree = {"opt": State(jnp.array(3, jnp.int32), {"w": jnp.ones(2)})}
    sj.save(tmp_path / "c", tree)
    tgt = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    got = sj.load(tmp_path / "c", tgt)
    assert type(got["opt"]) is State and int(got["opt"].count) == 3


@pytest.mark.parametrize("layout", ["per-array", "packed"])
def test_big_chunks_become_shards_and_partial_reads_touch_inner_chunks(tmp_path, layout):
    """A chunk over the core's threshold is a shard of inner chunks (per array: its
    zarr.json's sharding codec; packed: the index's inner chunk shape), read in part and
    whole by both front ends, and the torch front end writes the same bytes for it."""
    import json
    from shardpoint_jax.loading import Checkpoint
    from shardpoint_core.format.layout import INNER_CHUNK_BYTES, SHARD_ABOVE_BYTES
    from shardpoint_core.transactions.backend import ZarrBackend

    per_array = layout == "per-array"

    def backend():
        return ZarrBackend() if per_array else None  # None: the default, packed

    a = random_array(0, (2560, 1024), BY_NAME["float32"])  # one 10 MiB chunk
    assert a.nbytes > SHARD_ABOVE_BYTES  # the core's threshold, the torch side's too
    sj.save(tmp_path / "c", {"big": a}, backend=backend())
    inner = [INNER_CHUNK_BYTES // 4096, 1024]
    m = sj.read_metadata(tmp_path / "c")
    if per_array:
        meta = json.loads((tmp_path / "c" / "tensors" / "big" / "zarr.json").read_text())
        codec = meta["codecs"][0]
        assert codec["name"] == "sharding_indexed"
        assert codec["configuration"]["chunk_shape"] == inner
    else:
        assert m.format_version == (1, 4)
        assert dict(m.packed.arrays)[m.tensors["big"].array] == tuple(inner)
    assert same_bits(sj.load(tmp_path / "c")["big"], a)
    ck = Checkpoint(tmp_path / "c")
    assert same_bits(ck.read("big", [130, 5], [3, 7]), a[130:133, 5:12])
    shardpoint = pytest.importorskip("shardpoint")  # the reference reads the shards too
    assert np.asarray(shardpoint.load(str(tmp_path / "c"))["big"]).tobytes() == a.tobytes()
    # ... and writes the same bytes for the same state: one set of chunking choices
    torch = pytest.importorskip("torch")
    shardpoint.save({"big": torch.from_numpy(a)}, str(tmp_path / "t"), backend=backend())
    if per_array:
        for sub in ("zarr.json", "c/0/0"):
            ours, theirs = (tmp_path / d / "tensors" / "big" / sub for d in ("c", "t"))
            assert ours.read_bytes() == theirs.read_bytes(), sub
    else:  # the shard's record: the same bytes (its data object's name is random)
        shards = []
        for d in ("c", "t"):
            md = sj.read_metadata(tmp_path / d)
            obj, off, n, crc = md.tensors["big"].packed.chunk(0)
            with open(tmp_path / d / obj, "rb") as f:
                f.seek(off)
                shards.append((f.read(n), n, crc, md.packed.arrays))
        assert shards[0] == shards[1]
    tables = [
        shardpoint.read_metadata(str(tmp_path / d)).tensors["big"].chunk_crc32c for d in ("c", "t")
    ]
    assert tables[0] is not None and tables[0] == tables[1]  # [SP-MAN-7]


def test_a_front_end_on_the_core_alone_no_torch_no_torch_front_end():
    """shardpoint_jax builds on shardpoint_core only (issue 19): importing it and its adapter
    imports neither torch, the torch front end nor the conformance suite, and it does use the
    core (its copies of the core's modules are gone)."""
    import subprocess
    import sys

    code = (
        "import sys, shardpoint_jax, shardpoint_jax.adapter; "
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'shardpoint', 'shardpoint_conformance')]; "
        "core = [m for m in ('shardpoint_core.format.manifest', 'shardpoint_core.format.coverage') "
        "if m not in sys.modules]; "
        "print(bad, core); sys.exit(1 if bad or core else 0)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
