"""Objects, files, directories and requests per checkpoint at scale, per-array layout (format
1.3) against packed (1.4), computed from the real save planner without processes (issue 30
item 5, the simulated 1,024-rank plan).

Every rank's local plan goes through :func:`~shardpoint.planning.planner.plan_save`, which
chooses each tensor's chunk grid and elects one writer per chunk, as ``sp.save`` does. The
checkpoint's keys follow from that plan by the layouts' own rules:

- per-array: a ``zarr.json`` and a file per chunk of every array (``array_path_for``,
  ``chunk_key``), the Zarr group ``zarr.json`` files (``group_paths``), the manifest;
- packed: each writer's encoded chunks (their sizes from ``ArrayLayout.create``: plain
  ``bytes``+``crc32c``, or shards of inner chunks above ``SHARD_ABOVE_BYTES``, inner chunks
  wholly outside the tensor absent) appended in plan order to its data objects, a new object
  once the next chunk would pass the cap (``PackedWriter.append``'s rule and constants: 1 TiB
  on files, 16 MiB on object stores), then the manifest.

On an object store both layouts hold one object more: the save's lease, which stays below
its save prefix. The writer's order of chunks is the plan's here; a save's write threads may
append them in another order, which can change the split count where sizes vary: the table
gives the count for 5 random orders of each writer's chunks beside it.

Requests are those that write the checkpoint on S3: one PUT per object, or above
``S3Options.multipart_threshold`` a multipart upload (start, parts of ``part_size``,
completion); for packed saves of several processes also each writer's index part (PUT,
the coordinator's LIST pages, GET, batched DELETE). The commit's own few requests (lease,
marker, its checks) come on top of both layouts alike and are not counted.

The 1- and 4-rank rows plan the mixed and uniform states of ``bench_states`` as ``sp.save``
flattens them (4 ranks: 2-D tensors split by rows where the rows divide, the rest replicated);
``tests/tools/test_bench_packed_scale.py`` saves the same for real and checks these counts.

    python benchmarks/bench_packed_scale.py              # 1, 4 and 1,024 ranks
    python benchmarks/bench_packed_scale.py --dp 8       # a smaller job
    python benchmarks/bench_packed_scale.py --json benchmarks/results/bench_packed_scale.json
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_results as br  # noqa: E402

from shardpoint.planning.planner import LocalPlan, PlanOptions, plan_save  # noqa: E402
from shardpoint_core.arrays import packed as pk  # noqa: E402
from shardpoint_core.arrays.array import ArrayLayout, chunk_key, inner_stride  # noqa: E402
from shardpoint_core.arrays.groups import group_paths  # noqa: E402
from shardpoint_core.commit.lease import LEASE_NAME  # noqa: E402
from shardpoint_core.format.manifest import array_path_for  # noqa: E402
from shardpoint_core.format.spec import MANIFEST_NAME  # noqa: E402
from shardpoint_core.stores.s3 import S3Options  # noqa: E402

LIST_PAGE = 1000  # keys per S3 LIST page
DELETE_BATCH = 1000  # keys per S3 batched DELETE
SHUFFLES = 5  # other orders of each writer's chunks tried


# ----------------------------------------------------------------------------- the plans
def local_plans(states: Sequence[Any]) -> List[LocalPlan]:
    """Each rank's local plan of its state, as ``sp.save`` builds it."""
    from shardpoint.tree.flatten import flatten_state

    out = []
    for rank, state in enumerate(states):
        f = flatten_state(state, replica=(rank,))
        objs = [(o.key, o.index, o.count, o.replica, o.value) for o in f.objects]
        out.append(LocalPlan(rank, f.tree, [t.holding for t in f.tensors], objs))
    return out


