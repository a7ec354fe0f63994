"""shardpoint_jax is a front end on the core (issue 19): its errors are the core's classes, its
manifest is the core's codec, and the rules where the JAX copy and the core disagreed before
the merge are the spec's (each doctored manifest breaks exactly one rule, read through
``shardpoint_jax.load``)."""

from __future__ import annotations

import hashlib
import os

import msgpack
import numpy as np
import pytest

pytest.importorskip("jax", reason="shardpoint_jax needs jax (pip install -e '.[jax]')")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import shardpoint_jax as spj  # noqa: E402
from shardpoint_core.format import errors as core_errors  # noqa: E402
from shardpoint_core.format import manifest as core_manifest  # noqa: E402


def test_the_errors_are_the_cores_classes():
    for name in spj.errors.__all__:
        want = "InvalidOptionError" if name == "InvalidRequestError" else name
        assert getattr(spj.errors, name) is getattr(core_errors, want), name
    with pytest.raises(spj.CorruptCheckpointError) as e:  # raised by the core's codec
        core_manifest.decode_manifest(b"\x93not an envelope")
    assert e.value.spec_id == "SP-MAN-1" and e.value.category == "corrupt"
    with pytest.raises(spj.InvalidRequestError, match="SP-HOLD-1"):  # the old name still works
        raise core_errors.InvalidOptionError("region outside", spec_id="SP-HOLD-1")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A small checkpoint: a numpy tensor (origin "numpy"), a value, an object; its body."""
    path = str(tmp_path_factory.mktemp("core") / "ck")
    spj.save(
        path,
        {"w": np.arange(4, dtype=np.float32), "v": 1, "o": spj.ShardedObject({"seed": 3}, 0, 1)},
    )
    with open(os.path.join(path, "manifest.msgpack"), "rb") as f:
        env = msgpack.unpackb(f.read())
    return path, env["body"]


def doctored(base, tmp_path, change) -> str:
    """A copy of the base checkpoint whose manifest body ``change(body)`` edited."""
    src, raw = base
    dst = tmp_path / "ck"
    dst.mkdir()
    for root, _dirs, files in os.walk(src):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), src)
            os.makedirs(dst / os.path.dirname(rel), exist_ok=True)
            with open(os.path.join(root, name), "rb") as f, open(dst / rel, "wb") as g:
                g.write(f.read())
    body = msgpack.unpackb(raw, strict_map_key=False)
    change(body)
    raw = msgpack.packb(body, use_bin_type=True)
    with open(dst / "manifest.msgpack", "wb") as f:
        f.write(msgpack.packb({"sha256": hashlib.sha256(raw).digest(), "body": raw}))
    return str(dst)


def leaf(body, name):
    return next(n for k, n in body["tree"]["dict"] if k == name)


def two_kinds(b):
    leaf(b, "v")["dict"] = []


def bad_origin(b):
    leaf(b, "w")["origin"] = "jax"


def no_array(b):
    del b["tensors"]["w"]["array"]


def world_zero(b):
    b["save_world_size"] = 0


def writer_and_dtype(b):  # [SP-MAN-2] comes before the tensor entries
    b["writer"], b["tensors"]["w"]["dtype"] = 5, "float128"


def dot_dot_after_bad_escape(b):  # [SP-KEY-2] before [SP-KEY-3], wherever they sit
    b["tensors"]["%zz/.."] = b["tensors"].pop("w")


def tuple_trailing_bytes(b):
    b["objects"]["o"]["values"] = [msgpack.ExtType(2, msgpack.packb([1]) + b"\xc0")]


def long_tree_path(b):  # the tree path's own rule, not [SP-KEY-2]
    b["tree"]["dict"].append(["x" * 5000, {"object": "o"}])


def empty_key_of_a_value(b):  # a value leaf's path is a key too; both copies missed it
    b["tree"]["dict"].append(["", {"value": 2}])


def rank_65(b):
    b["tensors"]["w"]["shape"] = b["tensors"]["w"]["chunk_shape"] = [1] * 65


@pytest.mark.parametrize(
    "change, cls, sid",
    [
        (two_kinds, spj.CorruptCheckpointError, "SP-MAN-4"),
        (bad_origin, spj.CorruptCheckpointError, "SP-MAN-4"),
        (no_array, spj.CorruptCheckpointError, "SP-MAN-3"),
        (world_zero, spj.CorruptCheckpointError, "SP-MAN-2"),
        (writer_and_dtype, spj.CorruptCheckpointError, "SP-MAN-2"),
        (dot_dot_after_bad_escape, spj.CorruptCheckpointError, "SP-KEY-2"),
        (tuple_trailing_bytes, spj.CorruptCheckpointError, "SP-VALUE-2"),
        (long_tree_path, spj.CorruptCheckpointError, "SP-KEY-4"),
        (empty_key_of_a_value, spj.CorruptCheckpointError, "SP-KEY-2"),
        (rank_65, spj.CorruptCheckpointError, "SP-SEC-2"),
    ],
    ids=lambda x: getattr(x, "__name__", str(x)),
)
def test_a_rule_the_copies_disagreed_on_is_the_specs(base, tmp_path, change, cls, sid):
    path = doctored(base, tmp_path, change)
    with pytest.raises(cls) as e:
        spj.load(path)
    assert e.value.spec_id == sid, e.value


def test_the_base_checkpoint_reads(base, tmp_path):
    back = spj.load(doctored(base, tmp_path, lambda b: None))
    assert back["v"] == 1 and back["o"] == [{"seed": 3}]
    assert isinstance(back["w"], np.ndarray) and back["w"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("layout", ["per-array", "packed"])
def test_a_big_endian_numpy_leaf_is_stored_little_endian(tmp_path, layout):
    from shardpoint_core.transactions.backend import ZarrBackend

    a = np.arange(-3, 3, dtype=">i4").reshape(2, 3)
    per_array = layout == "per-array"
    spj.save(str(tmp_path / "ck"), {"a": a}, backend=ZarrBackend() if per_array else None)
    back = spj.load(str(tmp_path / "ck"))["a"]
    assert back.dtype == np.dtype("<i4") and (back == a).all()
    if per_array:
        where, at = os.path.join("tensors", "a", "c", "0", "0"), 0
    else:  # the chunk's record in the data object
        where, at, _n, _crc = spj.read_metadata(str(tmp_path / "ck")).tensors["a"].packed.chunk(0)
    with open(tmp_path / "ck" / where, "rb") as f:
        f.seek(at)
        assert f.read(8) == np.array([-3, -2], "<i4").tobytes()


def test_jax_arrays_in_object_values_come_back_as_numpy(tmp_path):
    v = {"k": jnp.arange(3, dtype=jnp.int32), "t": (jnp.float32(1.5), "x")}
    spj.save(str(tmp_path / "ck"), {"o": spj.ShardedObject(v, 0, 1)})
    (got,) = spj.load(str(tmp_path / "ck"))["o"]
    assert isinstance(got["k"], np.ndarray) and got["k"].tolist() == [0, 1, 2]
    assert got["t"][1] == "x" and float(got["t"][0]) == 1.5
    with pytest.raises(spj.UnsupportedValueError, match=r"o.*key_data"):
        spj.save(str(tmp_path / "ck2"), {"o": spj.ShardedObject({"rng": jax.random.key(0)}, 0, 1)})
    assert not os.path.exists(tmp_path / "ck2")


def test_the_writer_refuses_a_manifest_over_the_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(core_manifest, "MAX_MANIFEST_BYTES", 4096)
    with pytest.raises(spj.UnsupportedValueError) as e:
        spj.save(str(tmp_path / "ck"), {"blob": b"\0" * 8192})
    assert e.value.spec_id == "SP-SEC-2"
    assert os.listdir(tmp_path) == [] or not os.path.exists(tmp_path / "ck")


def test_an_error_another_process_reported_is_raised_as_the_cores_class():
    from shardpoint_jax.saving import error_info, raise_info

    for err in (
        core_errors.RankLostError("rank 1 lost"),
        core_errors.CorruptCheckpointError("bad", spec_id="SP-READ-3"),
    ):
        with pytest.raises(type(err)) as e:
            raise_info(error_info(err), "write")
        assert str(e.value) == str(err) and e.value.spec_id == err.spec_id
    for name in ("OSError", "os", "Manifest"):  # not an error class of the core
        with pytest.raises(spj.SaveFailedError) as e:
            raise_info([name, None, "boom"], "write")
        assert type(e.value) is spj.SaveFailedError


def test_read_metadata_gives_the_typed_tree(tmp_path):
    """``spj.read_metadata(path).tree``: the saved pytree with the core's typed leaves; a
    jax.Array leaf has no origin (the saving framework's own type, [SP-MAN-6])."""
    path = str(tmp_path / "ck")
    spj.save(
        path,
        {
            "w": jnp.ones((2, 3)),
            "n": np.arange(4, dtype=np.int8),
            "o": spj.ShardedObject({"seed": 3}, 0, 1),
            "sched": (1, [None]),
        },
    )
    t = spj.read_metadata(path).tree
    assert isinstance(t["w"], spj.TensorLeaf) and (t["w"].shape, t["w"].dtype) == (
        (2, 3),
        "float32",
    )
    assert t["w"].origin is None and t["n"].origin == "numpy"
    assert isinstance(t["o"], spj.ObjectLeaf) and t["o"].nested() == [{"seed": 3}]
    assert t["sched"] == (spj.ValueLeaf("sched/0", 1), [spj.ValueLeaf("sched/1/0", None)])
    assert [(p, leaf.kind) for p, leaf in spj.iter_leaves(t)] == [
        (("w",), "tensor"),
        (("n",), "tensor"),
        (("o",), "object"),
        (("sched", 0), "value"),
        (("sched", 1, 0), "value"),
    ]
    assert spj.node_at(t, ("sched", 1)) == [spj.ValueLeaf("sched/1/0", None)]
