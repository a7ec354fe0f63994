"""Planning cost at scale: build the local plans of a simulated Megatron-style job in one
process and time the coordinator's global save and load planning.

Default: 4,096 ranks = TP 8 x PP 4 x DP 128, 80 layers x 12 params (+ embeddings, ~1,000
tensors), bf16 weights replicated across DP, fp32 master/exp_avg/exp_avg_sq as distributed-
optimizer flattened ranges (each stage's parameters concatenated per TP rank, the buffer cut
into DP equal ranges). Times what the coordinator does: decode the gathered local plans and
plan the save and encode it once as ``save()`` broadcasts it (each rank cutting its own work,
the slowest cut timed); decode the gathered load requests and plan the
load, alone (``plan_load``) and as ``load()`` runs it (``plan_load_auto``: the cost model prices
dedup against direct reads), then encode it as ``load()`` sends it (a dedup plan: one message
for every rank, each rank cutting its own work from it, the slowest rank's cut timed; direct
reads: one message per rank), all under the coordinator's planning pause as
``run_collectively`` runs them (medians of --repeat runs, min-max); prints what the busiest
rank receives and sends, gathered bytes,
peak memory of each planning step (one extra untimed run under ``tracemalloc``, which sees
numpy's buffers too) and manifest size with ratios to the targets. ``--json`` writes the
printed figures as data (``bench_results``: medians, min-max, ratios to the targets, the
run's parameters and machine; the docs render it) with every timed sample under
``samples``, for interleaved A/B runs against another checkout (the script only uses APIs
both sides have).

    python benchmarks/plan_scale.py                 # the 4,096-rank job
    python benchmarks/plan_scale.py --dp 8 --layers 8   # quick look
    python benchmarks/plan_scale.py --json benchmarks/results/plan_scale.json   # + as data
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import resource
import statistics
import sys
import time
import tracemalloc

import msgpack
import numpy as np

from shardpoint.exchange import dedup
from shardpoint.planning.columns import HoldingColumns, gc_paused
from shardpoint.planning.load_dedup import LoadWorks, encode_global, work_from_global
from shardpoint.planning.load_planner import LoadOptions, encode_works, plan_load_auto
from shardpoint_core.format.manifest import Manifest, TensorEntry, array_path_for, encode_manifest
from shardpoint.tree.model import Holding
from shardpoint.planning.planner import LocalPlan, TensorLayout, plan_load, plan_save
from shardpoint.planning.save_global import encode_save_global, layouts_of, save_work_from_global


STAGING = "/checkpoints/run/step_000000100.staging-0123456789ab"  # a staging path's length


def layer_params(h: int, tp: int) -> list:
    """(name, global shape, sharded dim or None) of one transformer layer."""
    return [
        ("ln1.w", (h,), None),
        ("ln1.b", (h,), None),
        ("qkv.w", (3 * h, h), 0),
        ("qkv.b", (3 * h,), 0),
        ("proj.w", (h, h), 1),
        ("proj.b", (h,), None),
        ("ln2.w", (h,), None),
        ("ln2.b", (h,), None),
        ("fc1.w", (4 * h, h), 0),
        ("fc1.b", (4 * h,), 0),
        ("fc2.w", (h, 4 * h), 1),
        ("fc2.b", (h,), None),
    ]


def build_job(
    tp: int,
    pp: int,
    dp: int,
    layers: int,
    h: int,
    vocab: int,
    trees: bool = True,
    even: bool = False,
) -> list:
    """Every rank's :class:`LocalPlan` of the simulated job."""
    return list(iter_job(tp, pp, dp, layers, h, vocab, trees, even))


