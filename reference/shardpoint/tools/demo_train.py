"""The demo's training job: a tiny GPT trained with TP x DP and a distributed optimizer.

Megatron-style: attention and MLP weights are column-/row-parallel over TP (q/k/v and fc1 split
by rows, proj and fc2 by columns), embeddings, norms and the head are replicated; each DP rank
owns a flattened range of every local weight's AdamW moments (a distributed optimizer) and
updates only that range, then the ranges are reassembled over DP. Checkpoints go through
:class:`CheckpointManager` every ``every`` steps. Runs on gloo ranks or alone (world 1).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from shardpoint import api
from shardpoint.api import state as sps
from shardpoint.api.manager import CheckpointManager
from shardpoint.tree.model import ShardedTensor

VOCAB, HIDDEN, HEADS, LAYERS, SEQ, BATCH = 32, 32, 2, 2, 16, 8  # BATCH: global sequences
LR, BETAS, EPS, WD, SEED = 3e-3, (0.9, 0.95), 1e-8, 0.01, 1234


def param_specs() -> list[tuple[str, tuple[int, ...], Optional[int]]]:
    """(name, global shape, TP-split dim or None) of every weight."""
    h = HIDDEN
    out: list[tuple[str, tuple[int, ...], Optional[int]]] = [
        ("wte", (VOCAB, HIDDEN), None),
        ("wpe", (SEQ, HIDDEN), None),
    ]
    for i in range(LAYERS):
        p = f"layers.{i}."
        out += [
            (p + "ln1", (h,), None),
            (p + "q", (h, h), 0),
            (p + "k", (h, h), 0),
            (p + "v", (h, h), 0),
            (p + "proj", (h, h), 1),
            (p + "ln2", (h,), None),
            (p + "fc1", (4 * h, h), 0),
            (p + "fc2", (h, 4 * h), 1),
        ]
    return out + [("lnf", (h,), None), ("head", (VOCAB, HIDDEN), None)]


def init_value(name: str, shape: tuple) -> torch.Tensor:
    """Every rank derives the same global initial weight on its own."""
    if name.split(".")[-1].startswith("ln") or name == "lnf":
        return torch.ones(shape)
    g = torch.Generator().manual_seed(SEED + sum(map(ord, name)))
    return torch.randn(shape, generator=g) * (0.02 if name != "wte" else 0.1)


def block(shape: tuple, dim: Optional[int], part: int, parts: int) -> tuple:
    """(offset, shape) of part ``part`` of ``parts`` along ``dim`` (None: the whole)."""
    if dim is None:
        return (0,) * len(shape), tuple(shape)
    lo, hi = part * shape[dim] // parts, (part + 1) * shape[dim] // parts
    return (
        tuple(lo if i == dim else 0 for i in range(len(shape))),
        tuple(hi - lo if i == dim else s for i, s in enumerate(shape)),
    )


def batch(step: int) -> torch.Tensor:
    """The global batch of ``step``: sequences x[t+1] = (5 x[t] + c) mod VOCAB, learnable."""
    g = torch.Generator().manual_seed(SEED * 1000 + step)
    x0 = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    c = torch.randint(0, 4, (BATCH, 1), generator=g)
    seq = [x0]
    for _ in range(SEQ):
        seq.append((5 * seq[-1] + c) % VOCAB)
    return torch.cat(seq, 1)


@dataclass
class Layout:
    rank: int
    world: int
    tp: int
    tp_group: Any = None
    dp_group: Any = None

    @property
    def dp(self) -> int:
        return self.world // self.tp

    @property
    def t(self) -> int:
        return self.rank % self.tp

    @property
    def d(self) -> int:
        return self.rank // self.tp


def make_layout(rank: int, world: int, tp: int) -> Layout:
    """Create the TP groups (consecutive ranks) and DP groups; every rank calls it."""
    lay = Layout(rank, world, tp)
    if world == 1:
        return lay
    import torch.distributed as dist

    for d in range(world // tp):
        g = dist.new_group(list(range(d * tp, (d + 1) * tp)))
        if lay.d == d:
            lay.tp_group = g
    for t in range(tp):
        g = dist.new_group(list(range(t, world, tp)))
        if lay.t == t:
            lay.dp_group = g
    return lay


def _all_reduce(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    if size > 1:
        import torch.distributed as dist

        dist.all_reduce(x, group=group)
    return x


def _tp_ops(lay: Layout) -> tuple:
    """Megatron's f (identity, all-reduce of the gradient) and g (all-reduce, identity)."""

    class Copy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            return _all_reduce(g.contiguous(), lay.tp_group, lay.tp)

    class Reduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return _all_reduce(x.contiguous(), lay.tp_group, lay.tp)

        @staticmethod
        def backward(ctx, g):
            return g

    return Copy.apply, Reduce.apply


