"""Save and load, one revision of shardpoint against another, interleaved round by round.

    python benchmarks/bench_before_after.py --before f6563d8 --after HEAD --rounds 5

Each revision is exported from git into a temporary tree (``git archive``); every timed step
runs in a fresh process with that tree first on ``sys.path`` (the layout before and after
the layer split is handled), A and B alternating, so drift of this shared machine falls on
both. Each step: the page cache dropped (root only; said when not), a ``sp.save`` of the
state (fsync'd by the library, as always), the cache dropped again, a ``sp.load`` into
preallocated tensors, checked bit for bit. States from ``bench_states`` (torch only, same
seed for both). Prints medians with min-max per revision and the median of the per-round
ratios after/before, the figure that survives a noisy disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

CHILD = r"""
import json, os, sys, time
sys.path[:0] = {paths!r}
import torch
import shardpoint as sp
import bench_states as bs

def drop():
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False

def flat(t, p=""):
    out = {{}}
    for k, v in t.items():
        out.update(flat(v, p + k + ".") if isinstance(v, dict) else {{p + k: v}})
    return out

state = bs.mixed_state({scale}) if {state!r} == "mixed" else bs.uniform_state({n}, 32)
warm = {{"w": torch.ones(4)}}
sp.save(warm, {path!r} + "-warm")
sp.load({path!r} + "-warm")
cold = drop()
t = time.perf_counter(); sp.save(state, {path!r}); save = time.perf_counter() - t
drop()
def empty(t):
    return {{k: empty(v) for k, v in t.items()}} if isinstance(t, dict) else torch.empty_like(t)

like = empty(state)
t = time.perf_counter(); sp.load({path!r}, like); load = time.perf_counter() - t
ok = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
         for a, b in zip(flat(state).values(), flat(like).values()))
print(json.dumps({{"save": save, "load": load, "ok": ok, "cold": cold}}))
"""


def export(rev: str, into: str) -> list:
    """The revision's tree under ``into`` and the folders to put on sys.path for it."""
    os.makedirs(into)
    archive = subprocess.run(
        ["git", "-C", REPO, "archive", rev], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    names = ("core", "reference", "testing", "conformance", "backends")
    return [os.path.join(into, n) for n in names if os.path.isdir(os.path.join(into, n))]


def one(paths: list, state: str, scale: float, n: int, where: str) -> dict:
    path = os.path.join(where, "ckpt")
    code = CHILD.format(paths=paths + [HERE], scale=scale, n=n, state=state, path=path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1200
    )
    shutil.rmtree(where, ignore_errors=True)
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="git revision A")
    ap.add_argument("--after", default="HEAD", help="git revision B (default HEAD)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--states", default="mixed,uniform")
    ap.add_argument("--scale", type=float, default=0.5, help="mixed state scale (0.5: ~290 MB)")
    ap.add_argument("--tensors", type=int, default=8, help="uniform state: tensors of 32 MiB")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    a = ap.parse_args(argv)
    base = tempfile.mkdtemp(prefix="sp-ab-", dir=a.dir)
    try:
        trees = {
            "before": export(a.before, os.path.join(base, "before")),
            "after": export(a.after, os.path.join(base, "after")),
        }
        res: dict = {}
        cold = True
        for r in range(a.rounds):
            for state in a.states.split(","):
                order = ("before", "after") if r % 2 == 0 else ("after", "before")
                for which in order:
                    out = one(
                        trees[which], state, a.scale, a.tensors, os.path.join(base, f"w-{which}")
                    )
                    if not out["ok"]:
                        raise SystemExit(f"{which} {state}: load not bit-exact")
                    cold = cold and out["cold"]
                    for step in ("save", "load"):
                        res.setdefault((state, step, which), []).append(out[step])
            print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
        print(
            f"## shardpoint {a.before} (before) vs {a.after} (after), {a.rounds} interleaved "
            f"rounds, fresh process per step; page cache "
            f"{'dropped before every step' if cold else 'NOT dropped (needs root): warm'}\n"
        )
        print(
            "| state | step | before s, median (min-max) | after s, median (min-max) "
            "| after/before, median of per-round ratios (min-max) |"
        )
        print("|---|---|---|---|---|")
        for state in a.states.split(","):
            for step in ("save", "load"):
                b, f = res[(state, step, "before")], res[(state, step, "after")]
                ratios = [y / x for x, y in zip(b, f)]
                print(
                    f"| {state} | {step} | {statistics.median(b):.3f} ({min(b):.3f}-"
                    f"{max(b):.3f}) | {statistics.median(f):.3f} ({min(f):.3f}-{max(f):.3f}) "
                    f"| {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |"
                )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
