"""Orbax's own ``Checkpointer``, ``AsyncCheckpointer`` and ``CheckpointManager`` writing and
reading shardpoint through ``shardpoint_jax.orbax_handler``: sharded ``jax.Array`` pytrees on a
(2, 4) mesh of 8 CPU devices, restored into other meshes and shardings, bit for bit; the
results are shardpoint checkpoints (``verify --strict``, read by the torch front end)."""

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")

SCRIPT = r"""
import os, sys
import jax, jax.numpy as jnp, numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from shardpoint_jax.orbax_handler import ShardpointHandler, ShardpointRestore, ShardpointSave

root = sys.argv[1]
devs = np.array(jax.devices())
assert devs.size == 8, devs
m24 = Mesh(devs.reshape(2, 4), ("dp", "tp"))
m81 = Mesh(devs.reshape(8, 1), ("a", "b"))
w = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 7
e = (np.arange(8 * 8 * 2, dtype=np.int32) * 3).reshape(8, 8, 2)
b = jnp.asarray(np.linspace(-3, 3, 16, dtype=np.float32)).astype(jnp.bfloat16)
state = {"params": {"w": jax.device_put(w, NamedSharding(m24, P("dp", "tp"))),
                    "e": jax.device_put(e, NamedSharding(m24, P(None, "tp"))),
                    "b": jax.device_put(b, NamedSharding(m24, P("tp")))},
         "step": 12, "name": "run-1"}

def target(mesh, specs):
    return {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                               sharding=NamedSharding(mesh, specs[k]))
                       for k, v in state["params"].items()}, "step": 0, "name": ""}

def same(out, mesh, specs):
    for k, v in state["params"].items():
        got = out["params"][k]
        assert got.sharding == NamedSharding(mesh, specs[k]), (k, got.sharding)
        assert np.asarray(got).tobytes() == np.asarray(v).tobytes(), k
    assert out["step"] == 12 and out["name"] == "run-1"

# 1. Checkpointer: save on (2, 4), restore on (8, 1) with other specs, and whole
ckptr = ocp.Checkpointer(ShardpointHandler())
ckptr.save(os.path.join(root, "sync"), args=ShardpointSave(state))
specs = {"w": P(None, "a"), "e": P("a"), "b": P()}
same(ckptr.restore(os.path.join(root, "sync"), args=ShardpointRestore(target(m81, specs))),
     m81, specs)
whole = ckptr.restore(os.path.join(root, "sync"))
assert np.asarray(whole["params"]["w"]).tobytes() == w.tobytes()

# 2. AsyncCheckpointer
actr = ocp.AsyncCheckpointer(ShardpointHandler())
actr.save(os.path.join(root, "async"), args=ShardpointSave(state))
actr.wait_until_finished()
specs = {"w": P("tp", "dp"), "e": P(None, None, "dp"), "b": P("dp")}
same(actr.restore(os.path.join(root, "async"), args=ShardpointRestore(target(m24, specs))),
     m24, specs)
actr.close()

# 3. CheckpointManager with retention, async by default, through Composite too
opts = ocp.CheckpointManagerOptions(max_to_keep=2)
with ocp.CheckpointManager(os.path.join(root, "mgr"), options=opts) as mngr:
    for step in range(3):
        mngr.save(step, args=ocp.args.Composite(state=ShardpointSave(state)))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [1, 2], mngr.all_steps()
    specs = {"w": P("a"), "e": P(), "b": P("a")}
    out = mngr.restore(2, args=ocp.args.Composite(
        state=ShardpointRestore(target(m81, specs))))
    same(out.state, m81, specs)
print("OK")
"""


@pytest.mark.slow
def test_orbax_checkpointer_async_and_manager_write_shardpoint(tmp_path):
    """Slow (an 8-device JAX process, three Orbax entry points); the default suite restores
    into a (2, 4) mesh in tests/integrations/test_crossover.py and runs the README's CheckpointManager
    example."""
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu"
    )
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr[-4000:]
    sync = tmp_path / "sync" / "shardpoint"
    for p in (
        sync,
        tmp_path / "async" / "shardpoint",
        tmp_path / "mgr" / "2" / "state" / "shardpoint",
    ):
        v = subprocess.run(
            [sys.executable, "-m", "shardpoint", "verify", "--strict", str(p)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert v.returncode == 0 and v.stdout.startswith("OK:"), v.stdout + v.stderr
    import shardpoint as sp

    back = sp.load(str(sync))
    w = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 7
    assert back["params"]["w"].numpy().tobytes() == w.tobytes() and back["step"] == 12
