"""``load``: read a checkpoint into any layout, collectively (:class:`LoadJob`).

The coordinator reads the manifest once and shares it; each rank states the regions it needs
(and its host); a cost model picks how they are read (once and exchanged, or by every rank
directly, see :mod:`.load_planner`); the caller's tensors are filled in place. A failure on
any rank raises the same error on every rank. The result is a :class:`LoadResult`.
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
from shardpoint_core.format import errors
from shardpoint.planning.columns import HoldingColumns
from shardpoint.api.heap import release_free_heap
from shardpoint.exchange.comm import (
    AFTER_LOAD,
    Comm,
    agree,
    error_record,
    exchange,
    raise_records,
    run_collectively,
)
from shardpoint.exchange.host import execute_dedup_load
from shardpoint.exchange.topology import host_identity
from shardpoint.planning.load_dedup import LoadWorks, encode_global, work_from_global
from shardpoint.planning.load_planner import LoadOptions, encode_works, plan_load_auto
from shardpoint_core.transactions.resolve import read_metadata  # noqa: F401
from shardpoint_core.format.manifest import Manifest
from shardpoint.api.open_ahead import OpenAhead
from shardpoint.planning.planner import RankLoadWork, TensorLayout
from shardpoint_core.transactions.protocol import StorageBackend
from shardpoint_core.stores.registry import is_local
from shardpoint_core.transactions.reader import CheckpointReader
from shardpoint_core.transactions.resolve import resolve
from shardpoint_core.arrays.precheck import check_arrays_exist, check_large_grids
from shardpoint.tree.targets import collect_targets, full_targets
from shardpoint.tree.views import PieceViews, box_view, copy_into, to_numpy

log = logging.getLogger("shardpoint")


@dataclass
class LoadResult:
    """What a load did, for the caller, logs and benchmarks: the loaded ``tree`` (what
    ``sp.load`` returns), what ``like`` asked for that the checkpoint lacks
    (``missing_keys``, only with ``strict=False``) and what the checkpoint has that was not
    asked for (``unexpected_keys``), the bytes this rank read and sent, the read strategy the
    cost model chose (``"dedup"`` or ``"direct"``) with its inputs and estimates, and
    ``timings`` in seconds (``plan``, ``read``, ``exchange``, ``total``). Every field has a
    default, so ``sp.load(..., report=sp.LoadResult())`` can hand one in to be filled."""

    tree: Any = None
    path: str = ""
    world_size: int = 1
    missing_keys: list = field(default_factory=list)
    unexpected_keys: list = field(default_factory=list)
    rank_bytes_read: int = 0
    exchange_bytes: int = 0
    timings: dict = field(default_factory=dict)
    strategy: str = ""  # "dedup" or "direct", as the cost model chose
    costs: dict = field(default_factory=dict)  # the cost model's inputs and estimates

    def choice(self) -> str:
        """The cost model's choice in words: ``dedup on 2 hosts (estimated dedup 0.41 s,
        direct 0.83 s)``; a forced strategy says so."""
        c = self.costs
        if not c or not (c.get("dedup_s") or c.get("direct_s")):
            return f"{self.strategy} (not estimated: forced, or one rank)"
        return (
            f"{self.strategy} on {c['hosts']} host{'s' if c['hosts'] != 1 else ''} "
            f"(estimated dedup {c['dedup_s']:.3g} s, direct {c['direct_s']:.3g} s)"
        )


LoadReport = LoadResult  # the name ``load(..., report=sp.LoadReport())`` has always taken


# -------------------------------------------------------------------------------- one load
class LoadJob:
    """One load's state (manifest, targets, this rank's work, timings), one method per phase,
    mirroring :class:`~shardpoint.api.saving.SaveJob`: :meth:`read_manifest` ->
    :meth:`plan` -> :meth:`read` -> :meth:`result`. Collective over ``comm``; a failure on
    any rank raises the same error on every rank. Every read goes through this rank's
    :class:`~shardpoint_core.transactions.reader.CheckpointReader` (``reader``): the
    coordinator opens it, the other ranks make theirs from the manifest it sends."""

    def __init__(
        self, path: str, like: Any, comm: Comm, be: StorageBackend, strict: bool, opts: LoadOptions
    ) -> None:
        self.path, self.like, self.comm, self.be = str(path), like, comm, be
        self.strict, self.opts = strict, opts
        self.out = LoadResult(path=self.path, world_size=comm.size)
        self.t0 = time.perf_counter()
        self.reader: Optional[CheckpointReader] = None  # once the manifest is known
        self.m: Optional[Manifest] = None
        self.targets: list = []
        self.built: Any = None
        self.work: Optional[RankLoadWork] = None
        self._global_plan: Optional[bytes] = None  # the coordinator's dedup plan, to send
        self.costs: dict = {}
        self.budget = opts.exchange_budget_bytes

    def _opened(self) -> CheckpointReader:
        """This rank's reader, which :meth:`read_manifest` sets before any later phase."""
        assert self.reader is not None, "a load phase ran before read_manifest()"
        return self.reader

    def _manifest(self) -> Manifest:
        """The manifest, which every rank takes in :meth:`_local` (the plan's first step)."""
        assert self.m is not None, "a load phase ran before the plan read the manifest"
        return self.m

    def _planned_work(self) -> RankLoadWork:
        """This rank's work, which :meth:`plan` sets."""
        assert self.work is not None, "a load phase ran before plan()"
        return self.work

    # ---------------------------------------------------------------------- phase 1
    def read_manifest(self) -> None:
        """The coordinator reads the manifest once and shares its bytes (or its error)."""
        comm, mbytes = self.comm, b""
        if comm.is_coordinator:
            try:
                # The identity of the commit whose manifest is read, checked again after the
                # last read: a save replacing the checkpoint (overwrite=True) in between is
                # seen. On an object store it comes with the manifest's GET (no HEAD first).
                self.reader = CheckpointReader.open(self.path, backend=self.be)
                mbytes = b"\x00" + msgpack.packb([self.reader.identity, self.reader.manifest_bytes])
            except errors.ShardpointError as e:
                mbytes = b"\x01" + msgpack.packb([error_record(e, 0)])
        mbytes = comm.broadcast_bytes(mbytes)
        if mbytes[:1] == b"\x01":
            raise_records(msgpack.unpackb(mbytes[1:]))
        if self.reader is None:
            ident, data = msgpack.unpackb(mbytes[1:])
            self.reader = CheckpointReader.from_manifest(self.path, data, ident, backend=self.be)

    # ---------------------------------------------------------------------- phase 2
    def plan(self) -> None:
        """Each rank states the regions it needs; the coordinator's cost model picks how they
        are read and hands each rank its work."""
        reply = msgpack.unpackb(
            run_collectively(
                self.comm,
                self._local,
                self._decide,
                errors.LayoutMismatchError,
                same=[
                    ("checkpoint path", os.path.normpath(self.path)),
                    ("LoadOptions.strategy", self.opts.strategy),
                    ("exchange budget", int(self.budget)),
                    ("LoadOptions.shm_exchange", bool(self.opts.shm_exchange)),
                    ("LoadOptions.shm_round_bytes", int(self.opts.shm_round_bytes)),
                ],
            )
        )
        if reply is None:  # a dedup plan: sent whole with the costs, each rank cuts its own
            costs, plan = msgpack.unpackb(self.comm.broadcast_bytes(self._global_plan))
            self._global_plan = None
            self.work = work_from_global(plan, self.comm.rank, self._manifest().tensors)
        else:
            costs, wbytes = reply
            self.work = RankLoadWork.from_bytes(wbytes, self._manifest().tensors)
        self.costs = costs
        self.out.strategy, self.out.costs = costs["strategy"], costs
        self.out.timings["plan"] = time.perf_counter() - self.t0

    def _local(self) -> list:
        try:
            return self._local_plan()
        except errors.CorruptCheckpointError as e:
            # files: the arrays are checked here, before any read; one gone because the
            # checkpoint was removed or replaced meanwhile is said as such, as in read()
            new = self._removed_meanwhile(e)
            if new is e:
                raise
            raise new from e

    def _local_plan(self) -> list:
        self.m = m = self._opened().manifest
        local = is_local(self.path)  # files checked before targets and plans (issue 28)
        if self.like is None:
            reads = [(k, e, True) for k, e in m.tensors.items()]
            if local:
                check_arrays_exist(self.path, reads)
            self.targets, self.built = full_targets(m)
        else:
            self.targets, self.built = collect_targets(
                self.like, m, self.strict, self.out, self.comm.rank
            )
            reads = [
                (
                    t.holding.key,
                    m.tensors[t.holding.key],
                    t.holding.flat is None
                    and tuple(t.holding.shape) == tuple(t.holding.global_shape),
                )
                for t in self.targets
            ]
            if local:
                check_arrays_exist(self.path, reads)
        if local:
            check_large_grids(self.path, reads)
        host = host_identity(self.opts.host_id)
        meta, blobs = HoldingColumns.from_holdings([t.holding for t in self.targets]).to_parts()
        return [msgpack.packb([host, meta]), *blobs]

    def _decide(self, payloads: list) -> list:
        m = self.m if self.m is not None else self._opened().manifest
        layouts = {
            k: TensorLayout(k, e.shape, e.dtype, e.chunk_shape) for k, e in m.tensors.items()
        }
        got = [msgpack.unpackb(p[0]) for p in payloads]
        cache: dict = {}  # distinct holdings runs, decoded once
        reqs = [HoldingColumns.from_parts(m, p[1:], cache) for (_, m), p in zip(got, payloads)]
        xg = self.opts.exchange_gbps or (20.0 if self.comm.device.type == "cuda" else 1.0)
        works, costs = plan_load_auto(
            reqs, layouts, [h for h, _ in got], self.opts, xg, host_cache=is_local(self.path)
        )
        c = {k: v for k, v in vars(costs).items() if k != "notes"}
        if isinstance(works, LoadWorks):
            # one message for every rank, broadcast after this reply: per-rank messages
            # would carry each transfer twice (its sender's and its receiver's), hundreds
            # of MB sent by the coordinator for a 16,384-rank load
            self._global_plan = msgpack.packb([c, encode_global(works, layouts)])
            return [msgpack.packb(None)] * len(works)
        return [msgpack.packb([c, w]) for w in encode_works(works, layouts)]

    # ---------------------------------------------------------------------- phase 3
    def read(self, budget: int) -> None:
        """Read this rank's regions (and exchange them, by the plan's strategy) into the
        targets; ranks agree on the outcome."""
        err: Optional[BaseException] = None
        try:
            t = time.perf_counter()
            self.out.rank_bytes_read, self.out.exchange_bytes = self._execute(budget)
            self.out.timings["read"] = time.perf_counter() - t
            if not self._opened().unchanged():
                raise errors.LoadFailedError(
                    f"the checkpoint at {self.path!r} was replaced (or removed) by another "
                    "save while this load read it, so what was read may mix two checkpoints; "
                    "nothing was returned. Load again, and do not save over a checkpoint "
                    "(overwrite=True, a manager's force=True or retention) while another job "
                    "loads it",
                    spec_id="SP-COMMIT-14",
                )
        except Exception as e:  # noqa: BLE001
            if getattr(e, "_sp_agreed", False):  # every rank raised it already
                new = self._removed_meanwhile(e)
                if new is e:
                    raise
                new._sp_agreed = True  # type: ignore[attr-defined]
                raise new from e
            err = self._removed_meanwhile(e)
        agree(self.comm, err, errors.LoadFailedError)

    def _removed_meanwhile(self, e: BaseException) -> BaseException:
        """``e``, or, where a missing array or chunk is explained by the checkpoint having been
        replaced or removed since its manifest was read (a manager's retention, another job's
        overwrite), a LoadFailedError that says so ([SP-COMMIT-14]), ``e`` as its cause."""
        r = self.reader
        if not (
            isinstance(e, errors.CorruptCheckpointError)
            and r is not None
            and r.identity is not None
        ):
            return e
        try:
            now = r.current_identity()
        except Exception:  # noqa: BLE001 - the original error stands
            return e
        if now == r.identity:
            return e
        err = errors.LoadFailedError(
            f"the checkpoint at {self.path!r} was "
            f"{'removed' if now is None else 'replaced'} by another job while this load read "
            f"it (retention or an overwrite), so its data went missing mid-read ({e}); "
            "nothing was returned. Load again (a manager's load() picks the newest step)",
            spec_id="SP-COMMIT-14",
        )
        return err

    def _execute(self, budget: int) -> tuple:
        reader, work = self._opened(), self._planned_work()
        dst_view = PieceViews([(tg.holding, tg.data) for tg in self.targets])
        keys = [op.key for op in work.reads]
        reader.will_open(keys)  # packed on object stores: every data object's check at once
        with OpenAhead(
            reader.array, keys, getattr(self.be, "open_concurrency", None)
        ) as handle:  # object stores
            if self.costs["strategy"] == "dedup" and self.comm.size > 1:
                # the same on every rank: the plan's strategy is global
                return execute_dedup_load(
                    self.comm,
                    reader,
                    work,
                    budget,
                    self.out.timings,
                    dst_view,
                    handle,
                    self._dtype_of,
                    host_identity(self.opts.host_id),
                    self.opts.shm_exchange,
                    self.opts.shm_round_bytes,
                )
            return self._read_direct(budget, dst_view, handle)

    def _dtype_of(self, key: str) -> torch.dtype:
        m = self.m
        assert m is not None, "read after the plan, which took the manifest"
        return dtypes.from_name(m.tensors[key].dtype).torch

    def _read_direct(self, budget: int, dst_view: PieceViews, handle: OpenAhead) -> tuple:
        """Every rank reads what it needs (or its share, then exchanges the rest). Reads and
        local copies first; ranks agree before the exchange, so a corrupt chunk seen by one
        rank is raised everywhere instead of leaving peers in a collective."""
        comm, reader, work = self.comm, self._opened(), self._planned_work()
        err: Optional[BaseException] = None
        nread = 0
        sends: list = []
        recvs: list = []
        try:
            ops: list = []
            bufs: list[torch.Tensor] = []  # per read, the tensor it fills
            post: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device target, host buffer)
            for op in work.reads:
                dt = self._dtype_of(op.key)
                if op.direct is not None:
                    v, off = dst_view(*op.direct)
                    v = box_view(v, off, op.offset, op.shape)
                    if v.device.type == "cpu":
                        buf = v
                    else:
                        buf = torch.empty(op.shape, dtype=dt, pin_memory=torch.cuda.is_available())
                        post.append((v, buf))
                else:
                    buf = torch.empty(op.shape, dtype=dt)
                bufs.append(buf)
                nread += buf.numel() * buf.element_size()
                ops.append(reader.read_into(handle(op.key), op.offset, to_numpy(buf)))
            reader.wait(ops)
            for v, buf in post:
                v.copy_(buf, non_blocking=True)
            for op, buf in zip(work.reads, bufs):
                for q, pi, bo, bs in op.local:
                    v, off = dst_view(q, pi)
                    copy_into(box_view(v, off, bo, bs), box_view(buf, op.offset, bo, bs))
            sends += [
                (
                    t.dst,
                    box_view(
                        bufs[t.src_ref[0]],
                        work.reads[t.src_ref[0]].offset,
                        t.box_offset,
                        t.box_shape,
                    ),
                )
                for t in work.sends
            ]
            for t in work.recvs:
                v, off = dst_view(*t.dst_ref)
                recvs.append((t.src, box_view(v, off, t.box_offset, t.box_shape)))
        except Exception as e:  # noqa: BLE001 - shared with every rank just below
            err = e
        agree(comm, err, errors.LoadFailedError)
        t = time.perf_counter()
        exchange(comm, sends, recvs, budget)
        self.out.timings["exchange"] = time.perf_counter() - t
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        moved = sum(v.numel() * v.element_size() for _, v in sends)
        return nread, moved

    # ---------------------------------------------------------------------- phase 4
    def result(self) -> LoadResult:
        """The typed result, its tree filled; drops the job's references to the targets."""
        out = self.out
        out.timings["total"] = time.perf_counter() - self.t0
        out.tree = self.built
        if self.comm.is_coordinator:
            log.info(
                "shardpoint load %s (%s): rank 0 read %.1f MiB, sent %.1f MiB; plan "
                "%.3fs, read %.3fs, total %.3fs",
                self.path,
                out.choice(),
                out.rank_bytes_read / 2**20,
                out.exchange_bytes / 2**20,
                out.timings["plan"],
                out.timings.get("read", 0.0),
                out.timings["total"],
            )
        if out.missing_keys:
            log.warning(
                "shardpoint load: %d key(s) not in the checkpoint were skipped: %s",
                len(out.missing_keys),
                out.missing_keys[:10],
            )
        self.targets, self.built, self.like = [], None, None
        return out

    def close(self) -> None:
        """The end of the load, whatever its outcome: the reader lets the backend drop what
        it kept for this load's reads."""
        if self.reader is not None:
            self.reader.close()


