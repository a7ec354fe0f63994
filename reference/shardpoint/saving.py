"""``save``: a collective save of a state tree, from local plans to the committed manifest.

Every rank calls it with its own tree; planning runs on the coordinator (rank 0 of the group)
and each phase ends in an agreement step, so a failure on any rank raises the same error on
every rank instead of leaving one waiting.
"""
from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import msgpack
import torch

from . import dtypes, errors, values
from .exchange import Comm, agree, exchange, run_collectively
from .metadata import Manifest, TensorEntry, array_path_for, encode_manifest
from .model import flatten_state
from .planner import LocalPlan, PlanOptions, RankSaveWork, plan_objects, plan_save
from .storage import ArraySpec, StorageBackend, get_backend
from .views import PieceViews, box_view, host_copy, to_numpy

log = logging.getLogger("shardpoint")


@dataclass
class SaveOptions:
    """Writer knobs for ``save`` (none of them changes what a reader must understand)."""

    plan: PlanOptions = field(default_factory=PlanOptions)
    exchange_budget_bytes: int = 256 << 20
    cache_plan: bool = True   # reuse the last plan when no rank's structure changed


@dataclass
class SaveResult:
    """What a save did, for logs and benchmarks (same on every rank except ``rank_*``)."""

    path: str
    world_size: int
    tensors: int
    unique_bytes: int
    exchange_bytes: int
    chunks: int
    rank_bytes_written: int
    timings: dict


# -------------------------------------------------------------------------------- plan cache
_PLAN_CACHE: dict = {}   # group key -> (this rank's structure digest, plan on the coordinator)


def _group_key(comm: Comm) -> tuple:
    import torch.distributed as dist
    if comm.size == 1:
        return ("single",)
    return ("group", comm.size, tuple(dist.get_process_group_ranks(comm.group or
                                                                  dist.group.WORLD)))


def _strip_values(tree: Any) -> Any:
    if "dict" in tree:
        return {"dict": [[k, _strip_values(v)] for k, v in tree["dict"]]}
    for kind in ("list", "tuple"):
        if kind in tree:
            return {kind: [_strip_values(v) for v in tree[kind]]}
    return {"value": None} if "value" in tree else tree


def _structure_digest(flat) -> bytes:
    """What the plan depends on: tree shape, holdings, object ids (not plain values)."""
    import hashlib
    body = msgpack.packb([_strip_values(flat.tree), [t.holding.to_wire() for t in flat.tensors],
                          [[o.key, o.index, o.count, list(o.replica)] for o in flat.objects]])
    return hashlib.sha256(body).digest()


def _value_leaves(tree: Any) -> list:
    from .model import iter_tree_leaves
    return [[list(p), n["value"]] for p, n in iter_tree_leaves(tree) if "value" in n]


def _with_values(tree: Any, per_rank: list) -> Any:
    """``tree`` with each plain value replaced by the lowest rank's new value at its path."""
    new: dict = {}
    for leaves in per_rank:
        for p, v in leaves:
            new.setdefault(tuple(p), v)

    def walk(node: Any, path: tuple) -> Any:
        if "dict" in node:
            return {"dict": [[k, walk(v, path + (k,))] for k, v in node["dict"]]}
        for kind in ("list", "tuple"):
            if kind in node:
                return {kind: [walk(v, path + (i,)) for i, v in enumerate(node[kind])]}
        return {"value": new[path]} if "value" in node else node

    return walk(tree, ())


