"""Reading a big manifest: decode time, and the cost of its typed state tree.

Builds the manifest of a model with ``--keys`` tensors (default 100,000, nested as a
Megatron-style state: ``model/layers.N/...``, ``optim/<state>/...``) plus a few plain
values, encodes it once, then times, interleaved over ``--repeat`` rounds: decoding it
(``decode_manifest``, what ``read_metadata`` does after the read), decoding it and building
its typed tree (``Manifest.state_tree``, an alias of ``tree`` since the typed tree became
public), and walking every leaf of that tree (``iter_leaves``). Medians (min-max). Uses only
APIs that exist before and after the switch, so it runs against either checkout (interleave
processes of the two for an A/B); ``--clock cpu`` times this process's CPU seconds, steadier
than wall time on a shared machine:

    PYTHONPATH=core python benchmarks/bench_manifest_tree.py
    PYTHONPATH=core python benchmarks/bench_manifest_tree.py --keys 400000 --clock cpu
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from shardpoint_core.format.manifest import (
    Manifest,
    TensorEntry,
    array_path_for,
    decode_manifest,
    encode_manifest,
)
from shardpoint_core.format.statetree import iter_leaves


def build(keys: int) -> bytes:
    """Manifest bytes of ``keys`` tensors in a nested tree, with a few value leaves."""
    per = keys // 4
    names = [
        f"{group}/layers.{i // 12}/p{i % 12}"
        for group in ("model", "optim/param", "optim/exp_avg", "optim/exp_sq")
        for i in range(per)
    ]
    root: dict = {}
    for key in names:
        node = root
        *path, leaf = key.split("/")
        for c in path:
            node = node.setdefault(c, {})
        node[leaf] = {"tensor": key}
    for i in range(16):
        root[f"v{i}"] = {"value": i * 1.5}

    def wire(d: dict) -> dict:
        return {
            "dict": [
                [k, wire(v) if "tensor" not in v and "value" not in v else v] for k, v in d.items()
            ]
        }

    tensors = {
        k: TensorEntry(k, array_path_for(k), (1024, 64), "bfloat16", (1024, 64)) for k in names
    }
    return encode_manifest(Manifest(wire(root), tensors, {}, save_world_size=8))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    a = ap.parse_args()
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    data = build(a.keys)
    steps = {
        "decode_manifest": lambda: decode_manifest(data),
        "decode + typed tree": lambda: decode_manifest(data).state_tree,
        "decode + tree + walk": lambda: sum(
            1 for _ in iter_leaves(decode_manifest(data).state_tree)
        ),
    }
    times: dict = {k: [] for k in steps}
    for _ in range(a.repeat):  # interleaved rounds
        for name, f in steps.items():
            gc.collect()
            t0 = clock()
            f()
            times[name].append(clock() - t0)
    print(
        f"manifest of {a.keys:,} tensors + 16 values: {len(data) / 1e6:.1f} MB; {a.clock} "
        f"seconds, medians of {a.repeat} interleaved rounds (min-max)"
    )
    for name, xs in times.items():
        print(f"  {name:22s} {statistics.median(xs):7.3f} s ({min(xs):.3f}-{max(xs):.3f})")


if __name__ == "__main__":
    main()
