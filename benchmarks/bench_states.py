"""The benchmarks' states, built from torch alone (no shardpoint import), so a script can build
the same state in a process running another revision of the library (bench_before_after.py)."""

from __future__ import annotations

import torch


def mixed_state(scale: float = 1.0, seed: int = 0, layers: int = 8) -> dict:
    """Transformer-like, ~1.2 GB at scale 1 in 149 tensors from 4 KiB to 125 MiB: an fp32
    embedding, a bf16 head, 8 layers of bf16 weights with fp32 norms, fp32 Adam moments.
    Fewer ``layers`` (the benchmarks' --quick smoke tests) give fewer tensors of each kind."""
    g = torch.Generator().manual_seed(seed)
    h, v = max(8, int(1024 * scale)), max(16, int(32000 * scale))
    p = {
        "embed": ((v, h), torch.float32),
        "lm_head": ((v, h), torch.bfloat16),
        "final_norm": ((h,), torch.float32),
    }
    for i in range(layers):
        p.update(
            {
                f"l{i}.qkv": ((3 * h, h), torch.bfloat16),
                f"l{i}.o": ((h, h), torch.bfloat16),
                f"l{i}.up": ((4 * h, h), torch.bfloat16),
                f"l{i}.down": ((h, 4 * h), torch.bfloat16),
                f"l{i}.n1": ((h,), torch.float32),
                f"l{i}.n2": ((h,), torch.float32),
            }
        )
    st = {"model": {}, "optim": {}}
    for k, (shape, dt) in p.items():
        st["model"][k] = torch.randn(shape, generator=g).to(dt)
        if k not in ("embed", "lm_head"):
            st["optim"][k] = {
                "m": torch.randn(shape, generator=g),
                "v": torch.randn(shape, generator=g),
            }
    return st


def uniform_state(n: int = 32, mib: float = 32, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    cols = 1024 if mib >= 1 else 64
    rows = max(1, int(mib * 2**20) // 4 // cols)
    return {f"w{i}": torch.randn(rows, cols, generator=g) for i in range(n)}


def gpt2_adamw_state(scale: float = 1.0, seed: int = 0, layers: int = 12) -> dict:
    """The 444-tensor state of issue 30: a GPT-2-small-like model (12 layers, width 768, a
    50,257-token embedding: 148 fp32 parameters, ~124M values at scale 1) and its AdamW
    state (``exp_avg`` and ``exp_avg_sq`` per parameter; the step a plain int), 3 x 148 =
    444 tensors. ``scale`` shrinks the width and vocabulary (smoke runs)."""
    g = torch.Generator().manual_seed(seed)
    h, v, ctx = max(8, int(768 * scale)), max(16, int(50257 * scale)), max(8, int(1024 * scale))
    p = {"wte": (v, h), "wpe": (ctx, h)}
    for i in range(layers):
        p.update(
            {
                f"h.{i}.ln_1.weight": (h,),
                f"h.{i}.ln_1.bias": (h,),
                f"h.{i}.attn.c_attn.weight": (h, 3 * h),
                f"h.{i}.attn.c_attn.bias": (3 * h,),
                f"h.{i}.attn.c_proj.weight": (h, h),
                f"h.{i}.attn.c_proj.bias": (h,),
                f"h.{i}.ln_2.weight": (h,),
                f"h.{i}.ln_2.bias": (h,),
                f"h.{i}.mlp.c_fc.weight": (h, 4 * h),
                f"h.{i}.mlp.c_fc.bias": (4 * h,),
                f"h.{i}.mlp.c_proj.weight": (4 * h, h),
                f"h.{i}.mlp.c_proj.bias": (h,),
            }
        )
    p.update({"ln_f.weight": (h,), "ln_f.bias": (h,)})
    model = {k: torch.randn(s, generator=g) for k, s in p.items()}
    optim = {
        str(i): {
            "exp_avg": torch.randn(s, generator=g),
            "exp_avg_sq": torch.rand(s, generator=g),
            "step": 100,
        }
        for i, s in enumerate(p.values())
    }
    return {"model": model, "optim": {"state": optim}}