# -------------------------------------------------------------------------------- save
def save(state: Any, path: str, *, group: Any = None, overwrite: bool = False,
         backend: Optional[StorageBackend] = None,
         options: Optional[SaveOptions] = None) -> SaveResult:
    """Save ``state`` (a nested dict/list/tuple) as a checkpoint at ``path``. Collective.

    Leaves: torch tensors and numpy arrays (replicas across ranks), :class:`ShardedTensor`,
    DTensor, :class:`ShardedObject` and plain values (None, bool, int, float, str, bytes).
    The checkpoint becomes visible only once every rank has written its part; on any failure
    every rank raises and nothing is committed (a previous checkpoint at ``path`` survives).
    """
    comm, be = Comm(group), get_backend(backend)
    opts = options or SaveOptions()
    times: dict = {}
    t0 = time.perf_counter()
    path = str(path)
    flat_box: dict = {}
    cache_key = _group_key(comm)
    # Plan cache: when no rank's structure (tree shape, holdings, object ids) changed since
    # the last save over this group, ranks send only their values and the coordinator
    # reuses the plan ([SP-GRID-1] holds: the layout depends on structure only).
    err0: Optional[BaseException] = None
    try:
        flat = flatten_state(state, replica=(comm.rank,))
        flat_box["flat"] = flat
        struct = _structure_digest(flat) + repr(opts.plan).encode()
    except Exception as e:  # noqa: BLE001 - reported collectively below
        err0, struct = e, b""
    hit = err0 is None and opts.cache_plan and _PLAN_CACHE.get(cache_key, (None,))[0] == struct
    all_hit = comm.all_true(bool(hit))

    def local() -> bytes:
        if err0 is not None:
            raise err0
        f = flat_box["flat"]
        objs = [(o.key, o.index, o.count, o.replica, o.value) for o in f.objects]
        if all_hit:
            return values.pack([_value_leaves(f.tree), [list(o) for o in objs]])
        return LocalPlan(comm.rank, f.tree, [t.holding for t in f.tensors], objs).to_bytes()

    plan_box: dict = {}

    def decide(payloads: list) -> list:
        t = time.perf_counter()
        if all_hit:
            plan = _PLAN_CACHE[cache_key][1]
            got = [values.unpack(b) for b in payloads]
            plan.tree = _with_values(plan.tree, [v for v, _ in got])
            plan.objects = plan_objects([LocalPlan(r, None, [], [tuple(o) for o in objs])
                                          for r, (_, objs) in enumerate(got)])
        else:
            plan = plan_save([LocalPlan.from_bytes(b) for b in payloads], opts.plan)
        times["plan"] = time.perf_counter() - t
        if be.checkpoint_state(path) == "committed" and not overwrite:
            raise errors.CheckpointExistsError(f"a checkpoint already exists at {path!r}; pass "
                                               "overwrite=True to replace it")
        staging = be.staging_path(path, secrets.token_hex(6))
        be.begin_save(staging)
        plan_box["plan"], plan_box["staging"] = plan, staging
        layouts = {k: [list(v.shape), v.dtype, list(v.chunk_shape)]
                   for k, v in plan.tensors.items()}
        out = []
        for w in plan.ranks:
            keys = {c.key for c in w.writes} | set(w.create)
            out.append(msgpack.packb([staging, w.to_bytes(),
                                      {k: layouts[k] for k in keys}, plan.stats]))
        return out

    try:
        msg = run_collectively(comm, local, decide, errors.InvalidShardingError)
    except errors.ShardpointError:
        _PLAN_CACHE.pop(cache_key, None)
        raise
    staging, work_b, layouts, stats = msgpack.unpackb(msg, strict_map_key=False)
    work = RankSaveWork.from_bytes(work_b)
    times["plan_total"] = time.perf_counter() - t0
    times["plan_cached"] = all_hit

    err: Optional[BaseException] = None
    written = 0
    try:
        t = time.perf_counter()
        written = _execute_save(comm, be, flat_box["flat"], work, staging, layouts, opts)
        times["write"] = time.perf_counter() - t
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        err = e
        log.error("shardpoint save: rank %d failed: %s", comm.rank, e)

    def commit_local() -> bytes:
        if err is not None:
            raise err if isinstance(err, errors.ShardpointError) else errors.SaveFailedError(
                f"{type(err).__name__}: {err}")
        return b""

    def commit(_payloads: list) -> list:
        plan = plan_box["plan"]
        try:
            m = Manifest(plan.tree, {k: TensorEntry(k, array_path_for(k), v.shape, v.dtype,
                                                    v.chunk_shape)
                                     for k, v in plan.tensors.items()},
                         plan.objects, save_world_size=comm.size)
            be.write_manifest(staging, encode_manifest(m))
            be.commit(staging, path, overwrite=overwrite)
        except BaseException:
            be.abort(staging)
            raise
        return [b""] * comm.size

    t = time.perf_counter()
    try:
        run_collectively(comm, commit_local, commit, errors.SaveFailedError)
    except errors.ShardpointError:
        _PLAN_CACHE.pop(cache_key, None)
        if comm.is_coordinator and "staging" in plan_box:
            be.abort(plan_box["staging"])
        raise
    if opts.cache_plan:
        _PLAN_CACHE[cache_key] = (struct, plan_box.get("plan"))
    times["commit"] = time.perf_counter() - t
    times["total"] = time.perf_counter() - t0
    if comm.is_coordinator:
        log.info("shardpoint save %s: %d tensors, %.1f MiB unique, %.1f MiB exchanged, "
                 "plan %.3fs%s, write %.3fs, commit %.3fs, total %.3fs", path, stats["tensors"],
                 stats["unique_bytes"] / 2**20, stats["exchange_bytes"] / 2**20,
                 times["plan_total"], " (cached)" if all_hit else "", times.get("write", 0.0),
                 times["commit"], times["total"])
    return SaveResult(path, comm.size, stats["tensors"], stats["unique_bytes"],
                      stats["exchange_bytes"], stats["chunks"], written, times)


