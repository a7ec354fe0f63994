"""Cross-framework round trip, JAX <-> PyTorch, each side its own front end on the shared core
(tree walking, planning, I/O and commit are each front end's own): a PyTorch job on 4 gloo ranks saves a TP x DP sharded model and its AdamW state
with the reference; 2 JAX processes with 4 CPU devices each load it into a (2, 4) mesh with
another partitioning, take a step and save with shardpoint_jax; the reference loads that on 3
ranks in a third layout. Every tensor is compared bit for bit at every stage."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("jax", reason="shardpoint_jax needs jax (pip install -e '.[jax]')")
torch = pytest.importorskip("torch")

from shardpoint_testing.launch import run_world  # noqa: E402
from shardpoint_core.format.manifest import array_path_for  # noqa: E402
from shardpoint_core.transactions.resolve import read_metadata  # noqa: E402
from shardpoint_jax.launch import run_processes  # noqa: E402

from .jax_interop_torch import full_state, torch_load, torch_save  # noqa: E402

JAX_STEP = """
import json, numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import shardpoint_jax as sj
exp = {k: np.load(f"{EXP}/{i}.npy") for i, k in enumerate(KEYS)}
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
SPECS = {"0.weight": P("b", None), "0.bias": P("b"), "1.weight": P("a", "b"), "1.bias": P("a")}
def spec_of(key):
    return SPECS[key.split("/")[1]] if key.startswith("model/") else \\
        P() if key.endswith("/step") else SPECS[NAMES[int(key.split("/")[2])]]
def abstract(key):
    return jax.ShapeDtypeStruct(exp[key].shape, exp[key].dtype,
                                sharding=NamedSharding(mesh, spec_of(key)))
tgt = {"model": {n: abstract(f"model/{n}") for n in NAMES},
       "optim": {"state": {i: {f: abstract(f"optim/state/{i}/{f}")
                               for f in ("step", "exp_avg", "exp_avg_sq")}
                           for i in range(len(NAMES))}},
       "iteration": None}
got = sj.load(CKPT, tgt)
checked = 0
for k in KEYS:
    node = got
    for c in k.split("/"):
        node = node[int(c) if c.isdigit() else c]
    assert node.sharding.spec == spec_of(k), k
    for s in node.addressable_shards:
        assert np.asarray(s.data).tobytes() == exp[k][s.index].tobytes(), (k, s.index)
        checked += 1
step = jax.jit(lambda w, m: (w - 0.5 * m, m * 0.5))
model, state = {}, {}
for i, n in enumerate(NAMES):
    st = got["optim"]["state"][i]
    model[n], m = step(got["model"][n], st["exp_avg"])
    state[i] = {"step": st["step"] + 1, "exp_avg": m, "exp_avg_sq": st["exp_avg_sq"]}
sj.save(OUT, {"model": model, "optim": {"state": state}, "iteration": got["iteration"] + 1})
print(json.dumps({"checked": checked}))
"""


def test_torch_to_jax_to_torch_bitwise(tmp_path):
    msd, osd = full_state()
    names = list(msd)
    expected = {f"model/{k}": v.numpy() for k, v in msd.items()}
    for i, st in osd["state"].items():
        for f, v in st.items():
            expected[f"optim/state/{i}/{f}"] = v.numpy()
    keys = sorted(expected)
    (tmp_path / "exp").mkdir()
    for i, k in enumerate(keys):
        np.save(tmp_path / "exp" / f"{i}.npy", expected[k])

    assert run_world(4, torch_save, str(tmp_path / "torch"), timeout=300) == [0, 1, 2, 3]
    code = (
        JAX_STEP.replace("EXP", repr(str(tmp_path / "exp")))
        .replace("KEYS", repr(keys))
        .replace("NAMES", repr(names))
        .replace("CKPT", repr(str(tmp_path / "torch")))
        .replace("OUT", repr(str(tmp_path / "jax")))
    )
    outs = run_processes(code, 2, 4, timeout=300)
    checked = [json.loads(o.strip().splitlines()[-1])["checked"] for o in outs]
    assert checked == [len(keys) * 4] * 2  # every addressable shard of every tensor

    after = dict(expected)
    for i, n in enumerate(names):
        w, m = expected[f"model/{n}"], expected[f"optim/state/{i}/exp_avg"]
        after[f"model/{n}"] = w - np.float32(0.5) * m
        after[f"optim/state/{i}/exp_avg"] = m * np.float32(0.5)
        after[f"optim/state/{i}/step"] = expected[f"optim/state/{i}/step"] + np.float32(1)
    results = run_world(3, torch_load, str(tmp_path / "jax"), timeout=300)
    for out, iteration in results:
        assert iteration == 2
        assert set(out) == set(keys)
        for k, (data, off, shape) in out.items():
            want = after[k][tuple(slice(o, o + s) for o, s in zip(off, shape))]
            assert data == np.ascontiguousarray(want).tobytes(), k
    # The JAX writer used its own layout: the (2, 4) mesh blocks are the chunk grid (packed,
    # the default: in the manifest; each block one record, written once by its process).
    m = read_metadata(str(tmp_path / "jax"))
    assert m.format_version == (1, 4)
    entry = m.tensors["model/1.weight"]
    assert entry.chunk_shape == (3, 2) and entry.array == array_path_for("model/1.weight")
    assert len(entry.packed.records) == math.prod(-(-n // c) for n, c in zip(entry.shape, (3, 2)))
    assert len(m.packed.objects) == 2  # one data object per JAX process
