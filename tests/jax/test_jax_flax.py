"""Flax: an nnx model sharded over a (2, 4) mesh of 8 CPU devices and its optax AdamW state
after one real step, saved as the `nnx.State`s flax hands out, restored through an abstract
model (`nnx.eval_shape`) into a (4, 2) mesh of the devices in another order: every shard's
bits, the requested shardings, flax's own types, and a next step bitwise equal to the
original's. The PyTorch reference reads the same checkpoint by the same key paths. Flax
structs (a linen TrainState) and typed PRNG keys (nnx RNG state) get their own test."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytest.importorskip("jax", reason="shardpoint_jax needs jax (pip install -e '.[jax]')")
pytest.importorskip("flax", reason="the flax tests need flax (pip install -e '.[jax-test]')")
pytest.importorskip("optax", reason="the flax tests need optax (pip install -e '.[jax-test]')")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import shardpoint_jax as spj  # noqa: E402
from shardpoint_jax.errors import UnsupportedValueError  # noqa: E402
from shardpoint_jax.launch import run_processes  # noqa: E402
from shardpoint_testing.tensors import as_bytes, same_bits  # noqa: E402

CODE = """
import json, numpy as np, jax, jax.numpy as jnp, optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import shardpoint_jax as spj
from shardpoint_testing.tensors import as_bytes, same_bits

devs = np.array(jax.devices())
mesh_a = Mesh(devs.reshape(2, 4), ("data", "model"))
mesh_b = Mesh(devs[::-1].reshape(4, 2), ("data", "model"))
init = nnx.initializers.lecun_normal()

class Block(nnx.Module):
    '''A transformer MLP block: up (columns over "model"), LayerNorm, GELU, down (rows over
    "model", kept in bf16).'''
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 32, kernel_init=nnx.with_partitioning(init, (None, "model")),
                             bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(),
                                                             ("model",)), rngs=rngs)
        self.norm = nnx.LayerNorm(32, rngs=rngs)
        self.down = nnx.Linear(32, 16, kernel_init=nnx.with_partitioning(init, ("model", None)),
                               param_dtype=jnp.bfloat16, rngs=rngs)
    def __call__(self, x):
        return self.down(jax.nn.gelu(self.norm(self.up(x))))

def create():
    model = Block(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

@nnx.jit
def train_step(model, opt, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - jnp.sin(x)) ** 2))(model)
    opt.update(model, grads)
    return loss

def bits(tree):
    return [as_bytes(x) for x in jax.tree.leaves(tree)]

batch = np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32)
with jax.set_mesh(mesh_a):
    model, opt = create()
    train_step(model, opt, jax.device_put(batch, NamedSharding(mesh_a, P("data"))))
state = {"model": nnx.state(model), "optimizer": nnx.state(opt), "step": 1}
saved = [np.asarray(x) for x in jax.tree.leaves(state)]
blocks = [x.sharding.shard_shape(x.shape) for x in jax.tree.leaves(state)[:-1]]
paths = ["/".join(str(getattr(k, a)) for k in p for a in ("key", "idx", "name") if hasattr(k, a))
         for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
np.savez(OUT + ".npz", **{f"{i}": x.reshape(-1).view(np.uint8) for i, x in enumerate(saved)})
spj.save(PATH, state)

# Restore: an abstract model and optimizer built under the new mesh give the target.
with jax.set_mesh(mesh_b):
    (gm, am), (go, ao) = map(nnx.split, nnx.eval_shape(create))
def place(s):
    return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh_b, s.sharding.spec))
target = jax.tree.map(place, {"model": am, "optimizer": ao})
got = spj.load(PATH, dict(target, step=0))
assert got.pop("step") == 1
tgt, leaves = jax.tree.leaves(target), jax.tree.leaves(got)
assert jax.tree.structure(got) == jax.tree.structure(target)
shards = resharded = 0
for a, t, want, block in zip(leaves, tgt, saved, blocks):
    assert a.sharding == t.sharding, (a.sharding, t.sharding)
    assert a.dtype == want.dtype and a.shape == want.shape
    for s in a.addressable_shards:
        assert same_bits(s.data, want[s.index])
        shards += 1
    resharded += a.sharding.shard_shape(a.shape) != block

# One more step: the restored pair, and the original moved to the same placement in memory
# (continued on mesh_a instead it differs in the last bits: the sums run in another order).
restored = nnx.merge(gm, got["model"]), nnx.merge(go, got["optimizer"])
moved = [jax.device_put(x, t.sharding) for x, t in zip(jax.tree.leaves(state)[:-1], tgt)]
moved = jax.tree.unflatten(jax.tree.structure(target), moved)
original = nnx.merge(gm, moved["model"]), nnx.merge(go, moved["optimizer"])
with jax.set_mesh(mesh_b):
    xb = jax.device_put(batch, NamedSharding(mesh_b, P("data")))
    loss_r, loss_o = train_step(*restored, xb), train_step(*original, xb)
