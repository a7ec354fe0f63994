"""``load`` and ``read_metadata``: read a checkpoint into any layout, collectively.

The coordinator reads the manifest once and shares it; each rank states the regions it needs
(and its host); a cost model picks how they are read (once and exchanged, or by every rank
directly, see :mod:`.load_planner`); the caller's tensors are filled in place. A failure on any rank raises the same error on every rank.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import msgpack
import torch

from shardpoint.tree import dtypes
from shardpoint_core import errors
from shardpoint.planning.columns import HoldingColumns
from shardpoint.exchange.comm import (AFTER_LOAD, Comm, agree, error_record, exchange,
                                      raise_records,
                                      run_collectively)
from shardpoint.exchange.host import execute_dedup_load
from shardpoint.exchange.topology import host_identity
from shardpoint.planning.load_planner import LoadOptions, encode_works, plan_load_auto
from shardpoint_core.manifest import read_metadata, Manifest, decode_manifest
from shardpoint.api.open_ahead import OpenAhead
from shardpoint.planning.planner import RankLoadWork, TensorLayout
from shardpoint_core.storage import StorageBackend, get_backend
from shardpoint_core.zarr.object_backend import resolve
from shardpoint.tree.targets import collect_targets, full_targets
from shardpoint.tree.views import PieceViews, box_view, copy_into, to_numpy

log = logging.getLogger("shardpoint")


@dataclass
class LoadReport:
    """Filled by ``load(..., report=...)``: what ``like`` asked for that the checkpoint lacks
    (``missing_keys``, only with ``strict=False``) and what it has that was not asked for."""

    missing_keys: list = field(default_factory=list)
    unexpected_keys: list = field(default_factory=list)
    rank_bytes_read: int = 0
    exchange_bytes: int = 0
    timings: dict = field(default_factory=dict)
    strategy: str = ""              # "dedup" or "direct", as the cost model chose
    costs: dict = field(default_factory=dict)   # the cost model's inputs and estimates

    def choice(self) -> str:
        """The cost model's choice in words: ``dedup on 2 hosts (estimated dedup 0.41 s,
        direct 0.83 s)``; a forced strategy says so."""
        c = self.costs
        if not c or not (c.get("dedup_s") or c.get("direct_s")):
            return f"{self.strategy} (not estimated: forced, or one rank)"
        return (f"{self.strategy} on {c['hosts']} host{'s' if c['hosts'] != 1 else ''} "
                f"(estimated dedup {c['dedup_s']:.3g} s, direct {c['direct_s']:.3g} s)")


# -------------------------------------------------------------------------------- load
def load(path: str, like: Any = None, *, group: Any = None, strict: bool = True,
         backend: Optional[StorageBackend] = None, report: Optional[LoadReport] = None,
         exchange_budget_bytes: Optional[int] = None,
         options: Optional[LoadOptions] = None) -> Any:
    """Load a checkpoint. Collective over ``group``.

    Without ``like``: the whole tree, tensors in full on CPU (numpy arrays come back as numpy;
    a sharded object comes back as the list of its values, nested lists along its grid when
    the grid has 2+ dimensions). With ``like``: the tensors of
    ``like`` (plain, :class:`ShardedTensor`, DTensor, numpy) are filled in place from whatever
    layout the checkpoint was saved in, and the returned tree has the loaded values in
    place of plain values; a ``ShardedTensor`` leaf becomes its filled ``data`` and a
    ``ShardedObject`` leaf becomes its stored value. Keys of the checkpoint that ``like`` does
    not ask for are not read. ``options`` (:class:`LoadOptions`) picks how regions are read:
    once and exchanged, or by every rank directly, by a cost model by default.
    """
    path, backend = resolve(path, backend, "load")
    opts = options or LoadOptions()
    budget = exchange_budget_bytes or opts.exchange_budget_bytes
    comm, be = Comm(group), get_backend(backend)
    comm.after_failure = AFTER_LOAD
    report = report if report is not None else LoadReport()
    t0 = time.perf_counter()
    path = str(path)
    identity = getattr(be, "checkpoint_identity", None)
    mbytes = b""
    if comm.is_coordinator:
        try:
            # Taken before the manifest is read and checked again after the last read: a save
            # replacing the checkpoint (overwrite=True) in between is seen, whenever it lands.
            ident = identity(path) if identity else None
            mbytes = b"\x00" + msgpack.packb([ident, be.read_manifest(path)])
        except errors.ShardpointError as e:
            mbytes = b"\x01" + msgpack.packb([error_record(e, 0)])
    mbytes = comm.broadcast_bytes(mbytes)
    if mbytes[:1] == b"\x01":
        raise_records(msgpack.unpackb(mbytes[1:]))
    ident, mbytes = msgpack.unpackb(mbytes[1:])
    mbytes = b"\x00" + mbytes
    m_box: dict = {}
    tgt_box: dict = {}

    def local() -> bytes:
        m = decode_manifest(mbytes[1:])
        m_box["m"] = m
        if like is None:
            targets, built = full_targets(m)
        else:
            targets, built = collect_targets(like, m, strict, report, comm.rank)
        tgt_box["t"], tgt_box["built"] = targets, built
        host = host_identity(opts.host_id)
        cols = HoldingColumns.from_holdings([t.holding for t in targets])
        return msgpack.packb([host, cols.to_wire()])

    def decide(payloads: list) -> list:
        m = m_box["m"] if "m" in m_box else decode_manifest(mbytes[1:])  # local() ran here
        layouts = {k: TensorLayout(k, e.shape, e.dtype, e.chunk_shape)
                   for k, e in m.tensors.items()}
        got = [msgpack.unpackb(p) for p in payloads]
        reqs = [HoldingColumns.from_wire(w) for _, w in got]
        xg = opts.exchange_gbps or (20.0 if comm.device.type == "cuda" else 1.0)
        works, costs = plan_load_auto(reqs, layouts, [h for h, _ in got], opts, xg)
        c = {k: v for k, v in vars(costs).items() if k != "notes"}
        return [msgpack.packb([c, w]) for w in encode_works(works, layouts)]

    costs, wbytes = msgpack.unpackb(run_collectively(
        comm, local, decide, errors.LayoutMismatchError,
        same=[("checkpoint path", os.path.normpath(path)),
              ("LoadOptions.strategy", opts.strategy),
              ("exchange budget", int(budget)),
              ("LoadOptions.shm_exchange", bool(opts.shm_exchange)),
              ("LoadOptions.shm_round_bytes", int(opts.shm_round_bytes))]))
    work = RankLoadWork.from_bytes(wbytes, m_box["m"].tensors)
    report.strategy, report.costs = costs["strategy"], costs
    report.timings["plan"] = time.perf_counter() - t0
    err: Optional[BaseException] = None
    try:
        t = time.perf_counter()
        report.rank_bytes_read, report.exchange_bytes = _execute_load(
            comm, be, path, m_box["m"], tgt_box["t"], work, budget, report.timings,
            opts, costs["strategy"] == "dedup")
        report.timings["read"] = time.perf_counter() - t
        if ident is not None and identity(path) != ident:
            raise errors.LoadFailedError(
                f"the checkpoint at {path!r} was replaced (or removed) by another save while "
                "this load read it, so what was read may mix two checkpoints; nothing was "
                "returned. Load again, and do not save over a checkpoint (overwrite=True, a "
                "manager's force=True or retention) while another job loads it")
    except Exception as e:  # noqa: BLE001
        if getattr(e, "_sp_agreed", False):
            raise  # every rank raised it already
        err = e
    agree(comm, err, errors.LoadFailedError)
    report.timings["total"] = time.perf_counter() - t0
    if comm.is_coordinator:
        log.info("shardpoint load %s (%s): rank 0 read %.1f MiB, sent %.1f MiB; plan %.3fs, "
                 "read %.3fs, total %.3fs", path, report.choice(), report.rank_bytes_read / 2**20,
                 report.exchange_bytes / 2**20, report.timings["plan"],
                 report.timings.get("read", 0.0), report.timings["total"])
    if report.missing_keys:
        log.warning("shardpoint load: %d key(s) not in the checkpoint were skipped: %s",
                    len(report.missing_keys), report.missing_keys[:10])
    return tgt_box["built"]


def _execute_load(comm: Comm, be: StorageBackend, path: str, m: Manifest, targets: list,
                  work: RankLoadWork, budget: int, timings: dict, opts: LoadOptions,
                  exchanging: bool) -> tuple:
    dst_view = PieceViews([(tg.holding, tg.data) for tg in targets])

    def open_array(key: str) -> Any:
        e = m.tensors[key]
        return be.open_array_for_read(path, e.array, e.spec, key)

    with OpenAhead(open_array, [op.key for op in work.reads],
                   getattr(be, "open_concurrency", None)) as handle:   # object stores: more
        return _execute_reads(comm, be, work, budget, timings, opts, exchanging, m, dst_view,
                              handle)


def _execute_reads(comm: Comm, be: StorageBackend, work: RankLoadWork, budget: int,
                   timings: dict, opts: LoadOptions, exchanging: bool, m: Manifest,
                   dst_view: PieceViews, handle: OpenAhead) -> tuple:
    if exchanging and comm.size > 1:   # the same on every rank: the plan's strategy is global
        return execute_dedup_load(
            comm, be, work, budget, timings, dst_view, handle,
            lambda key: dtypes.from_name(m.tensors[key].dtype).torch,
            host_identity(opts.host_id), opts.shm_exchange, opts.shm_round_bytes)
    # Reads and local copies first; ranks agree before the exchange, so a corrupt chunk
    # seen by one rank is raised everywhere instead of leaving peers in a collective.
    err: Optional[BaseException] = None
    nread = 0
    sends: list = []
    recvs: list = []
    try:
        ops, bufs, post = [], [], []
        for op in work.reads:
            dt = dtypes.from_name(m.tensors[op.key].dtype).torch
            if op.direct is not None:
                v, off = dst_view(*op.direct)
                v = box_view(v, off, op.offset, op.shape)
                if v.device.type == "cpu":
                    buf = v
                else:
                    buf = torch.empty(op.shape, dtype=dt, pin_memory=torch.cuda.is_available())
                    post.append((v, buf))
                bufs.append(None)
            else:
                buf = torch.empty(op.shape, dtype=dt)
                bufs.append(buf)
            nread += buf.numel() * buf.element_size()
            ops.append(be.read_into(handle(op.key), op.offset, to_numpy(buf)))
        be.wait(ops)
        for v, buf in post:
            v.copy_(buf, non_blocking=True)
        for op, buf in zip(work.reads, bufs):
            for q, pi, bo, bs in op.local:
                v, off = dst_view(q, pi)
                copy_into(box_view(v, off, bo, bs), box_view(buf, op.offset, bo, bs))
        sends += [(t.dst, box_view(bufs[t.src_ref[0]], work.reads[t.src_ref[0]].offset,
                                   t.box_offset, t.box_shape)) for t in work.sends]
        for t in work.recvs:
            v, off = dst_view(*t.dst_ref)
            recvs.append((t.src, box_view(v, off, t.box_offset, t.box_shape)))
    except Exception as e:  # noqa: BLE001 - shared with every rank just below
        err = e
    agree(comm, err, errors.LoadFailedError)
    t = time.perf_counter()
    exchange(comm, sends, recvs, budget)
    timings["exchange"] = time.perf_counter() - t
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    moved = sum(v.numel() * v.element_size() for _, v in sends)
    return nread, moved
