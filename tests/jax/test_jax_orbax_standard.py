"""Orbax's standard checkpointing on shardpoint (issue 33): ``shardpoint_jax.orbax``'s
``StandardCheckpointer`` and ``StandardCheckpointHandler`` behave as Orbax's classes of the same
names on the behaviours Orbax's own ``standard_checkpoint_handler_test`` exercises. The cases
run in one process on 8 CPU devices (one JAX start for all); each test checks its case."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("orbax.checkpoint")
pytest.importorskip("optax")

SCRIPT = r"""
import json, os, sys, traceback
import jax, jax.numpy as jnp, numpy as np, optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from shardpoint_jax import orbax as spo
from shardpoint_core.format.errors import ShardpointError

root = sys.argv[1]
devs = np.array(jax.devices())
assert devs.size == 8, devs
mesh = Mesh(devs.reshape(2, 4), ("x", "y"))
H = spo.StandardCheckpointHandler()
out = {}
n = [0]

def d():
    n[0] += 1
    p = os.path.join(root, f"c{n[0]}")
    os.makedirs(p)
    return p

def case(f):
    try:
        out[f.__name__] = f() or "ok"
    except Exception as e:
        out[f.__name__] = "FAIL " + "".join(traceback.format_exception_only(type(e), e))

def put(a, spec):
    return jax.device_put(a, NamedSharding(mesh, spec))

w = put(np.arange(32, dtype=np.float32).reshape(8, 4), P("x", "y"))

