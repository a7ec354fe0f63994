"""The PyTorch side of tests/jax/test_jax_interop.py, in a module of its own so that the spawned
torch ranks import neither jax nor pytest (they only need torch and the reference)."""

from __future__ import annotations

import torch

SPLIT = {"0.weight": 0, "0.bias": 0, "1.weight": 1}  # TP dim per param; 1.bias replicated


def full_state():
    """A tiny model after one real AdamW step; the same on every rank (seeded, CPU)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 6))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).square().sum().backward()
    opt.step()
    return model.state_dict(), opt.state_dict()


def piece(t, dim, parts, i, sp, replica_id=0):
    """Part i of ``parts`` of ``t`` along ``dim`` (ceil-div, as torch.chunk) as a ShardedTensor."""
    size = -(-t.shape[dim] // parts)
    lo, hi = min(i * size, t.shape[dim]), min((i + 1) * size, t.shape[dim])
    off = [0] * t.dim()
    off[dim] = lo
    return sp.ShardedTensor(
        t.narrow(dim, lo, hi - lo).clone(), tuple(t.shape), tuple(off), replica_id=replica_id
    )


def torch_save(rank, world, path):
    import shardpoint as sp

    msd, osd = full_state()
    tp, dp = rank % 2, rank // 2

    def shard(name, t):
        if name not in SPLIT:
            return t.clone()  # replicated: a replica on every rank
        return piece(t, SPLIT[name], 2, tp, sp, replica_id=dp)

    names = list(msd)
    state = {
        i: {
            "step": st["step"].clone(),
            "exp_avg": shard(names[i], st["exp_avg"]),
            "exp_avg_sq": shard(names[i], st["exp_avg_sq"]),
        }
        for i, st in osd["state"].items()
    }
    sp.save(
        {
            "model": {k: shard(k, v) for k, v in msd.items()},
            "optim": {"state": state, "param_groups": osd["param_groups"]},
            "iteration": 1,
        },
        path,
    )
    return rank


def torch_load(rank, world, path):
    """3 ranks: every tensor split ceil-div three ways along its other dimension."""
    import shardpoint as sp

    msd, osd = full_state()
    names = list(msd)

    def like(name, t):
        if t.dim() == 0:
            return torch.empty_like(t)
        dim = 1 if t.dim() == 2 and SPLIT.get(name) == 0 else 0
        return piece(torch.empty_like(t), dim, 3, rank, sp)

    tgt = {
        "model": {k: like(k, v) for k, v in msd.items()},
        "optim": {
            "state": {i: {f: like(names[i], st[f]) for f in st} for i, st in osd["state"].items()}
        },
        "iteration": 0,
    }
    got = sp.load(path, like=tgt)
    out = {}
    for k in msd:
        s = tgt["model"][k]
        out[f"model/{k}"] = (s.data.numpy().tobytes(), list(s.global_offset), list(s.data.shape))
    for i, st in tgt["optim"]["state"].items():
        for f, s in st.items():
            d = s if isinstance(s, torch.Tensor) else s.data
            off = [] if isinstance(s, torch.Tensor) else list(s.global_offset)
            out[f"optim/state/{i}/{f}"] = (d.numpy().tobytes(), off, list(d.shape))
    return out, got["iteration"]