def iter_job(
    tp: int,
    pp: int,
    dp: int,
    layers: int,
    h: int,
    vocab: int,
    trees: bool = True,
    even: bool = False,
):
    """The ranks' local plans one at a time (a 65,536-rank job's plans as objects would not
    fit in memory; their wire forms do). ``even``: every TP rank's optimizer buffer laid
    out alike, each parameter's block given the room of the largest TP block (as Megatron
    pads the vocabulary): otherwise an uneven split (the vocabulary's) shifts the ranges of
    the TP-replicated parameters after it, and where a DP cut falls inside one of them on
    one TP rank and not another their ranges overlap without being equal ([SP-COVER-3]),
    which happens at DP 2048."""
    per_stage = layers // pp
    stage_params = []
    for s in range(pp):
        ps = []
        if s == 0:
            ps.append(("embed.w", (vocab, h), 0))
        for li in range(s * per_stage, (s + 1) * per_stage):
            ps += [(f"layers.{li}.{n}", shp, d) for n, shp, d in layer_params(h, tp)]
        if s == pp - 1:
            ps.append(("final_ln.w", (h,), None))
        stage_params.append(ps)

    def block(shape, d, t):
        if d is None:
            return (0,) * len(shape), shape
        n = shape[d]
        lo, hi = t * n // tp, (t + 1) * n // tp
        off = tuple(lo if i == d else 0 for i in range(len(shape)))
        shp = tuple(hi - lo if i == d else x for i, x in enumerate(shape))
        return off, shp

    for rank in range(tp * pp * dp):
        t, rest = rank % tp, rank // tp
        d_, s = rest % dp, rest // dp
        holdings = []
        ps = stage_params[s]
        blocks = [block(shp, d, t) for _, shp, d in ps]
        for (name, shp, d), (off, bshp) in zip(ps, blocks):
            rep = (d_,) if d is not None else (d_, t)
            holdings.append(Holding(f"model/{name}", "bfloat16", shp, off, bshp, None, rep))
        room = [
            max(math.prod(block(shp, d, u)[1]) for u in range(tp)) if even else math.prod(b)
            for (_, shp, d), (_, b) in zip(ps, blocks)
        ]
        total = sum(room)
        lo, hi = d_ * total // dp, (d_ + 1) * total // dp
        pos = 0
        for (name, shp, d), (off, bshp), n_room in zip(ps, blocks, room):
            n = math.prod(bshp)
            a, b = max(lo, pos), min(hi, pos + n)
            if a < b:
                for st in ("param", "exp_avg", "exp_avg_sq"):
                    # replicated (d=None) params: the same range on every TP rank -> replicas
                    rep = (0,) if d is not None else (t,)
                    holdings.append(
                        Holding(
                            f"optim/{st}/{name}", "float32", shp, off, bshp, (a - pos, b - pos), rep
                        )
                    )
            pos += n_room
        tree = tree_of([h.key for h in holdings] + ["rng"]) if trees else {"dict": []}
        yield LocalPlan(rank, tree, holdings, [("rng", rank, tp * pp * dp, (0,), 0)])


def tree_of(keys: list) -> dict:
    """The tree a rank's state flattens to: nested dicts down to its tensor and object
    leaves (``model/layers.0.qkv.w`` under ``model``), as ``flatten_state`` builds it."""
    root: dict = {}
    for key in keys:
        node = root
        *path, leaf = key.split("/")
        for c in path:
            node = node.setdefault(c, {})
        node[leaf] = {"object": key} if key == "rng" else {"tensor": key}

    def wire(d: dict) -> dict:
        return {
            "dict": [[k, v if "tensor" in v or "object" in v else wire(v)] for k, v in d.items()]
        }

    return wire(root)


def rank_side(all_parts: list) -> dict:
    """The ranks' side of :meth:`Comm.gather_parts`, simulated: each rank's offer (head,
    digests, sizes), the coordinator's requests, and the blobs each owner sends. Returns
    what the coordinator's side needs and the bytes it receives (the offers, each at its
    own size as ``Comm.gather_bytes`` sends them, and the owners' blobs) and broadcasts."""
    msgs = [dedup.offer(p)[0] for p in all_parts]
    offers = [dedup.read_offer(m) for m in msgs]
    want = dedup.requests(offers)
    got = {r: b"".join(all_parts[r][1 + i] for i in idx) for r, idx in want.items()}
    offered = sum(map(len, msgs))
    blobs = sum(map(len, got.values()))
    return {
        "msgs": msgs,
        "own": list(all_parts[0][1:]),
        "got": got,
        "offers": offered,
        "offers_padded": len(msgs) * max(map(len, msgs)),
        "blobs": blobs,
        "received": offered + blobs,
        "requests": len(dedup.encode_requests(want)),
        "naive": sum(len(b) for p in all_parts for b in p),
        "distinct_blobs": sum(map(len, want.values())) + len(all_parts[0]) - 1,
    }


