"""``shardpoint demo``: a distributed save on 4 CPU ranks, loads into other layouts, checks.

Four gloo ranks hold a small transformer's training state in a TP=2 x DP=2 layout: column- and
row-parallel weights as ShardedTensor pieces (the vocabulary split unevenly), replicated norm
weights, AdamW state (fp32 master, exp_avg, exp_avg_sq) as distributed-optimizer flattened
ranges split across DP, the iteration, and per-rank RNG states as ShardedObject. The
checkpoint is then loaded by 3 ranks in another layout and by 1 rank in full, verified bit for
bit, inspected and verified on disk.
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from typing import Optional

import torch

HIDDEN, VOCAB, LAYERS = 256, 8001, 2


def param_specs() -> list:
    """(name, global shape, TP-sharded dim or None, dtype)."""
    out = [("embed.weight", (VOCAB, HIDDEN), 0, torch.bfloat16)]
    for i in range(LAYERS):
        out += [(f"layers.{i}.norm.weight", (HIDDEN,), None, torch.float32),
                (f"layers.{i}.qkv.weight", (3 * HIDDEN, HIDDEN), 0, torch.bfloat16),
                (f"layers.{i}.proj.weight", (HIDDEN, HIDDEN), 1, torch.bfloat16)]
    return out


def full_value(name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The deterministic global tensor every rank and every check derives independently."""
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 + len(name))
    return torch.randn(shape, generator=g).to(dtype)


def _block(shape: tuple, dim: Optional[int], part: int, parts: int) -> tuple:
    if dim is None:
        return (0,) * len(shape), shape
    lo, hi = part * shape[dim] // parts, (part + 1) * shape[dim] // parts
    return (tuple(lo if i == dim else 0 for i in range(len(shape))),
            tuple(hi - lo if i == dim else s for i, s in enumerate(shape)))


def _piece(t: torch.Tensor, off: tuple, shp: tuple) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(off, shp))]