@case
def save_args_cast():
    p = d()
    H.save(p, args=ocp.args.StandardSave({"w": w}, save_args={"w": ocp.SaveArgs(dtype=jnp.bfloat16)}))
    md = H.metadata(p)
    assert md.tree["w"].dtype == jnp.bfloat16, md.tree["w"].dtype
    r = H.restore(p, args=ocp.args.StandardRestore({"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=w.sharding)}))
    assert r["w"].dtype == jnp.float32 and (np.asarray(r["w"]) == np.asarray(w)).all()

@case
def custom_metadata():
    p = d()
    H.save(p, args=ocp.args.StandardSave({"w": w}, custom_metadata={"foo": 1, "run": "a"}))
    assert H.metadata(p).custom_metadata == {"foo": 1, "run": "a"}
    # kept in the checkpoint's own manifest (an ignorable extension), nothing beside it
    from shardpoint_core.transactions.resolve import read_metadata
    ext = read_metadata(os.path.join(p, "shardpoint")).extensions["orbax"]
    assert ext["must_understand"] is False and ext["custom_metadata"] == {"foo": 1, "run": "a"}
    assert sorted(os.listdir(p)) == ["shardpoint"]
    import shardpoint_jax as spj
    try:
        spj.save(os.path.join(root, "bad_ext"), {"w": w}, extensions={"x": {"a": 1}})
        raise AssertionError("an extension without must_understand: false was written")
    except ValueError as e:
        assert "must_understand" in str(e)

@case
def no_target_keeps_saved_sharding():
    p = d()
    H.save(p, args=ocp.args.StandardSave({"w": w, "n": np.arange(3)}))
    r = H.restore(p)
    assert r["w"].sharding.is_equivalent_to(w.sharding, 2), r["w"].sharding
    assert len(r["w"].sharding.device_set) == 8
    assert isinstance(r["n"], np.ndarray) and r["n"].dtype == np.int64

@case
def topology_mismatch():
    p = d()
    H.save(p, args=ocp.args.StandardSave({"w": w}))
    from unittest import mock
    with mock.patch.object(jax, "devices", return_value=jax.devices()[:1]):
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        r = H.restore(p, args=ocp.args.StandardRestore(None, fallback_sharding=one))
        assert r["w"].sharding == one and (np.asarray(r["w"]) == np.asarray(w)).all()
        try:
            H.restore(p)
        except ValueError as e:
            assert "Topology mismatch detected" in str(e) and isinstance(e, ShardpointError)
            return
    raise AssertionError("no error")

@case
def strict_false_truncates_and_pads():
    p = d()
    a = put(np.arange(8, dtype=np.int32), P(None))
    H.save(p, args=ocp.args.StandardSave({"a": a, "b": a}))
    t = {"a": jax.ShapeDtypeStruct((4,), jnp.int32, sharding=a.sharding),
         "b": jax.ShapeDtypeStruct((12,), jnp.int32, sharding=a.sharding)}
    try:
        H.restore(p, args=ocp.args.StandardRestore(t))
        raise AssertionError("strict restore of another shape did not raise")
    except ValueError:
        pass
    r = H.restore(p, args=ocp.args.StandardRestore(t, strict=False))
    assert np.asarray(r["a"]).tolist() == [0, 1, 2, 3]
    assert np.asarray(r["b"]).tolist() == list(range(8)) + [0] * 4
    assert r["b"].sharding == a.sharding

@case
def masked_and_none_leaves():
    p = d()
    H.save(p, args=ocp.args.StandardSave({"a": optax.MaskedNode(), "b": w, "c": None}))
    for tgt in (None, {"a": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=w.sharding),
                       "b": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=w.sharding),
                       "c": None},
                {"a": optax.MaskedNode(), "b": None, "c": None}):
        r = H.restore(p, args=ocp.args.StandardRestore(tgt))
        assert r["a"] is None and r["c"] is None, r
        if tgt is not None and tgt["b"] is None:
            assert r["b"] is None
        else:
            assert (np.asarray(r["b"]) == np.asarray(w)).all()

@case
def prng_keys():
    p = d()
    rep = NamedSharding(mesh, P())
    k = {"t": jax.random.key(jnp.array(3, device=rep)),
         "r": jax.random.key(jnp.array(3, device=rep), impl="rbg")}
    H.save(p, args=ocp.args.StandardSave(k))
    from orbax.checkpoint import utils as ocp_utils   # its key structs are uint32 ones
    for tgt in (None, jax.eval_shape(lambda: k), jax.tree.map(ocp_utils.to_shape_dtype_struct, k),
                {"t": jax.random.key(0), "r": jax.random.key(0, impl="rbg")}):
        r = H.restore(p, args=ocp.args.StandardRestore(tgt))
        for name in ("t", "r"):
            assert jax.random.key_impl(r[name]) == jax.random.key_impl(k[name]), name
            assert (np.asarray(jax.random.key_data(r[name]))
                    == np.asarray(jax.random.key_data(k[name]))).all()
    # the checkpoint itself holds the key data as uint32 (every front end reads it)
    import shardpoint_jax as spj
    raw = spj.load(os.path.join(p, "shardpoint"))
    assert raw["t"].dtype == np.uint32 and raw["t"].shape == (2,)

@case
def int64_without_x64_as_orbax():
    assert not jax.config.jax_enable_x64
    p = d()
    H.save(p, args=ocp.args.StandardSave({"i": np.arange(6, dtype=np.int64), "big": np.array([2**40])}))
    rep = NamedSharding(mesh, P())
    r = H.restore(p, args=ocp.args.StandardRestore({"i": jax.ShapeDtypeStruct((6,), np.int64)}))
    assert isinstance(r["i"], np.ndarray) and r["i"].dtype == np.int64
    r = H.restore(p, args=ocp.args.StandardRestore({"i": jax.ShapeDtypeStruct((6,), np.int64, sharding=rep)}))
    assert r["i"].dtype == jnp.int32 and np.asarray(r["i"]).tolist() == list(range(6))
    try:
        H.restore(p, args=ocp.args.StandardRestore({"big": jax.ShapeDtypeStruct((1,), np.int64, sharding=rep)}))
        raise AssertionError("a value over int32 was narrowed")
    except ValueError as e:
        assert "SP-DTYPE-2" in str(e)

@case
def orbax_errors():
    p = d()
    for item, what in ((None, "Must provide item"), ({}, "Found empty item"),
                       ({"s": "text", "w": w}, "Unsupported type")):
        try:
            H.save(p, args=ocp.args.StandardSave(item))
        except ValueError as e:
            assert what in str(e) and isinstance(e, ShardpointError), e
        else:
            raise AssertionError(f"{what}: no error")
    H.save(p, args=ocp.args.StandardSave({"w": w}))
    try:
        H.restore(p, args=ocp.args.StandardRestore({"w": w, "s": "text"}))
        raise AssertionError("unsupported restore type accepted")
    except ValueError as e:
        assert "Unsupported type" in str(e)

@case
def one_argument_switch():
    p = os.path.join(root, "std")
    with spo.StandardCheckpointer() as ck:      # was: ocp.StandardCheckpointer()
        ck.save(p, {"w": w, "step": 3})
        ck.wait_until_finished()
        r = ck.restore(p, {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=w.sharding), "step": 0})
    assert r["step"] == 3 and (np.asarray(r["w"]) == np.asarray(w)).all()
    assert os.path.isfile(os.path.join(p, "shardpoint", "manifest.msgpack"))
    mgr = ocp.CheckpointManager(os.path.join(root, "mgr"))
    mgr.save(1, args=spo.StandardSave({"w": w}))   # was: ocp.args.StandardSave
    mgr.wait_until_finished()
    r = mgr.restore(1, args=spo.StandardRestore(None))
    mgr.close()
    assert r["w"].sharding.is_equivalent_to(w.sharding, 2)
    assert os.path.isfile(os.path.join(root, "mgr", "1", "default", "shardpoint", "manifest.msgpack"))