def coordinator_side(g: dict) -> list:
    """What the coordinator runs in :meth:`Comm.gather_parts` after the transfers: read the
    offers, pick the owners, check and assemble every rank's parts."""
    offers = [dedup.read_offer(m) for m in g["msgs"]]
    return dedup.assemble(offers, g["own"], dedup.requests(offers), g["got"])


def load_requests(g: dict) -> list:
    """loading.py's decide(): every rank's requested regions from the assembled parts."""
    cache: dict = {}
    out = []
    for p in coordinator_side(g):
        _host, meta = msgpack.unpackb(p[0])
        out.append(HoldingColumns.from_parts(meta, p[1:], cache))
    return out


def gather_line(g: dict) -> str:
    return (
        f"{g['received'] / 1e6:.1f} MB received ({g['received'] / 50e6:.2f}x the 50 MB "
        f"target: offers {g['offers'] / 1e6:.2f} MB (padded to the largest, as a "
        f"dist.gather sent them: {g['offers_padded'] / 1e6:.2f} MB), "
        f"{g['distinct_blobs']:,} distinct blobs {g['blobs'] / 1e6:.1f} MB), requests "
        f"broadcast {g['requests'] / 1e6:.2f} MB; every blob sent: "
        f"{g['naive'] / 1e6:.1f} MB"
    )