def _execute_save(comm: Comm, be: StorageBackend, flat, work: RankSaveWork, staging: str,
                  layouts: dict, opts: SaveOptions) -> int:
    tensors = flat.tensors
    # resolve_conj/resolve_neg: a lazily conjugated or negated view has no numpy form; they
    # copy only tensors carrying those bits.
    src_view = PieceViews([(lt.holding, lt.data.detach().resolve_conj().resolve_neg())
                            for lt in tensors])

    handles: dict = {}

    def handle(key: str):
        if key not in handles:
            shape, dt, chunk = layouts[key]
            handles[key] = be.open_array_for_write(staging, array_path_for(key),
                                                   ArraySpec(tuple(shape), dt, tuple(chunk)))
        return handles[key]

    # Everything local comes first; ranks agree before the exchange so that a rank failing
    # here (bad array, out of memory) cannot leave its peers waiting in a collective.
    err: Optional[BaseException] = None
    buffers: list = []
    sends: list = []
    recvs: list = []
    try:
        for key in work.create:
            handle(key)
        for cw in work.writes:
            if cw.direct is not None:
                buffers.append(None)
                continue
            dt = dtypes.from_name(layouts[cw.key][1]).torch
            buf = torch.empty(cw.shape, dtype=dt)
            for hidx, pidx, bo, bs in cw.local:
                v, off = src_view(hidx, pidx)
                box_view(buf, cw.offset, bo, bs).copy_(box_view(v, off, bo, bs))
            buffers.append(buf)
        for t in work.sends:
            v, off = src_view(*t.src_ref)
            sends.append((t.dst, box_view(v, off, t.box_offset, t.box_shape)))
        recvs += [(t.src, box_view(buffers[t.dst_ref[0]], work.writes[t.dst_ref[0]].offset,
                                    t.box_offset, t.box_shape)) for t in work.recvs]
    except Exception as e:  # noqa: BLE001 - shared with every rank just below
        err = e
    agree(comm, err, errors.SaveFailedError)
    exchange(comm, sends, recvs, opts.exchange_budget_bytes)
    staged = []
    for cw, buf in zip(work.writes, buffers):
        if buf is None:
            v, off = src_view(*cw.direct)
            buf = host_copy(box_view(v, off, cw.offset, cw.shape))
        staged.append(buf)
    if any(d.data.is_cuda for d in tensors):
        torch.cuda.synchronize()  # device-to-pinned copies were issued non-blocking
    ops, keep, written = [], [], 0
    for cw, buf in zip(work.writes, staged):
        arr = to_numpy(buf)
        keep.append(arr)
        written += arr.nbytes
        ops.append(be.write(handle(cw.key), cw.offset, arr))
    be.wait(ops)
    be.flush(staging)
    return written