@case
def shardpoint_save_takes_orbax_arguments():
    from shardpoint_jax.orbax_handler import ShardpointHandler, ShardpointRestore, ShardpointSave
    from shardpoint_core.transactions.resolve import read_metadata
    h, p = ShardpointHandler(), d()
    k = jax.random.key(7)
    h.save(p, args=ShardpointSave({"w": w, "name": "run-1", "k": k, "m": optax.MaskedNode()},
                                  save_args={"w": ocp.SaveArgs(dtype=jnp.bfloat16), "name": None,
                                             "k": None, "m": None},
                                  custom_metadata={"epoch": 2}))
    md = h.metadata(p)
    assert md.tensors["w"].dtype == "bfloat16" and md.extensions["orbax"]["custom_metadata"] == {"epoch": 2}
    assert tuple(md.format_version) == (1, 4) and md.packed is not None  # the default: packed
    r = h.restore(p)                       # no target: the saved sharding, keys as keys
    assert r["w"].dtype == jnp.bfloat16 and r["w"].sharding.is_equivalent_to(w.sharding, 2)
    assert r["name"] == "run-1" and r["m"] is None
    assert (np.asarray(jax.random.key_data(r["k"])) == np.asarray(jax.random.key_data(k))).all()
    t = {"w": jax.ShapeDtypeStruct((4, 4), jnp.bfloat16, sharding=w.sharding), "name": "",
         "k": jax.random.key(0), "m": None}
    r = h.restore(p, args=ShardpointRestore(t, strict=False))
    assert np.asarray(r["w"]).astype(np.float32).tolist() == np.asarray(w)[:4].tolist()

@case
def empty_nodes_and_flax_structs():
    import flax
    p = d()
    item = {"a": {}, "b": 3, "c": None, "e": []}
    H.save(p, args=ocp.args.StandardSave(item))
    assert H.restore(p, args=ocp.args.StandardRestore(item)) == item
    assert H.restore(p) == item

    @flax.struct.dataclass
    class Params:
        params: dict
        opt_state: tuple
    rep = NamedSharding(mesh, P())
    st = Params({"w": put(np.ones((8, 4), np.float32), P()), "n": np.arange(3)},
                (optax.EmptyState(), optax.EmptyState()))
    p = d()
    H.save(p, args=ocp.args.StandardSave(st))
    tgt = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), st)
    r = H.restore(p, args=ocp.args.StandardRestore(tgt))
    assert type(r) is Params and r.opt_state == (optax.EmptyState(), optax.EmptyState())
    assert (np.asarray(r.params["w"]) == 1).all() and np.asarray(r.params["n"]).tolist() == [0, 1, 2]