def _median(xs: list) -> str:
    return f"{statistics.median(xs):7.3f} s ({min(xs):.3f}-{max(xs):.3f})"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--dp", type=int, default=128)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128_000 + 3)
    ap.add_argument("--repeat", type=int, default=5, help="timed runs (medians reported)")
    ap.add_argument("--no-load", action="store_true", help="skip load planning")
    ap.add_argument(
        "--no-trees",
        action="store_true",
        help="send empty trees (the job as measured before trees were simulated)",
    )
    ap.add_argument("--no-memory", action="store_true", help="skip the tracemalloc run")
    ap.add_argument(
        "--even-buffers",
        action="store_true",
        help="lay out every TP rank's optimizer buffer alike (see iter_job); "
        "needed from DP 2048 on with the uneven default vocabulary",
    )
    ap.add_argument("--json", help="write the timed samples and sizes to this file")
    ap.add_argument(
        "--bytes-only",
        action="store_true",
        help="build and encode the local plans, print what the coordinator "
        "gathers, and stop (no planning)",
    )
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="time with the wall clock or this process's CPU time (a shared machine)",
    )
    ap.add_argument(
        "--single-message",
        action="store_true",
        help="also size the one message per rank sent before the parts gather",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a tiny job (TP 2 x PP 2 x DP 2, 4 layers), one run: a smoke test",
    )
    a = ap.parse_args(argv)
    if a.quick:
        a.tp, a.pp, a.dp, a.layers, a.hidden, a.vocab, a.repeat = 2, 2, 2, 4, 256, 1000, 1
    # CPU seconds of this process: on a machine shared with other jobs the wall clock
    # measures the queue for the cores; the planner is single-threaded, so its CPU time is
    # what it costs (both reported in RESULTS.md, each labelled)
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    world = a.tp * a.pp * a.dp
    build_s = enc_s = 0.0
    nh = 0
    save_parts, load_parts = [], []
    single = single_max = 0
    t = clock()
    for p in iter_job(
        a.tp, a.pp, a.dp, a.layers, a.hidden, a.vocab, not a.no_trees, a.even_buffers
    ):
        t1 = clock()
        build_s += t1 - t
        nh += len(p.holdings)
        # what each rank sends (save_job.py's local()): [head, blob, ...]
        save_parts.append(p.to_parts())
        t = clock()
        enc_s += t - t1
        if a.single_message:  # the one message a rank sent before the parts gather
            n = len(p.to_bytes(world))
            single, single_max = single + n, max(single_max, n)
        # load into the same layout: each rank asks for what it held, sent as loading.py does
        if not a.no_load:
            meta, blobs = HoldingColumns.from_holdings(
                [
                    Holding(h.key, h.dtype, h.global_shape, h.offset, h.shape, h.flat, (0,))
                    for h in p.holdings
                ]
            ).to_parts()
            load_parts.append([msgpack.packb([f"host{p.rank // 8}", meta]), *blobs])
        t = clock()
    t = clock()
    save_g = rank_side(save_parts)
    load_g = rank_side(load_parts) if load_parts else None
    side_s = clock() - t
    print(
        f"job: {world} ranks (TP {a.tp} x PP {a.pp} x DP {a.dp}), {nh:,} holdings; "
        f"build {build_s:.1f} s, encode {enc_s / world * 1e3:.2f} ms/rank, digests and "
        f"owners' blobs {side_s:.1f} s (all ranks)"
    )
    for what, g in (("save", save_g), ("load", load_g)):
        if g is not None:
            print(f"  {what}: at the coordinator {gather_line(g)}")
    if a.single_message:
        print(
            f"  save, one message per rank (before): {single / 1e6:.1f} MB gathered "
            f"(largest {single_max / 2**10:.1f} KiB, {world * single_max / 1e6:.1f} MB "
            "padded to it)"
        )
    if a.bytes_only:
        return
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    dec, pl, tot, lds, lenc, auto, derive, senc = [], [], [], [], [], [], [], []
    scut: list = []
    hosts = [f"host{r // 8}" for r in range(world)]  # 8 ranks per host
    for _ in range(a.repeat):
        gc.collect()
        # run_collectively pauses the cyclic collector on the coordinator from the gather
        # to the scatter (gather, decode, plan, encode): so do these runs
        with gc_paused():
            t0 = clock()
            cache: dict = {}
            decoded = [LocalPlan.from_parts(p, cache) for p in coordinator_side(save_g)]
            t1 = clock()
            plan = plan_save(decoded)
            t2 = clock()
            # save_job.py's decide() then encodes the plan once (the writes and transfers as
            # columns, every layout, the stats, the staging path) for its broadcast
            gsave = encode_save_global(plan.columns, layouts_of(plan.tensors), plan.stats, STAGING)
            t3 = clock()
        # each rank cuts its own work from it (after the broadcast, outside the coordinator's
        # pause): time the ranks that write, send and receive most and a spread of others
        c_ = plan.columns
        pick = {0, world - 1, world // 2}
        for col in (c_.c_writer, c_.t_src, c_.c_writer[c_.t_chunk]):
            if len(col):
                pick.add(int(np.argmax(np.bincount(col, minlength=world))))
        pick |= set(range(1, world, max(1, world // 12)))
        cs = []
        # paused: this process holds the whole job's plans, and a collection over them
        # would be timed here though a rank's own heap is small
        with gc_paused():
            for r in sorted(pick):
                tc = clock()
                save_work_from_global(gsave, r)
                cs.append(clock() - tc)
        scut.append(max(cs))
        dec.append(t1 - t0)
        pl.append(t2 - t1)
        tot.append(t2 - t0)
        senc.append(t3 - t2)
        if not a.no_load:
            layouts = {
                k: TensorLayout(k, v.shape, v.dtype, v.chunk_shape) for k, v in plan.tensors.items()
            }
            del decoded
            gc.collect()
            with gc_paused():
                t0 = clock()
                works = plan_load(load_requests(load_g), layouts)
                lds.append(clock() - t0)
            del works
            gc.collect()
            with gc_paused():
                t0 = clock()  # what load() runs: the cost model picks a strategy
                works, costs = plan_load_auto(
                    load_requests(load_g), layouts, hosts, LoadOptions(), 1.0
                )
                auto.append(clock() - t0)
                t0 = clock()
                # loading.py's decide(): a dedup plan goes whole to every rank (one
                # broadcast), the direct strategy's as one message per rank
                if isinstance(works, LoadWorks):
                    gmsg, wire = encode_global(works, layouts), None
                else:
                    gmsg, wire = None, encode_works(works, layouts)
                lenc.append(clock() - t0)
            cdict = {k: v for k, v in vars(costs).items() if k != "notes"}
            # loading.py: a dedup plan's reply is empty and the costs go with the plan
            reply = (
                len(msgpack.packb([0, msgpack.packb(None)]))
                if gmsg
                else len(msgpack.packb([cdict, b""]))
            )
            if gmsg is not None:
                gmsg = msgpack.packb([cdict, gmsg])
            if gmsg is not None:
                # each rank cuts its own work from the plan (after the broadcast, outside
                # the coordinator's pause): time the ranks that read most, receive most and
                # a spread of others; every rank does this at once, so the most is what counts
                a_ = works.a
                pick = {
                    0,
                    world - 1,
                    world // 2,
                    int(np.argmax(works.a["recv_bytes"])),
                    int(np.argmax(np.bincount(a_["c_reader"], minlength=world))),
                }
                pick |= set(range(1, world, max(1, world // 12)))
                ds = []
                for r in sorted(pick):
                    t0 = clock()
                    w_ = work_from_global(msgpack.unpackb(gmsg)[1], r, layouts)
                    ds.append(clock() - t0)
                derive.append(max(ds))
                wsum = wmax = 0
            else:
                derive.append(0.0)
                wsum, wmax = sum(map(len, wire)), max(map(len, wire))
            gbytes = len(gmsg) if gmsg else 0
            reads = int(len(works.a["c_key"])) if gmsg else sum(len(w.read_rows) for w in works)
            sends = int(len(works.a["t_dst"])) if gmsg else sum(len(w.send_rows) for w in works)
            del works, wire, gmsg
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = {}
    if not a.no_memory:  # untimed: tracemalloc slows allocation down
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        cache = {}
        kept = plan_save([LocalPlan.from_parts(p, cache) for p in coordinator_side(save_g)])
        peak["save"] = tracemalloc.get_traced_memory()[1] - base
        if not a.no_load:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            w_, _ = plan_load_auto(load_requests(load_g), layouts, hosts, LoadOptions(), 1.0)
            peak["load"] = tracemalloc.get_traced_memory()[1] - base
            del w_
        tracemalloc.stop()
        del kept
    save_enc = statistics.median(senc)
    # gloo's broadcast is a binomial tree: its root sends ceil(log2(world)) copies
    fan = max(1, math.ceil(math.log2(world))) if world > 1 else 0
    # run_collectively's scatter: the replies' sizes (int64 each, broadcast) and an empty
    # reply per rank, then the plan's broadcast (its length, then the bytes)
    reply = len(msgpack.packb([0, msgpack.packb(None)]))
    scatter = fan * 8 * world + world * reply
    save_msgs = scatter + fan * (8 + len(gsave))
    m = Manifest(
        plan.tree,
        {
            k: TensorEntry(k, array_path_for(k), v.shape, v.dtype, v.chunk_shape)
            for k, v in plan.tensors.items()
        },
        plan.objects,
        save_world_size=world,
    )
    man = encode_manifest(m)
    st = plan.stats
    med = statistics.median
    print(
        f"job: {world} ranks (TP {a.tp} x PP {a.pp} x DP {a.dp}), {st['tensors']} tensors, "
        f"{nh:,} holdings, {st['unique_bytes'] / 2**30:.1f} GiB unique, "
        f"{'empty trees' if a.no_trees else 'full trees'}; medians of {a.repeat} runs "
        f"(min-max), {a.clock} clock"
    )
    print(
        f"  decode on coordinator           {_median(dec)}  (the gather's coordinator "
        "side: offers, requests, blobs checked and assembled; local plans decoded)"
    )
    print(f"  plan_save on coordinator        {_median(pl)}")
    print(
        f"  save plan end to end            {_median(tot)}  "
        f"({med(tot) / 1.0:.2f}x the 1.0 s target)"
    )
    st_e = [x + y + z for x, y, z in zip(tot, senc, scut)]
    print(
        f"  ... plan encoded once + cut     {_median(st_e)}  "
        f"({med(st_e) / 1.0:.2f}x the 1.0 s target: what save()'s decide() runs and the "
        "slowest rank's cut of its own work; the broadcast itself not timed)"
    )
    load_sent = None
    if lds:
        print(
            f"  load plan (decode + plan_load)  {_median(lds)}  "
            f"({med(lds) / 1.0:.2f}x the 1.0 s target; {reads:,} reads, {sends:,} transfers)"
        )
        print(
            f"  load plan as load() runs it     {_median(auto)}  "
            f"({med(auto) / 1.0:.2f}x the 1.0 s target; plan_load_auto, 8 ranks per host, "
            f"picked {costs.strategy})"
        )
        if gbytes:
            lt = [x + y + z for x, y, z in zip(auto, lenc, derive)]
            print(
                f"  encode the load plan, once       {_median(lenc)}  (one message for "
                f"every rank: {gbytes / 1e6:.1f} MB)"
            )
            print(
                f"  a rank cuts its own work         {_median(derive)}  (the slowest of "
                "the ranks timed: most reads, most received, a spread of others)"
            )
            print(
                f"  load plan end to end             {_median(lt)}  "
                f"({med(lt) / 1.0:.2f}x the 1.0 s target: plan_load_auto + encode + cut; "
                "the broadcast itself not timed)"
            )
            lfan = max(1, math.ceil(math.log2(world))) if world > 1 else 0
            load_sent = load_g["requests"] + lfan * gbytes + world * reply
            print(
                f"  load, busiest rank (coordinator): received {load_g['received'] / 1e6:.1f}"
                f" MB, sent {load_sent / 1e6:.1f} MB ({load_sent / 50e6:.2f}x the 50 MB "
                f"target: the plan and costs {gbytes / 1e6:.1f} MB x {lfan} (gloo's "
                f"binomial-tree broadcast), replies "
                f"{world * reply / 1e6:.1f}"
                f" MB, blob requests {load_g['requests'] / 1e6:.2f} MB); every other rank "
                f"receives {(gbytes + reply + load_g['requests']) / 1e6:.1f} MB"
            )
        else:
            print(
                f"  encode per-rank load work       {_median(lenc)}  "
                f"(all ranks; {wsum / 1e6:.1f} MB sent by the coordinator, largest "
                f"{wmax / 2**10:.1f} KiB)"
            )
    print(
        f"  encode the save plan, once      {_median(senc)}  (one message for every "
        f"rank: {len(gsave) / 1e6:.2f} MB)"
    )
    print(
        f"  a rank cuts its own save work   {_median(scut)}  (the slowest of the ranks "
        "timed: most writes, sends, receives, a spread of others)"
    )
    save_sent = save_g["requests"] + save_msgs
    print(
        f"  save, busiest rank (coordinator): received {save_g['received'] / 1e6:.1f} MB, "
        f"sent {save_sent / 1e6:.1f} MB ({max(save_g['received'], save_sent) / 50e6:.2f}x "
        f"the 50 MB target: the plan {len(gsave) / 1e6:.2f} MB x {fan} (gloo's binomial-"
        f"tree broadcast), the scatter's sizes and empty replies {scatter / 1e6:.2f} MB, "
        f"blob requests {save_g['requests'] / 1e6:.2f} MB); every other rank receives "
        f"{(len(gsave) + 8 * world + reply + save_g['requests']) / 1e6:.2f} MB"
    )
    if peak:
        print(
            f"  planning peak memory (traced)     {peak['save'] / 2**20:8.1f} MiB save "
            f"(decode + plan_save, plan kept)"
            + (f", {peak['load'] / 2**20:.1f} MiB load (plan_load_auto)" if "load" in peak else "")
        )
    print(
        f"  max RSS growth during planning    {(rss1 - rss0) / 2**10:8.1f} MiB "
        f"(process max RSS {rss1 / 2**10:.0f} MiB, reached while building the job)"
    )
    print(
        f"  chunks {st['chunks']:,}, exchange {st['exchange_bytes'] / 2**20:.1f} MiB "
        f"({st['exchange_bytes'] / max(1, st['unique_bytes']):.4%} of unique), "
        f"max bytes written by a rank {st['bytes_per_rank_max'] / 2**20:.1f} MiB"
    )
    print(f"  save plan message                 {len(gsave) / 2**10:8.1f} KiB (once)")
    print(f"  manifest                          {len(man) / 2**10:8.1f} KiB")
    if a.json:
        lt = [x + y + z for x, y, z in zip(auto, lenc, derive)] if lds and gbytes else []
        rec = record(
            a,
            argv,
            world,
            nh,
            st,
            {
                "decode on coordinator": dec,
                "plan_save on coordinator": pl,
                "save plan end to end": tot,
                "save plan encoded once + cut": st_e,
                "load plan (decode + plan_load)": lds,
                "load plan as load() runs it": auto,
                "encode the load plan": lenc,
                "a rank cuts its own load work": derive,
                "load plan end to end": lt,
                "encode the save plan": senc,
                "a rank cuts its own save work": scut,
            },
            {
                "save: received by the coordinator": save_g["received"],
                "save: sent by the coordinator": save_sent,
                "load: received by the coordinator": load_g["received"] if load_g else None,
                "load: sent by the coordinator": load_sent,
                "save plan message": len(gsave),
                "manifest": len(man),
            },
            peak,
        )
        rec.data["samples"] = {
            "world": world,
            "gathered_bytes": save_g["received"],
            "load_gathered_bytes": load_g["received"] if load_g else None,
            "decode_s": dec,
            "plan_save_s": pl,
            "save_total_s": tot,
            "plan_load_s": lds,
            "plan_load_auto_s": auto,
            "encode_load_s": lenc,
            "cut_load_s": derive,
            "encode_save_s": save_enc,
            "encode_save_runs_s": senc,
            "cut_save_s": scut,
            "save_plan_bytes": len(gsave),
            "save_sent_bytes": save_sent,
            "peak_bytes": peak,
        }
        rec.write(a.json)


TARGET_S, TARGET_BYTES = 1.0, 50e6
# the rows that have a target (1.0 s each, as printed)
TIMED_TARGETS = (
    "save plan end to end",
    "save plan encoded once + cut",
    "load plan (decode + plan_load)",
    "load plan as load() runs it",
    "load plan end to end",
)


def record(a, argv, world: int, holdings: int, st: dict, times: dict, sizes: dict, peak: dict):
    """The printed figures as data: each planning step's seconds (median, min-max, x the
    1.0 s target where it has one), the bytes the coordinator receives and sends (x the
    50 MB target), and planning peak memory."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_results as br

    rec = br.Record(
        "plan_scale.py",
        f"Global planning of a simulated {world:,}-rank job",
        argv,
        {
            "quick": a.quick,
            "world": world,
            "tp": a.tp,
            "pp": a.pp,
            "dp": a.dp,
            "layers": a.layers,
            "hidden": a.hidden,
            "vocab": a.vocab,
            "repeat": a.repeat,
            "clock": a.clock,
            "trees": not a.no_trees,
            "holdings": holdings,
            "tensors": st["tensors"],
            "chunks": st["chunks"],
            "unique_bytes": st["unique_bytes"],
        },
    )
    t = rec.table(
        "planning",
        f"Planning at {world:,} ranks (TP {a.tp} x PP {a.pp} x DP "
        f"{a.dp}, {holdings:,} holdings): medians of {a.repeat} runs, {a.clock} "
        "clock",
        "s",
    )
    for label, v in times.items():
        if v:
            br.Record.row(
                t,
                label,
                v,
                {"x target": {"value": statistics.median(v) / TARGET_S}}
                if label in TIMED_TARGETS
                else None,
            )
    b = rec.table("bytes", f"What the coordinator receives and sends at {world:,} ranks", "bytes")
    for label, n in sizes.items():
        if n is not None:
            br.Record.row(
                b,
                label,
                [n],
                {"x target": {"value": n / TARGET_BYTES}}
                if label.startswith(("save:", "load:"))
                else None,
            )
    for k, v in peak.items():
        br.Record.row(b, f"planning peak memory ({k}, traced)", [v])
    return rec


if __name__ == "__main__":
    main()