class Trainer:
    """One rank's part of the job: local weights, optimizer ranges, the step, checkpoints."""

    def __init__(self, lay: Layout, root: str, every: int, async_save: bool) -> None:
        self.lay, self.every = lay, every
        self.specs = param_specs()
        self.w: dict = {}  # name -> local weight (requires grad)
        self.ranges: dict = {}  # name -> (a, b) of the local weight's flattening
        self.m: dict = {}
        self.v: dict = {}
        for name, shape, dim in self.specs:
            off, shp = block(shape, dim, lay.t, lay.tp)
            full = init_value(name, shape)
            self.w[name] = full[tuple(slice(o, o + s) for o, s in zip(off, shp))].clone()
            self.w[name].requires_grad_(True)
            n = math.prod(shp)
            a, b = lay.d * n // lay.dp, (lay.d + 1) * n // lay.dp
            self.ranges[name] = (a, b)
            self.m[name], self.v[name] = torch.zeros(b - a), torch.zeros(b - a)
        self.iteration = 0
        self.copy, self.reduce = _tp_ops(lay)
        self.mgr = CheckpointManager(root, max_to_keep=2, async_save=async_save)

    # ------------------------------------------------------------------ model
    def _ln(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (HIDDEN,), w)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        w, B, T = self.w, tokens.shape[0], SEQ
        x = w["wte"][tokens[:, :-1]] + w["wpe"]
        heads, hd = HEADS // self.lay.tp, HIDDEN // HEADS
        for i in range(LAYERS):
            p = f"layers.{i}."
            h = self.copy(self._ln(x, w[p + "ln1"]))
            q, k, v = (
                (h @ w[p + n].T).view(B, T, heads, hd).transpose(1, 2) for n in ("q", "k", "v")
            )
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.reduce(a.transpose(1, 2).reshape(B, T, heads * hd) @ w[p + "proj"].T)
            h = self.copy(self._ln(x, w[p + "ln2"]))
            x = x + self.reduce(F.gelu(h @ w[p + "fc1"].T) @ w[p + "fc2"].T)
        logits = self._ln(x, w["lnf"]) @ w["head"].T
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def train_step(self) -> float:
        """One step on this DP rank's slice of the global batch; returns the global loss."""
        lay = self.lay
        self.iteration += 1
        per = BATCH // lay.dp
        tokens = batch(self.iteration)[lay.d * per : (lay.d + 1) * per]
        for t in self.w.values():
            t.grad = None
        loss = self.loss(tokens)
        loss.backward()
        t = self.iteration
        for name, p in self.w.items():
            g = _all_reduce(p.grad.reshape(-1).clone(), lay.dp_group, lay.dp) / lay.dp
            a, b = self.ranges[name]
            g, m, v = g[a:b], self.m[name], self.v[name]
            m.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
            v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
            mhat, vhat = m / (1 - BETAS[0] ** t), v / (1 - BETAS[1] ** t)
            flat = p.detach().reshape(-1)
            new = flat[a:b] * (1 - LR * WD) - LR * mhat / (vhat.sqrt() + EPS)
            full = torch.zeros(flat.numel())
            full[a:b] += new
            flat.copy_(_all_reduce(full, lay.dp_group, lay.dp))
        out = _all_reduce(loss.detach().reshape(1).clone(), lay.dp_group, lay.dp) / lay.dp
        return float(out[0])

    # ------------------------------------------------------------------ checkpoint
    def state(self) -> dict:
        """The checkpoint tree in this rank's layout (also the ``like`` tree of a resume)."""
        lay, model, m, v = self.lay, {}, {}, {}
        for name, shape, dim in self.specs:
            w = self.w[name].detach()
            off, shp = block(shape, dim, lay.t, lay.tp)
            model[name] = w if dim is None else ShardedTensor(w, shape, off, replica_id=lay.d)
            a, _b = self.ranges[name]
            rep = lay.t if dim is None else 0  # replicated weights: moments on every TP
            m[name] = sps.flattened_shard(
                self.m[name], shp, a, global_shape=shape, global_offset=off, replica_id=rep
            )
            v[name] = sps.flattened_shard(
                self.v[name], shp, a, global_shape=shape, global_offset=off, replica_id=rep
            )
        return {
            "model": model,
            "optim": {"exp_avg": m, "exp_avg_sq": v},
            "iteration": self.iteration,
            "consumed_samples": self.iteration * BATCH,
            "rank": sps.per_rank({"rng": sps.rng_state()}),
        }

    def maybe_save(self, loss: float) -> bool:
        if self.iteration % self.every:
            return False
        self.mgr.save(self.iteration, self.state(), metrics={"loss": loss})
        return True

    def resume(self) -> Optional[int]:
        """Load the latest complete step into this layout; None when there is none."""
        step = self.mgr.latest_step()
        if step is None:
            return None
        like = self.state()
        del like["rank"]
        out = self.mgr.load(step, like=like)
        self.iteration = out["iteration"]
        saved = sps.rank_value(api.read_metadata(self.mgr.path(step)), ("rank",))
        if saved is not None:  # same world size: this rank's own RNG states
            sps.set_rng_state(saved["rng"])
        else:  # another world size: re-seed from (seed, iteration, rank)
            torch.manual_seed(SEED + 7919 * self.iteration + self.lay.rank)
        return step

    def digest(self) -> str:
        """SHA-256 of the full global state (weights, moments, iteration), built collectively
        from main replicas; equal digests mean bitwise equal state in any layout."""
        lay, h = self.lay, hashlib.sha256()
        for name, shape, dim in self.specs:
            off, shp = block(shape, dim, lay.t, lay.tp)
            region = tuple(slice(o, o + s) for o, s in zip(off, shp))
            main = (lay.d == 0) if dim is not None else (lay.rank == 0)
            full = torch.zeros(shape)
            if main:
                full[region] += self.w[name].detach()
            parts = [full]
            for st in (self.m, self.v):
                blk = torch.zeros(math.prod(shp))
                a, b = self.ranges[name]
                if dim is not None or lay.t == 0:
                    blk[a:b] += st[name]
                g = torch.zeros(shape)
                g[region] += blk.view(shp)
                parts.append(g)
            for p in parts:  # x + 0.0 makes -0.0 into 0.0 in every layout alike
                h.update(_all_reduce(p, None, lay.world).numpy().tobytes())
        h.update(str(self.iteration).encode())
        return h.hexdigest()


def run(lay: Layout, root: str, steps: int, every: int, async_save: bool, report: Callable) -> dict:
    """Train to ``steps`` (resuming if ``root`` has a checkpoint), calling ``report(kind,
    ...)`` on rank 0: ("resumed", step, digest), ("step", step, loss, saved), ("done",)."""
    tr = Trainer(lay, root, every, async_save)
    start = tr.resume()
    resume_digest = tr.digest() if start else None
    if lay.rank == 0 and start:
        report("resumed", start, resume_digest)
    losses, digests = {}, {}
    while tr.iteration < steps:
        loss = tr.train_step()
        losses[tr.iteration] = loss
        saved = tr.maybe_save(loss)
        if saved:
            digests[tr.iteration] = tr.digest()
        if lay.rank == 0:
            report("step", tr.iteration, loss, saved)
    tr.mgr.close()
    return {"start": start, "resume_digest": resume_digest, "losses": losses, "digests": digests}