@case
def pytree_restore_args_per_leaf():
    # Orbax's PyTreeRestore(restore_args=...): each leaf's RestoreArgs win over the item's leaf
    # (the values below are what Orbax's PyTreeCheckpointHandler returns for the same calls)
    p = d()
    a = put(np.arange(8, dtype=np.int32), P(None))
    H.save(p, args=ocp.args.PyTreeSave({"w": w, "a": a, "n": np.arange(3, dtype=np.int64)}))
    cols = NamedSharding(mesh, P(None, "x"))
    ra = {"w": ocp.ArrayRestoreArgs(sharding=cols, dtype=jnp.bfloat16),
          "a": ocp.ArrayRestoreArgs(mesh=mesh, mesh_axes=P("y"), global_shape=(12,), strict=False),
          "n": ocp.RestoreArgs(restore_type=np.ndarray, dtype=np.int32)}
    for item in (None, {"w": w, "a": a, "n": np.zeros(3)}):
        r = H.restore(p, args=ocp.args.PyTreeRestore(item=item, restore_args=ra))
        assert r["w"].dtype == jnp.bfloat16 and r["w"].sharding == cols, r["w"]
        assert (np.asarray(r["w"]).astype(np.float32) == np.asarray(w)).all()
        assert r["a"].sharding == NamedSharding(mesh, P("y")), r["a"].sharding
        assert np.asarray(r["a"]).tolist() == list(range(8)) + [0] * 4
        assert isinstance(r["n"], np.ndarray) and r["n"].dtype == np.int32, r["n"]
    r = H.restore(p, args=ocp.args.PyTreeRestore(restore_args={
        "w": ocp.RestoreArgs(), "a": ocp.RestoreArgs(dtype=jnp.float32), "n": ocp.RestoreArgs()}))
    assert r["w"].sharding.is_equivalent_to(w.sharding, 2) and r["a"].dtype == jnp.float32
    assert isinstance(r["n"], np.ndarray) and r["n"].dtype == np.int64
    for bad, what in (({**ra, "a": ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=(12,))},
                       "[12]"), ({"w": ra["w"]}, "structure")):
        try:
            H.restore(p, args=ocp.args.PyTreeRestore(restore_args=bad))
            raise AssertionError(f"{what}: no error")
        except ValueError as e:
            assert what in str(e) and isinstance(e, ShardpointError), e
    try:
        H.restore(p, args=ocp.args.PyTreeRestore(restore_args=ra, transforms={"w": 1}))
        raise AssertionError("transforms accepted")
    except ValueError as e:
        assert "transforms" in str(e), e

@case
def pytree_checkpointer_switch():
    p = os.path.join(root, "pytree")
    ck = spo.PyTreeCheckpointer()            # was: ocp.PyTreeCheckpointer()
    ck.save(p, {"w": w, "name": "run-1"})
    cols = NamedSharding(mesh, P(None, "x"))
    r = ck.restore(p, restore_args={"w": ocp.ArrayRestoreArgs(sharding=cols), "name": ocp.RestoreArgs()})
    assert r["name"] == "run-1" and r["w"].sharding == cols
    assert (np.asarray(r["w"]) == np.asarray(w)).all()
    assert os.path.isfile(os.path.join(p, "shardpoint", "manifest.msgpack"))
    mgr = ocp.CheckpointManager(os.path.join(root, "mgr_pytree"))
    mgr.save(1, args=spo.PyTreeSave({"w": w}))          # was: ocp.args.PyTreeSave
    mgr.wait_until_finished()
    r = mgr.restore(1, args=spo.PyTreeRestore(restore_args={"w": ocp.ArrayRestoreArgs(sharding=cols)}))
    mgr.close()
    assert r["w"].sharding == cols

print("RESULTS " + json.dumps(out))
"""

CASES = [
    "save_args_cast",
    "custom_metadata",
    "no_target_keeps_saved_sharding",
    "topology_mismatch",
    "strict_false_truncates_and_pads",
    "masked_and_none_leaves",
    "prng_keys",
    "int64_without_x64_as_orbax",
    "orbax_errors",
    "one_argument_switch",
    "shardpoint_save_takes_orbax_arguments",
    "empty_nodes_and_flax_structs",
    "pytree_restore_args_per_leaf",
    "pytree_checkpointer_switch",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("orbax_std")
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        JAX_PLATFORMS="cpu",
        OMP_NUM_THREADS="1",
    )
    env.pop("JAX_ENABLE_X64", None)
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(root)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert line, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(line[0][len("RESULTS ") :])


@pytest.mark.parametrize("case", CASES)
def test_orbax_standard_semantics(results, case):
    assert results.get(case) == "ok", results.get(case)
