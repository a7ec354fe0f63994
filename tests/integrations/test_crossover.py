"""A checkpoint written through one incumbent's API loads through the others', bit for bit:
DCP (``dcp.save`` + ``ShardpointWriter``) on 2 ranks -> Megatron (``dist_checkpointing.load``,
``shardpoint`` backend) on 3 ranks -> Orbax (``Checkpointer`` + ``ShardpointHandler``) into a
(2, 4) mesh; and back: Megatron's save on 3 ranks -> Orbax restore, Orbax's save -> DCP load.
Tensors sit where the Megatron integration puts them (``sharded/<Megatron key>``), which is the
DCP FQN ``sharded.<key>`` of ``{"sharded": {key: tensor}}``."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from shardpoint_testing.launch import run_world
from shardpoint_testing.tensors import same_bits, seeded_randn

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None or importlib.util.find_spec("orbax") is None,
    reason="megatron-core and orbax-checkpoint are needed",
)

W, E = "decoder.linear.weight", "embedding.weight"


def _full():
    return {W: seeded_randn(W, (6, 8), torch.bfloat16), E: seeded_randn(E, (4, 12))}


def _dcp_save(rank, world, root):
    import warnings

    warnings.simplefilter("ignore")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from shardpoint.dcp import ShardpointWriter

    mesh = init_device_mesh("cpu", (world,))
    f = _full()
    state = {
        "sharded": {
            W: distribute_tensor(f[W], mesh, [Shard(0)]),
            E: distribute_tensor(f[E], mesh, [Shard(1)]),
        }
    }
    dcp.save(state, storage_writer=ShardpointWriter(os.path.join(root, "dcp", "shardpoint")))
    if rank == 0:  # what makes a directory a Megatron checkpoint: its metadata.json
        save_config(CheckpointingConfig("shardpoint", 1), os.path.join(root, "dcp"))
    return True


def _megatron_load_then_save(rank, world, root):
    import warnings

    warnings.simplefilter("ignore")
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    import shardpoint.integrations.megatron_strategy  # noqa: F401 - registers the backend

    f = _full()
    # W rows split over 3 (TP-row), E columns split over 3 (TP-column)
    ssd = {
        "w": ShardedTensor.from_rank_offsets(
            W, torch.zeros(2, 8, dtype=torch.bfloat16), (0, rank, world)
        ),
        "e": ShardedTensor.from_rank_offsets(E, torch.zeros(4, 4), (1, rank, world)),
    }
    out = dist_checkpointing.load(ssd, os.path.join(root, "dcp"))
    ok = same_bits(out["w"], f[W][2 * rank : 2 * rank + 2]) and same_bits(
        out["e"], f[E][:, 4 * rank : 4 * rank + 4]
    )
    meg = os.path.join(root, "meg")
    if rank == 0:
        os.makedirs(meg)
    dist.barrier()
    dist_checkpointing.save(ssd, meg, sharded_strategy=("shardpoint", 1))
    return ok


ORBAX = r"""
import sys, numpy as np, jax, ml_dtypes
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from shardpoint_jax.orbax_handler import ShardpointHandler, ShardpointRestore, ShardpointSave
root, want_w, want_e = sys.argv[1], np.load(sys.argv[2]), np.load(sys.argv[3])
want_w = want_w.view(ml_dtypes.bfloat16)
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("dp", "tp"))
W, E = "decoder.linear.weight", "embedding.weight"
target = {"sharded": {
    W: jax.ShapeDtypeStruct((6, 8), want_w.dtype, sharding=NamedSharding(mesh, P("dp", "tp"))),
    E: jax.ShapeDtypeStruct((4, 12), np.float32, sharding=NamedSharding(mesh, P("dp", "tp")))}}
ckptr = ocp.Checkpointer(ShardpointHandler())
for name in ("dcp", "meg"):
    out = ckptr.restore(f"{root}/{name}", args=ShardpointRestore(target))
    for k, want in ((W, want_w), (E, want_e)):
        got = out["sharded"][k]
        assert got.sharding == target["sharded"][k].sharding, (name, k)
        assert np.asarray(got).tobytes() == want.tobytes(), (name, k)
ckptr.save(f"{root}/orb", args=ShardpointSave(out))
print("OK")
"""


def test_dcp_to_megatron_to_orbax_and_back(tmp_path):
    import warnings

    assert run_world(2, _dcp_save, str(tmp_path), timeout=180) == [True, True]
    assert run_world(3, _megatron_load_then_save, str(tmp_path), timeout=180) == [True] * 3
    f = _full()
    import numpy as np

    np.save(tmp_path / "w.npy", f[W].view(torch.int16).numpy())
    np.save(tmp_path / "e.npy", f[E].numpy())
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            ORBAX,
            str(tmp_path),
            str(tmp_path / "w.npy"),
            str(tmp_path / "e.npy"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr[-4000:]
    # Orbax's save, read through DCP in one process
    import torch.distributed.checkpoint as dcp
    from shardpoint.dcp import ShardpointReader

    like = {"sharded": {W: torch.zeros(6, 8, dtype=torch.bfloat16), E: torch.zeros(4, 12)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(
            like, storage_reader=ShardpointReader(tmp_path / "orb" / "shardpoint"), no_dist=True
        )
    assert same_bits(like["sharded"][W], f[W]) and same_bits(like["sharded"][E], f[E])
