"""Incremental packed saves (issue 30 item 4, spec/format.md [SP-PACK-9]): a fine-tune whose
frozen weights are 95% of the bytes, saved in full and incrementally, rounds interleaved.

    python benchmarks/bench_incremental.py                 # 1 GiB state, 5 rounds
    python benchmarks/bench_incremental.py --mib 256 --rounds 3
    python benchmarks/bench_incremental.py --threads 1     # hashing on one thread

Each round trains a step (the trainable 5% changes: new bytes in every one of its chunks)
and then saves the state three ways into fresh sibling directories of one run directory:

- ``full``: ``sp.save(..., backend=PackedBackend())`` (no chunk hashes; the default);
- ``full+hashes``: the same recording every chunk's BLAKE3/128 ([SP-PACK-10]), what a
  save that later ones build on pays;
- ``incremental``: ``sp.save(..., incremental=<the previous round's full+hashes>)``: chunks
  the base holds (same length, crc32c, hash) are referred to, not written.

Reported per mode: bytes written (the save's own data objects and manifest), save time, as
medians over rounds with min-max; then the ratios full / incremental that the issue's
target names (at least 10x fewer bytes, at least 5x faster). Every incremental checkpoint is
loaded once and compared bit for bit, and verified (every referenced chunk read and checked,
hashes included), outside the timings. One process, fsync on, page cache warm.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

import shardpoint as sp
from shardpoint_core.transactions.packed import PackedBackend
from shardpoint_core.verify import verify_checkpoint


def make_state(total_mib: int, frozen_share: float = 0.95, seed: int = 0) -> dict:
    """A model-like state: frozen layers (``frozen_share`` of the bytes) and trainable
    adapters with their AdamW moments (the rest), float32, in 16 MiB-or-smaller tensors."""
    rng = np.random.default_rng(seed)
    total = total_mib << 20
    frozen_bytes = int(total * frozen_share)
    per = 4 << 20  # 4 MiB tensors: many chunks, as a real model has
    frozen = {}
    for i in range(max(1, frozen_bytes // per)):
        frozen[f"layer{i}.weight"] = rng.standard_normal(per // 4, dtype=np.float32).reshape(
            -1, 1024
        )
    train_elems = max(1024, (total - frozen_bytes) // 4 // 3)
    train = {
        name: rng.standard_normal(train_elems, dtype=np.float32)
        for name in ("adapter", "exp_avg", "exp_avg_sq")
    }
    return {"frozen": frozen, "train": train, "step": 0}


def train_step(state: dict, step: int) -> None:
    """Every trainable value changes (so every chunk of it is new)."""
    for v in state["train"].values():
        v += np.float32(1e-3)
    state["step"] = step


def own_bytes(path: str) -> int:
    """Bytes the save at ``path`` wrote itself: its data objects and its manifest."""
    n = os.path.getsize(os.path.join(path, "manifest.msgpack"))
    d = os.path.join(path, "packed")
    return n + sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def same(a: dict, b: dict) -> bool:
    for part in ("frozen", "train"):
        for k, v in a[part].items():
            if np.asarray(b[part][k]).tobytes() != v.tobytes():
                return False
    return a["step"] == b["step"]


def hash_speeds(mib: int = 256) -> str:
    """One thread hashing ``mib`` MiB of random bytes: SHA-256 against BLAKE3 (the choice
    of [SP-PACK-10]) and crc32c, best of 3, in GB/s."""
    import hashlib

    import blake3
    import crc32c

    data = np.random.default_rng(1).integers(0, 256, mib << 20, dtype=np.uint8).tobytes()
    out = []
    for name, fn in (
        ("sha256", lambda: hashlib.sha256(data).digest()),
        ("blake3", lambda: blake3.blake3(data).digest(16)),
        ("crc32c", lambda: crc32c.crc32c(data)),
    ):
        best = min(_timed(fn) for _ in range(3))
        out.append(f"{name} {len(data) / best / 1e9:.2f}")
    return "one thread, GB/s: " + ", ".join(out)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024, help="state size in MiB (default 1024)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--frozen", type=float, default=0.95, help="frozen share of the bytes")
    ap.add_argument("--threads", type=int, default=16, help="write threads per process")
    ap.add_argument("--dir", default=None, help="where to save (default: a temp dir)")
    a = ap.parse_args(argv)

    state = make_state(a.mib, a.frozen)
    total = sum(v.nbytes for p in ("frozen", "train") for v in state[p].values())
    top = tempfile.mkdtemp(prefix="sp-bench-incr-", dir=a.dir)
    run = os.path.join(top, "run")
    os.makedirs(run)
    times: dict = {"full": [], "full+hashes": [], "incremental": []}
    written: dict = {k: [] for k in times}
    checked = []
    try:
        base = os.path.join(run, "r0_base")
        sp.save(state, base, backend=PackedBackend(hashes=True, write_threads=a.threads))
        for r in range(1, a.rounds + 1):
            train_step(state, r)
            for mode in ("full", "full+hashes", "incremental"):
                path = os.path.join(run, f"r{r}_{mode.replace('+', '_')}")
                if mode == "incremental":
                    kw = {"incremental": base, "backend": PackedBackend(write_threads=a.threads)}
                else:
                    kw = {
                        "backend": PackedBackend(
                            hashes=mode == "full+hashes", write_threads=a.threads
                        )
                    }
                t0 = time.perf_counter()
                sp.save(state, path, **kw)
                times[mode].append(time.perf_counter() - t0)
                written[mode].append(own_bytes(path))
            inc = os.path.join(run, f"r{r}_incremental")
            checked.append(same(state, sp.load(inc)) and verify_checkpoint(inc).ok)
            # the next round builds on this round's full save with hashes; the rest goes
            # (the benchmark's own directories: removed as files, nothing refers to them)
            for name in (f"r{r}_incremental", f"r{r}_full", os.path.basename(base)):
                shutil.rmtree(os.path.join(run, name))
            base = os.path.join(run, f"r{r}_full_hashes")
    finally:
        shutil.rmtree(top, ignore_errors=True)

    def med(xs: list) -> str:
        return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"

    print(
        f"state: {total / 2**20:.0f} MiB, {a.frozen:.0%} frozen; {a.rounds} interleaved "
        f"rounds; {a.threads} write threads; one process, fsync on"
    )
    print(f"{'mode':<14} {'MiB written, median (min-max)':<34} {'save s, median (min-max)'}")
    for mode in times:
        mib = [w / 2**20 for w in written[mode]]
        print(f"{mode:<14} {med(mib):<34} {med(times[mode])}")
    fb, ib = statistics.median(written["full"]), statistics.median(written["incremental"])
    ft, it = statistics.median(times["full"]), statistics.median(times["incremental"])
    print(
        f"full / incremental: {fb / ib:.1f}x fewer bytes, {ft / it:.1f}x faster "
        f"(target: >= 10x, >= 5x); hashing costs a full save "
        f"{statistics.median(times['full+hashes']) / ft:.2f}x its time"
    )
    print(f"every incremental checkpoint loaded bitwise and verified: {all(checked)}")
    print(hash_speeds())
    return 0 if all(checked) else 1


if __name__ == "__main__":
    sys.exit(main())