def check_load_args(path: Any, like: Any) -> None:
    """A path that is not one is refused naming its type, not printed whole as "the path"
    (``load(state, "ckpt/1")``: the arguments look swapped, as ``save`` says of its own)."""
    if isinstance(path, (str, bytes, os.PathLike)):
        return
    what = (
        f"the path passed to load(path, like) is a {type(path).__name__}, not a str or os.PathLike"
    )
    if isinstance(like, (str, bytes, os.PathLike)):
        raise errors.InvalidOptionError(
            f"{what}, and like is a path ({os.fsdecode(like)!r}); arguments swapped? call "
            "load(path, like): the path comes first in load, the state first in save(state, "
            "path)"
        )
    raise errors.InvalidOptionError(f"{what}; call load(path) or load(path, like)")


def run_load(
    path: str,
    like: Any,
    comm: Comm,
    be: Optional[StorageBackend],
    strict: bool,
    opts: LoadOptions,
    budget: Optional[int] = None,
) -> LoadResult:
    """One load, phase by phase (what :meth:`Checkpointer.load` runs)."""
    check_load_args(path, like)
    path, be = resolve(path, be, "load")  # s3://... is never a local directory 's3:'
    comm.after_failure = AFTER_LOAD
    job = LoadJob(path, like, comm, be, strict, opts)
    job.budget = budget or opts.exchange_budget_bytes
    try:
        job.read_manifest()
        job.plan()
        job.read(job.budget)
        out = job.result()
    finally:
        job.close()
    release_free_heap()  # flat memory over load cycles: see api/heap.py
    return out