def rank_states(name: str, world: int, scale: float) -> List[Any]:
    """The ranks' states of the small cross-checks: ``mixed`` (bench_states.mixed_state,
    its 2-D tensors split by rows across the ranks where they divide, the rest replicated)
    or ``uniform`` (bench_states.uniform_state, its tensors split by rows alike)."""
    import torch

    import shardpoint as sp
    from bench_states import mixed_state, uniform_state

    full = mixed_state(scale) if name == "mixed" else uniform_state(8, 4 * scale)

    def cut(x: Any, rank: int) -> Any:
        if isinstance(x, dict):
            return {k: cut(v, rank) for k, v in x.items()}
        if world > 1 and isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] % world == 0:
            n = x.shape[0] // world
            return sp.ShardedTensor(x[rank * n : (rank + 1) * n], tuple(x.shape), (rank * n, 0))
        return x

    return [cut(full, r) for r in range(world)]


def job_plans(tp: int, pp: int, dp: int, layers: int, hidden: int, vocab: int) -> list:
    """The Megatron-style job of ``plan_scale.py``: bf16 weights (TP/PP sharded, replicated
    across DP), fp32 master weights and Adam moments as distributed-optimizer ranges."""
    from plan_scale import build_job

    return build_job(tp, pp, dp, layers, hidden, vocab, even=True)