after_r, after_o = nnx.state(restored), nnx.state(original)
same_step = bits(after_r) == bits(after_o) and bits(loss_r) == bits(loss_o)
changed = sum(a != b for a, b in zip(bits(after_r), bits(saved[:-1])))
print(json.dumps({"paths": paths, "shards": shards, "resharded": resharded,
                  "same_step": same_step, "changed": changed,
                  "types": [type(got["model"]).__name__,
                            type(got["model"]["up"]["kernel"]).__name__, type(restored[1]).__name__],
                  "dtypes": [str(x.dtype) for x in saved], "shapes": [x.shape for x in saved]}))
"""


def flat(tree, prefix=""):
    """{"a/b/0": leaf} of a loaded nested dict/list tree."""
    items = (
        tree.items()
        if isinstance(tree, dict)
        else enumerate(tree)
        if isinstance(tree, (list, tuple))
        else None
    )
    if items is None:
        return {prefix[:-1]: tree}
    out = {}
    for k, v in items:
        out.update(flat(v, f"{prefix}{k}/"))
    return out


def test_nnx_model_and_optax_state_restore_into_another_mesh(tmp_path):
    ck, out = tmp_path / "ck", tmp_path / "saved"
    stdout = run_processes(
        CODE.replace("PATH", repr(str(ck))).replace("OUT", repr(str(out))), 1, 8, timeout=300
    )
    res = json.loads(stdout[0].strip().splitlines()[-1])
    # 6 params, 12 AdamW moments, the Adam count and the optimizer's step; 8 shards each.
    assert len(res["paths"]) == 21 and res["shards"] == 20 * 8, res
    assert res["resharded"] >= 9, res  # "model" went from 4 devices to 2: up, down x 3
    assert res["same_step"] and res["changed"] >= 18, res
    assert res["types"] == ["State", "Param", "Optimizer"], res
    # Variables are dict nodes keyed by their attribute ("value"), as in JAX's own key paths.
    assert {
        "model/up/kernel/value",
        "model/down/kernel/value",
        "model/norm/scale/value",
        "optimizer/opt_state/0/mu/up/kernel/value",
        "optimizer/opt_state/0/count/value",
        "optimizer/step/value",
        "step",
    } <= set(res["paths"])
    assert "bfloat16" in res["dtypes"] and "uint32" in res["dtypes"]

    # The PyTorch reference reads the JAX checkpoint whole, by the same key paths.
    import shardpoint

    got = flat(shardpoint.load(str(ck)))
    assert sorted(got) == sorted(res["paths"])
    saved = np.load(str(out) + ".npz")
    for i, key in enumerate(res["paths"][:-1]):
        t = got[key]
        assert str(t.dtype) == "torch." + res["dtypes"][i] and list(t.shape) == res["shapes"][i]
        assert as_bytes(t)[2] == saved[str(i)].tobytes(), key
    assert got["step"] == 1


def test_flax_struct_and_nnx_rng_state(tmp_path):
    """A linen ``TrainState`` (a ``flax.struct`` dataclass: apply_fn and tx static) is a dict
    node of its fields and comes back as a TrainState; nnx RNG state holds typed PRNG keys,
    which the format has no dtype for: refused before anything is written, saying how."""
    from flax.training.train_state import TrainState

    params = {"dense": {"kernel": jnp.arange(6.0).reshape(2, 3), "bias": jnp.ones(3)}}
    ts = TrainState.create(apply_fn=lambda p, x: x, params=params, tx=optax.adam(1e-3))
    grads = jax.tree.map(jnp.ones_like, params)
    ts = ts.apply_gradients(grads=grads)
    spj.save(str(tmp_path / "ts"), {"train": ts})
    plain = spj.load(str(tmp_path / "ts"))["train"]
    assert list(plain) == ["step", "params", "opt_state"]
    assert plain["step"] == 1 and plain["opt_state"][0][0] == 1  # optax's namedtuples: lists
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, ts
    )
    back = spj.load(str(tmp_path / "ts"), {"train": abstract})["train"]
    assert type(back) is TrainState and back.apply_fn is not None
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(ts)):
        assert same_bits(a, b)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(2, 3, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

    net = Net(nnx.Rngs(0, dropout=1))
    with pytest.raises(
        UnsupportedValueError, match=r"model/drop/rngs/key/value.*key_data.*nnx.Param"
    ):
        spj.save(str(tmp_path / "rng"), {"model": nnx.state(net)})
    assert not os.path.exists(tmp_path / "rng")
    spj.save(str(tmp_path / "params"), {"model": nnx.state(net, nnx.Param)})
    assert sorted(flat(spj.load(str(tmp_path / "params")))) == [
        "model/lin/bias/value",
        "model/lin/kernel/value",
    ]
    key_like = jax.ShapeDtypeStruct((2, 3), jax.random.key(0).dtype)
    with pytest.raises(UnsupportedValueError, match=r"model/lin/kernel/value.*key_data"):
        spj.load(str(tmp_path / "params"), {"model": {"lin": {"kernel": {"value": key_like}}}})
    pure = nnx.to_pure_dict(nnx.state(net, nnx.Param))  # no "/value": torch-style names
    spj.save(str(tmp_path / "pure"), {"model": pure})
    assert sorted(flat(spj.load(str(tmp_path / "pure")))) == ["model/lin/bias", "model/lin/kernel"]
