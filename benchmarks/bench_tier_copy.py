"""Durable copies of incremental memory steps (the memory tier with ``incremental=True``): a
copy flattened (a whole checkpoint, what every durable copy was before session 19) against
one that builds on the storage step before it (``copy_checkpoint(..., incremental=<it>)``,
what both managers now do), rounds interleaved.

    python benchmarks/bench_tier_copy.py                   # 512 MiB state, 95% frozen, 5 rounds
    python benchmarks/bench_tier_copy.py --mib 128 --rounds 3

The "memory" steps live in a directory under /dev/shm (as the tier's ``shm://`` objects do):
the first saved with chunk hashes, each later one incremental on the one before. Storage is
a directory under ``--dir`` (default: a temp dir), fsync on. Each round trains a step, saves
the next memory step on the last one, then copies it to storage both ways: flattened, and on
the storage copy of the previous round (the managers' base: the newest storage step). Every
copy is loaded and compared bit for bit and verified, outside the timings. Reported: bytes
written (the copy's own data objects and manifest) and seconds, medians (min-max).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import shardpoint as sp  # noqa: E402
from bench_incremental import make_state, own_bytes, same, train_step  # noqa: E402
from shardpoint_core.transactions.copy import copy_checkpoint  # noqa: E402
from shardpoint_core.transactions.packed import PackedBackend  # noqa: E402
from shardpoint_core.verify import verify_checkpoint  # noqa: E402


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="state size in MiB (default 512)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--frozen", type=float, default=0.95, help="frozen share of the bytes")
    ap.add_argument("--dir", default=None, help="storage directory (default: a temp dir)")
    a = ap.parse_args(argv)

    state = make_state(a.mib, a.frozen)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    mem = tempfile.mkdtemp(prefix="sp-bench-tiercopy-mem-", dir=shm)
    sto = tempfile.mkdtemp(prefix="sp-bench-tiercopy-sto-", dir=a.dir)
    times: dict = {"flattened": [], "on the storage step before": []}
    written: dict = {k: [] for k in times}
    checked = []
    try:
        sp.save(state, f"{mem}/step_0", backend=PackedBackend(hashes=True))
        copy_checkpoint(f"{mem}/step_0", f"{sto}/step_0")  # the first durable copy: whole
        for r in range(1, a.rounds + 1):
            train_step(state, r)
            sp.save(state, f"{mem}/step_{r}", incremental=f"{mem}/step_{r - 1}")
            for mode in times:
                dst = f"{sto}/step_{r}" if mode != "flattened" else f"{sto}/flat_{r}"
                kw = {} if mode == "flattened" else {"incremental": f"step_{r - 1}"}
                t0 = time.perf_counter()
                copy_checkpoint(f"{mem}/step_{r}", dst, **kw)
                times[mode].append(time.perf_counter() - t0)
                written[mode].append(own_bytes(dst))
                checked.append(same(state, sp.load(dst)) and verify_checkpoint(dst).ok)
            shutil.rmtree(f"{sto}/flat_{r}")  # the benchmark's own directory, nothing refers to it
    finally:
        shutil.rmtree(mem, ignore_errors=True)
        shutil.rmtree(sto, ignore_errors=True)

    def med(xs: list) -> str:
        return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"

    print(
        f"state: {a.mib} MiB, {a.frozen:.0%} frozen; {a.rounds} interleaved rounds; "
        f"memory steps on {'/dev/shm' if shm else 'the temp dir'}, storage fsync on"
    )
    print(
        f"{'durable copy':<28} {'MiB written, median (min-max)':<34} {'copy s, median (min-max)'}"
    )
    for mode in times:
        mib = [w / 2**20 for w in written[mode]]
        print(f"{mode:<28} {med(mib):<34} {med(times[mode])}")
    fb = statistics.median(written["flattened"])
    ib = statistics.median(written["on the storage step before"])
    ft = statistics.median(times["flattened"])
    it = statistics.median(times["on the storage step before"])
    print(f"flattened / on the step before: {fb / ib:.1f}x the bytes, {ft / it:.1f}x the time")
    print(f"every copy loaded bitwise and verified: {all(checked)}")
    return 0 if all(checked) else 1


if __name__ == "__main__":
    sys.exit(main())