def training_state(rank: int, world: int, tp: int) -> dict:
    """Rank ``rank``'s state in a TP x DP layout (DP = world // tp)."""
    import shardpoint as sp
    t, d = rank % tp, rank // tp
    dp = world // tp
    model, optim = {}, {"param": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, shape, dim, dtype in param_specs():
        w = full_value(name, shape, dtype)
        off, shp = _block(shape, dim, t, tp)
        if dim is None:
            model[name] = w.clone()            # replicated: a plain tensor on every rank
        else:
            model[name] = sp.ShardedTensor(_piece(w, off, shp).clone(), shape, off,
                                           replica_id=d)
        n = math.prod(shp)
        a, b = d * n // dp, (d + 1) * n // dp
        for st in optim:
            full = full_value(f"{st}/{name}", shape, torch.float32)
            flat = _piece(full, off, shp).reshape(-1)[a:b].clone()
            optim[st][name] = sp.ShardedTensor(flat, shape, off, local_shape=shp,
                                               flattened_range=(a, b),
                                               replica_id=t if dim is None else 0)
    g = torch.Generator().manual_seed(1000 + rank)
    rng = {"torch": g.get_state(), "sampler_offset": 4096 * rank}
    return {"model": model, "optim": optim, "iteration": 1234,
            "rng": sp.ShardedObject(rng, rank, world)}


def _save_rank(rank: int, world: int, path: str) -> dict:
    import shardpoint as sp
    r = sp.save(training_state(rank, world, tp=2), path, overwrite=True)   # --dir reruns
    return {"written": r.rank_bytes_written, "unique": r.unique_bytes,
            "exchange": r.exchange_bytes, "chunks": r.chunks, "timings": r.timings}


def _load_rank(rank: int, world: int, path: str) -> dict:
    """Load into TP=world along the *other* dim, optimizer state as fresh flattened ranges of
    the whole tensor; compare bit for bit."""
    import shardpoint as sp
    like_model, like_optim, expect = {}, {}, []
    for name, shape, dim, dtype in param_specs():
        w = full_value(name, shape, dtype)
        other = None if dim is None else (len(shape) - 1 - dim)
        off, shp = _block(shape, other, rank, world)
        like_model[name] = sp.ShardedTensor(torch.empty(shp, dtype=dtype), shape, off)
        expect.append((("model", name), _piece(w, off, shp)))
        n = math.prod(shape)
        a, b = rank * n // world, (rank + 1) * n // world
        for st in ("param", "exp_avg", "exp_avg_sq"):
            like_optim.setdefault(st, {})[name] = sp.ShardedTensor(
                torch.empty(b - a), shape, (0,) * len(shape), local_shape=shape,
                flattened_range=(a, b))
            full = full_value(f"{st}/{name}", shape, torch.float32)
            expect.append((("optim", st, name), full.reshape(-1)[a:b]))
    like = {"model": like_model, "optim": like_optim, "iteration": 0,
            "rng": sp.ShardedObject(None, rank % 4, 4)}
    rep = sp.LoadReport()
    t = time.perf_counter()
    out = sp.load(path, like=like, report=rep)
    secs = time.perf_counter() - t
    bad = _mismatches(out, expect)
    if out["iteration"] != 1234:
        bad.append("iteration")
    g = torch.Generator().manual_seed(1000 + rank % 4)
    if not torch.equal(out["rng"]["torch"], g.get_state()):
        bad.append("rng")
    return {"bad": bad, "read": rep.rank_bytes_read, "sent": rep.exchange_bytes, "secs": secs}


def _mismatches(out: dict, expect: list) -> list:
    """Paths (joined with '/') whose loaded tensor differs in any bit from the expected one."""
    bad = []
    for keypath, want in expect:
        got = out
        for k in keypath:
            got = got[k]
        if not torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
            bad.append("/".join(keypath))
    return bad


def _load_full(path: str) -> dict:
    """One process, no process group: every tensor in full into plain ``like`` tensors."""
    import shardpoint as sp
    specs = param_specs()
    like = {"model": {n: torch.empty(s, dtype=dt) for n, s, _, dt in specs},
            "optim": {st: {n: torch.empty(s) for n, s, _, _ in specs}
                      for st in ("param", "exp_avg", "exp_avg_sq")},
            "iteration": 0}
    rep = sp.LoadReport()
    t = time.perf_counter()
    out = sp.load(path, like=like, report=rep)
    secs = time.perf_counter() - t
    want = [(("model", n), full_value(n, s, dt)) for n, s, _, dt in specs]
    want += [(("optim", st, n), full_value(f"{st}/{n}", s, torch.float32))
             for n, s, _, _ in specs for st in ("param", "exp_avg", "exp_avg_sq")]
    bad = _mismatches(out, want)
    if out["iteration"] != 1234:
        bad.append("iteration")
    rngs = sp.read_metadata(path).objects["rng"]
    for r, v in enumerate(rngs):
        g = torch.Generator().manual_seed(1000 + r)
        if not (torch.equal(v["torch"], g.get_state()) and v["sampler_offset"] == 4096 * r):
            bad.append(f"rng[{r}]")
    return {"bad": bad, "secs": secs, "read": rep.rank_bytes_read, "tensors": len(want)}


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def run_demo(base: Optional[str] = None, *, keep: bool = False) -> int:
    """Run the demo; returns a process exit code (0: every check passed)."""
    import contextlib
    import io

    from shardpoint_conformance.launch import RankFailure, run_world

    from .cli import main as cli_main
    from .verify import verify_checkpoint
    own = base is None
    base = base or tempfile.mkdtemp(prefix="shardpoint-demo-")
    path = os.path.join(base, "step_1234")
    print(f"shardpoint demo: a TP=2 x DP=2 training state on 4 gloo ranks -> {path}\n"
          f"   {len(param_specs())} weights (vocab {VOCAB} split unevenly over TP, column- and "
          "row-parallel, replicated norms), AdamW state as flattened ranges over DP, "
          "iteration, per-rank RNG objects")
    ok = True
    steps = []
    try:
        t = time.perf_counter()
        saved = run_world(4, _save_rank, path, timeout=300)
        wall = time.perf_counter() - t
        s0 = saved[0]
        written = sum(r["written"] for r in saved)
        steps.append(("save, 4 ranks", s0["timings"]["total"], wall))
        print(f"1. save on 4 ranks: {s0['timings']['total']:.2f}s in save() "
              f"({wall:.1f}s with process start-up); plan {s0['timings']['plan_total']:.3f}s, "
              f"write {s0['timings'].get('write', 0):.3f}s, commit {s0['timings']['commit']:.3f}s")
        print(f"   bytes written {_mib(written)} for {_mib(s0['unique'])} unique "
              f"({written / s0['unique']:.3f}x: replicas written once), "
              f"exchanged {_mib(s0['exchange'])}, {s0['chunks']} chunks")
        t = time.perf_counter()
        rep = verify_checkpoint(path, strict=True)
        secs = time.perf_counter() - t
        steps.append(("verify --strict", secs, secs))
        print(f"2. verify --strict: {'OK' if rep.ok else 'FAILED'}: {rep.chunks_checked} of "
              f"{rep.chunks} chunks read and checksummed in {secs:.2f}s")
        ok &= rep.ok
        for sid, msg in rep.problems:
            print(f"   [{sid}] {msg}")
        print(f"3. shardpoint inspect {path} (first lines):")
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            ok &= cli_main(["inspect", path]) == 0
        lines = buf.getvalue().splitlines()
        for line in lines[:10] + ["..."] + lines[-1:]:
            print("   " + line)
        t = time.perf_counter()
        loaded = run_world(3, _load_rank, path, timeout=300)
        wall = time.perf_counter() - t
        bad = sorted({b for r in loaded for b in r["bad"]})
        steps.append(("load, 3 ranks", max(r["secs"] for r in loaded), wall))
        print(f"4. load on 3 ranks, weights split along the other dim, optimizer state in new "
              f"flattened ranges: {'bitwise equal' if not bad else 'MISMATCH ' + str(bad)}; "
              f"{max(r['secs'] for r in loaded):.2f}s in load() ({wall:.1f}s with start-up), "
              f"read {_mib(sum(r['read'] for r in loaded))} (each region once), exchanged "
              f"{_mib(sum(r['sent'] for r in loaded))}")
        ok &= not bad
        t = time.perf_counter()
        full = _load_full(path)
        steps.append(("load, 1 rank", full["secs"], time.perf_counter() - t))
        print(f"5. load on 1 rank into full plain tensors ({full['tensors']} tensors, the "
              f"iteration, all 4 RNG states): "
              f"{'bitwise equal' if not full['bad'] else 'MISMATCH ' + str(full['bad'])}; "
              f"{full['secs']:.2f}s in load(), read {_mib(full['read'])}")
        ok &= not full["bad"]
        print("timings: " + "; ".join(f"{n} {a:.2f}s ({b:.1f}s wall)" for n, a, b in steps))
    except (RankFailure, OSError, RuntimeError) as e:
        print(f"demo: a step failed: {type(e).__name__}: {e}")
        ok = False
    finally:
        if own and not keep:
            shutil.rmtree(base, ignore_errors=True)
        elif keep or not own:
            print(f"checkpoint kept at {path}")
    print("demo:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1