# ------------------------------------------------------------------------ the layout rules
def encoded_size(lay: ArrayLayout, cidx: Sequence[int]) -> int:
    """Bytes of chunk ``cidx`` as written (``write_chunk``): plain, the chunk's bytes and
    its crc32c; a shard, its inner chunks not wholly outside the tensor (each with its
    crc32c and alignment gap, ``inner_stride``), then the index (16 bytes per inner chunk)
    and its crc32c (``encode_shard``)."""
    if lay.inner is None:
        return lay.stored_most()
    nb, gap = inner_stride(lay)
    per = [c // i for c, i in zip(lay.chunk, lay.inner)]
    present = 1
    for d, (p, i, c, s) in enumerate(zip(per, lay.inner, lay.chunk, lay.shape)):
        origin = cidx[d] * c
        present *= min(p, -(-(s - origin) // i))
    return present * (nb + gap) + 16 * math.prod(per) + 4


def packed_objects(sizes: Iterable[int], cap: int, local: bool) -> List[int]:
    """The sizes of one writer's data objects for chunks of ``sizes`` appended in that order
    (``PackedWriter.append``: chunks of ``ALIGN_ABOVE`` bytes and more start on an
    ``ALIGN`` boundary on files; a chunk that would end past ``cap`` starts a new object)."""
    objects: List[int] = []
    for n in sizes:
        if not objects:
            objects.append(0)
        size = objects[-1]
        start = size + (-size % pk.ALIGN if n >= pk.ALIGN_ABOVE and local else 0)
        if size and start + n > cap:
            objects.append(0)
            start = 0
        objects[-1] = start + n
    return objects


def put_requests(size: int, opts: Optional[S3Options] = None) -> int:
    """Requests of one object's PUT through ``S3Store.put`` (its default options)."""
    opts = opts or S3Options()
    if size <= opts.multipart_threshold:
        return 1
    return 2 + -(-size // opts.part_size)


def _dirs(paths: Iterable[str]) -> int:
    """Directories holding ``paths`` (relative to the checkpoint), the root included."""
    dirs = {""}
    for p in paths:
        parts = p.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.add("/".join(parts[:i]))
    return len(dirs)


def checkpoint_counts(
    plans: Sequence[LocalPlan],
    opts: PlanOptions = PlanOptions(),
    file_cap: Optional[int] = None,
    object_cap: Optional[int] = None,
    manifest_bytes: int = 0,
) -> Dict[str, Any]:
    """What one save of ``plans`` writes, per layout: ``per-array``, ``packed files`` and
    ``packed object store`` (files, directories, objects, S3 requests, the keys themselves,
    relative to the checkpoint and to its save prefix on an object store, writer ``w<rank>``)
    plus the plan's figures. ``file_cap`` /
    ``object_cap``: ``PackedBackend(cap=...)`` (default: the writer's by store kind)."""
    t0 = time.perf_counter()
    plan = plan_save(plans, opts)
    t_plan = time.perf_counter() - t0
    keys = sorted(plan.tensors)
    cols = plan.columns
    layouts = {}
    for k in keys:
        t = plan.tensors[k]
        layouts[k] = ArrayLayout.create(t.shape, t.dtype, t.chunk_shape)
    paths = {k: array_path_for(k) for k in keys}
    # every chunk the plan writes, in plan order: (tensor key, chunk index, writer, bytes)
    chunks = []
    for ck, w, off in zip(cols.c_key.tolist(), cols.c_writer.tolist(), cols.c_off.tolist()):
        k = keys[ck]
        lay = layouts[k]
        nd = len(lay.shape)
        cidx = tuple(o // c for o, c in zip(off[:nd], lay.chunk))
        chunks.append((k, cidx, w, encoded_size(lay, cidx)))
    # per-array (1.3): zarr.json of every array, a file per chunk, the groups, the manifest
    per_array = [f"{paths[k]}/zarr.json" for k in keys]
    per_array += [chunk_key(paths[k], cidx) for k, cidx, _w, _n in chunks]
    per_array += [f"{g}/zarr.json" if g else "zarr.json" for g in group_paths(paths.values())]
    zarr_json = {k: len(layouts[k].zarr_json()) for k in keys}
    pa_sizes = list(zarr_json.values()) + [n for *_x, n in chunks]
    n_groups = len(per_array) - len(keys) - len(chunks)
    pa_requests = sum(put_requests(s) for s in pa_sizes) + n_groups + 1
    # packed (1.4): each writer's chunks, in plan order, into its objects; the manifest
    by_writer: Dict[int, List[int]] = {}
    for _k, _c, w, n in chunks:
        by_writer.setdefault(w, []).append(n)
    out: Dict[str, Any] = {}
    for store, cap, local in (
        ("files", file_cap or pk.FILE_CAP, True),
        ("object store", object_cap or pk.OBJECT_CAP, False),
    ):
        objs = {w: packed_objects(s, cap, local) for w, s in sorted(by_writer.items())}
        packed = [f"{pk.PACKED_DIR}/w{w}-{i}.bin" for w, o in objs.items() for i in range(len(o))]
        requests = sum(put_requests(s) for o in objs.values() for s in o) + 1
        if len(plans) > 1:  # the other writers' index parts: PUT, LIST, GET, DELETE
            parts = len([w for w in objs if w != 0])
            requests += 2 * parts + -(-parts // LIST_PAGE) + -(-parts // DELETE_BATCH)
        lease = [] if local else [LEASE_NAME]
        # the same chunks appended in other orders, as the write threads may: objects then
        shuffled = []
        for seed in range(SHUFFLES):
            rng = random.Random(seed)
            shuffled.append(
                sum(
                    len(packed_objects(rng.sample(s, len(s)), cap, local))
                    for s in by_writer.values()
                )
                + 1
                + len(lease)
            )
        out[f"packed {store}"] = {
            "objects_other_orders": shuffled,
            "keys": sorted(packed + [MANIFEST_NAME] + lease),
            "requests": requests,
            "objects_per_writer": sorted(len(o) for o in objs.values()),
            "objects_per_writer_max": max((len(o) for o in objs.values()), default=0),
            "bytes_per_writer_max": max((sum(o) for o in objs.values()), default=0),
        }
    for name in ("packed files", "packed object store"):
        ks = out[name]["keys"]
        out[name].update(files=len(ks), dirs=_dirs(ks), objects=len(ks))
    out["per-array"] = {
        "keys": sorted(per_array + [MANIFEST_NAME]),
        "chunk_sizes": {chunk_key(paths[k], cidx): n for k, cidx, _w, n in chunks},
        "requests": pa_requests,
        "files": len(per_array) + 1,
        "dirs": _dirs(per_array),
        "objects": len(per_array) + 2,  # + the lease
    }
    out["plan"] = {
        "ranks": len(plans),
        "arrays": len(keys),
        "chunks": len(chunks),
        "writers": len(by_writer),
        "bytes": sum(n for *_x, n in chunks),
        "plan_s": t_plan,
    }
    return out


# ---------------------------------------------------------------------------- the tables
def row(name: str, c: Dict[str, Any]) -> List[Any]:
    p = c["plan"]
    pa, pf, po = c["per-array"], c["packed files"], c["packed object store"]
    return [
        name,
        p["ranks"],
        p["arrays"],
        p["chunks"],
        p["writers"],
        f"{pa['files']:,} / {pa['dirs']:,}",
        f"{pa['objects']:,}",
        f"{pa['requests']:,}",
        f"{pf['files']:,} / {pf['dirs']:,}",
        f"{po['objects']:,} ({min(po['objects_other_orders']):,}-"
        f"{max(po['objects_other_orders']):,})",
        f"{po['requests']:,}",
    ]


HEAD = [
    "state",
    "ranks",
    "arrays",
    "chunks",
    "writers",
    "per-array files / dirs",
    "per-array S3 objects",
    "per-array S3 requests",
    "packed files / dirs",
    "packed S3 objects (in 5 other orders)",
    "packed S3 requests",
]


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--dp", type=int, default=32)
    ap.add_argument("--layers", type=int, default=64, help="4 x (12 x layers + 2) arrays")
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128_000 + 3)
    ap.add_argument("--scale", type=float, default=0.25, help="of the 1- and 4-rank states")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the figures")
    a = ap.parse_args(argv)
    rec = br.Record(
        "bench_packed_scale.py",
        "Objects, files, directories and requests per checkpoint, simulated",
        argv,
        {k: getattr(a, k) for k in ("tp", "pp", "dp", "layers", "hidden", "vocab", "scale")},
    )
    rows = []
    for state in ("mixed", "uniform"):
        for world in (1, 4):
            c = checkpoint_counts(local_plans(rank_states(state, world, a.scale)))
            rows.append((f"{state} (scale {a.scale:g})", c))
    world = a.tp * a.pp * a.dp
    job = job_plans(a.tp, a.pp, a.dp, a.layers, a.hidden, a.vocab)
    c = checkpoint_counts(job)
    rows.append((f"GPT-like job, TP {a.tp} x PP {a.pp} x DP {a.dp}, h {a.hidden}", c))
    assert world == c["plan"]["ranks"]
    tables = {
        "files": rec.table(
            "files", "On files: files per checkpoint (and directories)", unit="files"
        ),
        "objects": rec.table(
            "objects", "On an object store: objects per checkpoint", unit="objects"
        ),
        "requests": rec.table(
            "requests",
            "On S3: requests that write the objects (the commit's own few not counted)",
            unit="requests",
        ),
    }
    print("| " + " | ".join(HEAD) + " |")
    print("|" + "---|" * len(HEAD))
    for name, c in rows:
        print("| " + " | ".join(str(x) for x in row(name, c)) + " |")
        plan = {k: v for k, v in c["plan"].items() if k != "plan_s"}
        n = c["plan"]["ranks"]
        label = f"{name}, {n} rank{'s' if n > 1 else ''}"
        for layout, f, o in (
            ("per-array", c["per-array"], c["per-array"]),
            ("packed", c["packed files"], c["packed object store"]),
        ):
            rec.row(
                tables["files"],
                f"{label}: {layout}",
                [f["files"]],
                files=f["files"],
                dirs=f["dirs"],
                **plan,
            )
            rec.row(
                tables["objects"],
                f"{label}: {layout}",
                [o["objects"]],
                **plan,
                **{k: v for k, v in o.items() if k.endswith("_max")},
            )
            rec.row(tables["requests"], f"{label}: {layout}", [o["requests"]], **plan)
    big = rows[-1][1]
    print(
        f"\n{world:,} ranks: {big['plan']['bytes'] / 1e12:.2f} TB encoded in "
        f"{big['plan']['chunks']:,} chunks; the busiest writer writes "
        f"{big['packed object store']['bytes_per_writer_max'] / 2**30:.2f} GiB in "
        f"{big['packed object store']['objects_per_writer_max']} objects of 16 MiB at most; "
        f"planned in {big['plan']['plan_s']:.1f} s"
    )
    if a.json:
        rec.write(a.json)


if __name__ == "__main__":
    main()
