"""An FSDP2 training loop (``fully_shard`` on a CPU gloo mesh) checkpointing through the
manager; run it again and it resumes. Model and optimizer state travel as DTensors keyed by
parameter name (``torch.distributed.checkpoint.state_dict``), so the resume may use another
number of ranks.

    torchrun --nproc-per-node 2 examples/fsdp2_loop.py CKPT_DIR STEPS
    python examples/fsdp2_loop.py CKPT_DIR STEPS [RANKS]     # forks RANKS local ranks
"""

import sys

import torch
import torch.distributed as dist

import shardpoint as sp
from shardpoint.api import state as sps


def main():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    root, steps = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # same init on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = sp.CheckpointManager(root, max_to_keep=2)
    step = 0
    if mgr.latest_step() is not None:
        like = {
            "model": sps.model_state(model),
            "optim": sps.optimizer_state(model, opt),
            "step": 0,
        }
        out = mgr.load(like=like)  # fills the DTensor shards in place
        sps.set_optimizer_state(model, opt, out["optim"])
        step = out["step"]
        if dist.get_rank() == 0:
            print(f"resumed at step {step} on {dist.get_world_size()} ranks")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)
    rank, world = dist.get_rank(), dist.get_world_size()
    while step < steps:
        step += 1
        part = slice(rank * 64 // world, (rank + 1) * 64 // world)
        loss = torch.nn.functional.mse_loss(model(x[part]), y[part])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}")
        if step % 2 == 0:
            mgr.save(
                step,
                {
                    "model": sps.model_state(model),
                    "optim": sps.optimizer_state(model, opt),
                    "step": step,
                },
            )
    mgr.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    from launch_local import run_local

    run_local(main, int(sys.argv[3]) if len(sys.argv) > 3 else 2)
