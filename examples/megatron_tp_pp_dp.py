"""A Megatron-style loop: TP x PP x DP on gloo, checkpointing through the manager.

Each pipeline stage holds some blocks (keyed by their *global* index, so any stage count can
load them); each block is a column-parallel then a row-parallel linear split over TP; every DP
rank owns a flattened range of each local weight's momentum (a distributed optimizer). Run it
again, with another DP size if you like, and it resumes from the newest complete step.

    torchrun --nproc-per-node 8 examples/megatron_tp_pp_dp.py CKPT_DIR STEPS   # TP2 PP2 DP2
    python examples/megatron_tp_pp_dp.py CKPT_DIR STEPS [RANKS]   # forks RANKS local ranks
"""

import sys

import torch
import torch.distributed as dist

import shardpoint as sp
from shardpoint.api import state as sps

TP, PP, BLOCKS, H, LR, MOM = 2, 2, 4, 16, 0.02, 0.9
BATCH = 8  # samples per step, split evenly over the DP ranks


def world_problem(world):
    """Why this example cannot run on ``world`` ranks ('' when it can): TP x PP x DP ranks,
    with DP dividing the batch (other sizes hung or crashed in the pipeline's send/recv)."""
    if world % (TP * PP) or BATCH % (world // (TP * PP) or 1) or world < TP * PP:
        ok = ", ".join(str(TP * PP * dp) for dp in range(1, BATCH + 1) if BATCH % dp == 0)
        return (
            f"this example runs on TP x PP x DP = {TP} x {PP} x DP ranks with DP dividing "
            f"the batch of {BATCH}: {ok} ranks, not {world}"
        )
    return ""


def groups(rank, world):
    """Rank = (d * PP + p) * TP + t. Every rank creates every group in the same order."""
    dp = world // (TP * PP)
    t, p, d = rank % TP, rank // TP % PP, rank // (TP * PP)
    mine = {}
    for dd in range(dp):
        for pp in range(PP):
            g = dist.new_group([(dd * PP + pp) * TP + tt for tt in range(TP)])
            mine["tp"] = g if (dd, pp) == (d, p) else mine.get("tp")
    for pp in range(PP):
        for tt in range(TP):
            g = dist.new_group([(dd * PP + pp) * TP + tt for dd in range(dp)])
            mine["dp"] = g if (pp, tt) == (p, t) else mine.get("dp")
    return t, p, d, dp, mine


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world_problem(world):  # every rank sees the same world: all stop
        if rank == 0:
            print(world_problem(world), file=sys.stderr)
        dist.destroy_process_group()
        sys.exit(2)
    root, steps = sys.argv[1], int(sys.argv[2])
    t, p, d, dp, g = groups(rank, world)
    per_stage = BLOCKS // PP
    mine = range(p * per_stage, (p + 1) * per_stage)  # global block indices
    # (name, global shape, TP-split dim): fc1 [2H, H] by rows, fc2 [H, 2H] by columns
    specs = [
        (f"blocks.{b}.{n}", shape, dim)
        for b in mine
        for n, shape, dim in (("fc1", (2 * H, H), 0), ("fc2", (H, 2 * H), 1))
    ]
    w, mom, rng = {}, {}, {}
    for name, shape, dim in specs:
        full = torch.randn(shape, generator=torch.Generator().manual_seed(sum(map(ord, name))))
        n = shape[dim] // TP
        w[name] = full.narrow(dim, t * n, n).clone().mul_(0.1).requires_grad_()
        k = w[name].numel()
        rng[name] = (d * k // dp, (d + 1) * k // dp)
        mom[name] = torch.zeros(rng[name][1] - rng[name][0])

    def state(step):
        model, optim = {}, {}
        for name, shape, dim in specs:
            off = tuple(t * shape[dim] // TP if i == dim else 0 for i in range(2))
            model[name] = sp.ShardedTensor(w[name].detach(), shape, off, replica_id=d)
            optim[name] = sps.flattened_shard(
                mom[name], w[name].shape, rng[name][0], global_shape=shape, global_offset=off
            )
        return {"model": model, "momentum": optim, "step": step}

    mgr = sp.CheckpointManager(root, max_to_keep=2)
    step = 0
    if mgr.latest_step() is not None:
        step = mgr.load(like=state(0))["step"]
        if rank == 0:
            print(f"resumed at step {step} with TP={TP} PP={PP} DP={dp}")
    data = torch.Generator().manual_seed(0)
    x_all, y_all = torch.randn(BATCH, H, generator=data), torch.randn(BATCH, H, generator=data)
    while step < steps:
        step += 1
        part = slice(d * BATCH // dp, (d + 1) * BATCH // dp)
        x = x_all[part] if p == 0 else torch.empty(BATCH // dp, H)
        if p > 0:
            dist.recv(x, src=rank - TP)  # activations from the stage before
        x.requires_grad_(p > 0)
        h = x
        for b in mine:
            a = torch.relu(Copy.apply(h, g["tp"]) @ w[f"blocks.{b}.fc1"].T)
            out = a @ w[f"blocks.{b}.fc2"].T  # partial sums over TP
            h = h + AllReduce.apply(out, g["tp"])
        if p < PP - 1:
            dist.send(h.detach(), dst=rank + TP)
            grad = torch.empty_like(h)
            dist.recv(grad, src=rank + TP)
            h.backward(grad)
        else:
            loss = torch.nn.functional.mse_loss(h, y_all[part])
            loss.backward()
        if p > 0:
            dist.send(x.grad, dst=rank - TP)
        for name in w:  # distributed momentum SGD
            grad = w[name].grad.reshape(-1).clone()
            dist.all_reduce(grad, group=g["dp"])
            a, b = rng[name]
            mom[name].mul_(MOM).add_(grad[a:b] / dp)
            flat = torch.zeros(grad.numel())
            flat[a:b] = w[name].detach().reshape(-1)[a:b] - LR * mom[name]
            dist.all_reduce(flat, group=g["dp"])
            w[name].data.copy_(flat.view_as(w[name]))
            w[name].grad = None
        if p == PP - 1 and t == 0 and d == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if step % 2 == 0:
            mgr.save(step, state(step))
    mgr.close()
    dist.destroy_process_group()


class AllReduce(torch.autograd.Function):
    """Row-parallel output: sum the partial results over TP; the gradient passes through."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Copy(torch.autograd.Function):
    """Column-parallel input: the same on every TP rank; its gradient is summed over TP."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


if __name__ == "__main__":
    from launch_local import run_local

    ranks = int(sys.argv[3]) if len(sys.argv) > 3 else TP * PP * 2
    if world_problem(ranks):  # before forking anything
        sys.exit(world_problem(ranks))
    run_local(main, ranks)
