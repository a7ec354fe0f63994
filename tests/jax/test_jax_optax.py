"""An optax AdamW state (namedtuples around per-parameter pytrees) and its parameters, sharded
over a 2 x 2 mesh, saved and restored into another mesh through an abstract target built with
jax.tree_util: the restored state has optax's own types and every shard's bits."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("jax", reason="shardpoint_jax needs jax (pip install -e '.[jax]')")
pytest.importorskip("optax", reason="the optax test needs optax")

from shardpoint_jax.launch import run_processes  # noqa: E402

CODE = """
import json, numpy as np, jax, jax.numpy as jnp, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import shardpoint_jax as spj
devs = np.array(jax.devices())
mesh = Mesh(devs.reshape(2, 2), ("dp", "tp"))
rows = NamedSharding(mesh, P("tp", None))
params = {"dense": {"kernel": jax.device_put(jnp.arange(32.0).reshape(8, 4) / 7, rows),
                    "bias": jax.device_put(jnp.ones(4, jnp.bfloat16), NamedSharding(mesh, P()))}}
opt = optax.adamw(1e-2)
state = opt.init(params)
grads = jax.tree_util.tree_map(lambda p: jnp.ones_like(p) * 0.25, params)
updates, state = opt.update(grads, state, params)
params = optax.apply_updates(params, updates)
spj.save(PATH, {"params": params, "opt_state": state})
other = Mesh(devs[::-1].reshape(4), ("x",))
def abstract(x):
    spec = P("x") if x.ndim and x.shape[0] % 4 == 0 else P()
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other, spec))
target = jax.tree_util.tree_map(abstract, {"params": params, "opt_state": state})
got = spj.load(PATH, target)
same_types = jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(target)
n = 0
for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves({"params": params, "opt_state": state})):
    assert a.sharding.mesh.devices.tolist() == other.devices.tolist()
    for s in a.addressable_shards:
        assert np.asarray(s.data).tobytes() == np.asarray(b)[s.index].tobytes()
        n += 1
print(json.dumps({"types": same_types, "shards": n,
                  "state_type": type(got["opt_state"][0]).__name__}))
"""


@pytest.mark.slow
def test_optax_state_restores_into_another_mesh(tmp_path):
    out = run_processes(CODE.replace("PATH", repr(str(tmp_path / "ck"))), 1, 4, timeout=300)
    res = json.loads(out[0].strip().splitlines()[-1])
    assert res["types"] and res["state_type"] == "ScaleByAdamState", res
    assert res["shards"] >= 4 * 5
