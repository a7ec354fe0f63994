"""One save's pipeline (:class:`SaveJob`): its state and one method per phase, plan ->
stage -> write -> commit, each ending in an agreement step so a failure on any rank raises
the same error on every rank. :func:`~shardpoint.api.saving.run_save` drives it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional

import msgpack
import torch

from shardpoint.tree import dtypes
from shardpoint_core.format import errors
from shardpoint_core.commit.base import Overwrite
from shardpoint.tree import values
from shardpoint.api.replicas import check_replicas
from shardpoint.exchange.comm import Comm, after_commit, agree, exchange, run_collectively
from shardpoint_core.stores.fsutil import os_error_text
from shardpoint_core.format.manifest import (
    FORMAT_VERSION,
    FORMAT_VERSION_1_3,
    Manifest,
    array_path_for,
)
from shardpoint.tree.flatten import flatten_state
from shardpoint.api.open_ahead import OpenAhead
from shardpoint.planning.save_global import encode_save_global, layouts_of, save_work_from_global
from shardpoint.planning.planner import LocalPlan, RankSaveWork, plan_objects, plan_save
from shardpoint_core.format.spec import ArraySpec
from shardpoint_core.format.compression import FORMAT_VERSION_1_5, check_compression
from shardpoint_core.arrays.compression import require_zstd
from shardpoint_core.transactions.protocol import StorageBackend
from shardpoint_core.transactions.writer import CheckpointWriter
from shardpoint.api.staging import StagingPool, stream_device_writes
from shardpoint.tree.views import PieceViews, to_numpy
from shardpoint.api.save_plan_cache import _structure_digest, _value_leaves, _with_values
from shardpoint.api.save_options import SaveOptions, SaveResult
from shardpoint.api.save_stage import direct_sources, piece_views, pool_sources, recv_views
from shardpoint.api.save_manifest import _entries

log = logging.getLogger("shardpoint")


# -------------------------------------------------------------------------------- one save
class SaveJob:
    """One save's state (its flat tree, plan, staging path, buffers, timings), one method per
    phase: :meth:`plan` -> :meth:`stage` -> :meth:`write` -> :meth:`commit`. This rank's
    part of the transaction is a :class:`~shardpoint_core.transactions.writer.CheckpointWriter`
    (``writer``): the coordinator begins it while planning, the other ranks join it with the
    staging path the plan brings them.

    Each phase ends in an agreement step or records its failure for the next one, so a
    failure on any rank raises the same error on every rank. An async save runs ``write`` and
    ``commit`` in a background thread, on a gloo group of their own (``comm`` argument).
    """

    def __init__(
        self,
        state: Any,
        path: str,
        comm: Comm,
        be: StorageBackend,
        opts: SaveOptions,
        overwrite: Overwrite,
        group: Any,
    ) -> None:
        self.state, self.path, self.comm, self.be = state, str(path), comm, be
        self.opts, self.overwrite = opts, overwrite
        self.codec = check_compression(opts.compression, opts.compression_level)
        if self.codec is not None:  # (1.5) refused before anything is planned or written
            if not getattr(be, "supports_compression", False):
                raise errors.InvalidOptionError(
                    f"SaveOptions(compression={opts.compression!r}): the storage backend "
                    f"{type(be).__name__} does not write compressed arrays; save with the "
                    "default backend"
                )
            require_zstd(f"SaveOptions(compression={opts.compression!r})")
        self.group = group  # the checkpointer's GroupState: plan cache, async saves
        self.async_save = False
        self.t0 = time.perf_counter()
        self.times: dict = {}
        self.flat: Any = None
        self.struct = b""
        self.plan_hit = False
        self.global_plan: Any = None  # the SavePlan, on the coordinator only
        self.staging = ""
        self.writer: Optional[CheckpointWriter] = None  # this rank's part of the save
        self.work: Optional[RankSaveWork] = None
        self._global_msg: Optional[bytes] = None  # the coordinator's plan message, to send
        self.layouts: dict = {}
        self.stats: dict = {}
        self.sources: list = []  # per chunk write: the tensor to write (host or device)
        self.sends: list = []  # [(dst rank, tensor)]
        self.recvs: list = []  # [(src rank, destination view)]
        self.staging_bytes = 0
        self.written = 0
        self.error: Optional[BaseException] = None  # a local failure, shared at commit
        self.crcs: dict = {}  # what this rank's writes recorded for the chunk tables
        self._handles: dict = {}
        self._created = False  # the arrays this rank owns exist (and ranks agreed)

    def _planned_work(self) -> RankSaveWork:
        """This rank's work, which :meth:`plan` sets before any later phase runs."""
        assert self.work is not None, "a save phase ran before plan()"
        return self.work

    def _planned_writer(self) -> CheckpointWriter:
        """This rank's writer (begun or joined by :meth:`plan`)."""
        assert self.writer is not None, "a save phase ran before plan()"
        return self.writer

    # ---------------------------------------------------------------------- phase 1: plan
    def plan(self) -> None:
        """Local plans up, the global plan decided on the coordinator (or the cached one
        reused when no rank's structure changed), this rank's work back down."""
        err0: Optional[BaseException] = None
        try:
            self.flat = flatten_state(self.state, replica=(self.comm.rank,))
            self.struct = _structure_digest(self.flat) + repr(self.opts.plan).encode()
        except Exception as e:  # noqa: BLE001 - reported collectively below
            err0 = e
        # Plan cache: when no rank's structure (tree shape, holdings, object ids) changed
        # since the last save over this group, ranks send only their values and the
        # coordinator reuses the plan ([SP-GRID-1] holds: the layout depends on structure).
        hit = (
            err0 is None and self.opts.cache_plan and (self.group.plan or (None,))[0] == self.struct
        )
        self.plan_hit = self.comm.all_true(bool(hit))

        def local() -> "bytes | list":
            if err0 is not None:
                raise err0
            f = self.flat
            objs = [(o.key, o.index, o.count, o.replica, o.value) for o in f.objects]
            if self.plan_hit:
                return values.pack([_value_leaves(f.tree), [list(o) for o in objs]])
            return LocalPlan(
                self.comm.rank, f.tree, [t.holding for t in f.tensors], objs
            ).to_parts()

        try:
            msg = run_collectively(
                self.comm,
                local,
                self._decide,
                errors.InvalidShardingError,
                same=self.collective_arguments(),
            )
        except errors.ShardpointError:
            self.group.plan = None
            raise
        if msgpack.unpackb(msg) is not None:
            raise errors.SaveFailedError(f"rank {self.comm.rank}: unexpected save plan reply")
        # the plan, one message for every rank (broadcast): each rank cuts its own work
        g = self.comm.broadcast_bytes(self._global_msg)
        self._global_msg = None
        self.staging, self.layouts, self.stats, self.work = save_work_from_global(g, self.comm.rank)
        if self.writer is None:  # not the coordinator, which began the save
            self.writer = CheckpointWriter.join(self.path, self.staging, backend=self.be)
        if self.opts.check_replicas:  # after the plan: its errors (layout) come first
            t = time.perf_counter()
            check_replicas(self.comm, self.flat.tensors)
            self.times["replica_check"] = time.perf_counter() - t
        self.times["plan_total"] = time.perf_counter() - self.t0
        self.times["plan_cached"] = self.plan_hit

    def _decide(self, payloads: list) -> list:
        """Coordinator: the global plan, the staging directory, one work item per rank."""
        t = time.perf_counter()
        if self.plan_hit:
            plan = self.group.plan[1]
            got = [values.unpack(b) for b in payloads]
            plan.tree = _with_values(plan.tree, [v for v, _ in got])
            plan.objects = plan_objects(
                [
                    LocalPlan(r, None, [], [tuple(o) for o in objs])
                    for r, (_, objs) in enumerate(got)
                ]
            )
        else:
            cache: dict = {}  # distinct holdings runs, decoded once
            plan = plan_save([LocalPlan.from_parts(p, cache) for p in payloads], self.opts.plan)
        self.times["plan"] = time.perf_counter() - t
        # the target checked before anything is written, then the staging location made;
        # known to :meth:`abandon` before the ranks hear of it
        self.writer = CheckpointWriter.begin(self.path, backend=self.be, overwrite=self.overwrite)
        self.staging = staging = self.writer.staging
        self.global_plan = plan
        # one message for every rank, broadcast after the (empty) replies: per-rank replies
        # carry each transfer twice and the coordinator would encode one per rank
        self._global_msg = encode_save_global(
            plan.columns, layouts_of(plan.tensors), plan.stats, staging
        )
        return [msgpack.packb(None)] * self.comm.size

    # ---------------------------------------------------------------------- phase 2: stage
    def stage(self, pool: Optional[StagingPool] = None) -> None:
        """Name what this rank writes and sends. Sync (``pool`` None): the arrays this rank
        owns are created, chunks covered by one piece are written straight from the caller's
        tensors, the others are assembled in buffers. Async: every byte this rank needs later
        is copied into ``pool``, so the caller may change its tensors once this returns (the
        arrays are created later, in the background). Ranks agree before going on."""
        t = time.perf_counter()
        err: Optional[BaseException] = None
        try:
            if pool is None:
                self._name_sources()
            else:
                self._copy_to_pool(pool)
        except Exception as e:  # noqa: BLE001 - shared with every rank just below
            err = e
        try:
            agree(self.comm, err, errors.SaveFailedError)
        except errors.ShardpointError as e:
            self.error = e
        self.times["stage"] = time.perf_counter() - t

    def _views(self) -> PieceViews:
        return piece_views(self.flat.tensors)

    def _chunk_dtype(self, key: str) -> torch.dtype:
        return dtypes.from_name(self.layouts[key][1]).torch

    def _name_sources(self) -> None:
        work, src = self._planned_work(), self._views()
        self._create_arrays()
        self.sources, self.sends = direct_sources(work, src, self._chunk_dtype)
        self._name_recvs()

    def _copy_to_pool(self, pool: StagingPool) -> None:
        work, src = self._planned_work(), self._views()
        self.sources, self.sends, alloc, nbytes = pool_sources(work, src, self._chunk_dtype, pool)
        self.times["staging_alloc"] = alloc
        self.staging_bytes = nbytes
        self._name_recvs()

    def _name_recvs(self) -> None:
        self.recvs = recv_views(self._planned_work(), self.sources)

    def _create_arrays(self) -> None:
        """Create the arrays this rank owns (their zarr.json, [SP-COMMIT-8]) from a few
        threads. Done while staging, before the ranks agree, so no rank writes a chunk into
        an array that does not exist yet."""
        try:
            create = self._planned_work().create
            with OpenAhead(self._handle, create) as opened:
                for key in create:
                    opened(key)
        except Exception as e:  # noqa: BLE001 - raised again as the documented error
            raise self.write_error(e) from e
        self._created = True

    def _handle(self, key: str) -> Any:
        if key not in self._handles:
            shape, dt, chunk = self.layouts[key]
            self._handles[key] = self._planned_writer().open_array(
                array_path_for(key),
                ArraySpec(tuple(shape), dt, tuple(chunk), compression=self.codec),
            )
        return self._handles[key]

    # ---------------------------------------------------------------------- phase 3: write
    def write(self, comm: Comm) -> None:
        """Exchange misaligned pieces, write every chunk, make them durable (``flush``).
        A local failure is kept for :meth:`commit`, which every rank reaches."""
        if self.error is not None:
            return
        t = time.perf_counter()
        opened: Optional[OpenAhead] = None
        ops: list = []
        w, work = self._planned_writer(), self._planned_work()
        try:
            if not self._created:
                # An async save creates its arrays here, off the caller's time; the ranks
                # agree before any of them opens another rank's array to write a chunk.
                err: Optional[BaseException] = None
                try:
                    self._create_arrays()
                except Exception as e:  # noqa: BLE001 - shared with every rank just below
                    err = e
                agree(comm, err, errors.SaveFailedError)
            opened = OpenAhead(self._handle, [cw.key for cw in work.writes])
            exchange(comm, self.sends, self.recvs, self.opts.exchange_budget_bytes)
            self.sends = self.recvs = []
            self.times["exchange"] = time.perf_counter() - t
            device = []
            for cw, buf in zip(work.writes, self.sources):
                if buf.device.type != "cpu":
                    device.append((buf, cw))
                    continue
                ops.append((w.write(opened(cw.key), cw.offset, to_numpy(buf)), buf))
                self.written += buf.numel() * buf.element_size()
            if device:  # CUDA tensors (sync save): bounded pinned staging, overlapped
                ops += stream_device_writes(
                    device,
                    lambda host, cw: w.write(opened(cw.key), cw.offset, to_numpy(host)),
                    lambda op: w.wait([op]),
                    self.opts.device_staging_bytes,
                )
                self.written += sum(b.numel() * b.element_size() for b, _ in device)
            w.wait([op for op, _ in ops])
            self.times["write"] = time.perf_counter() - t
            t = time.perf_counter()
            # durable, and the crc32c of the units this rank wrote, for the chunk tables
            self.crcs = w.flush()
            self.times["flush"] = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            self.error = self.write_error(e)
            log.error("shardpoint save: rank %d failed: %s", comm.rank, self.error)
            # writes already in flight finish before the caller can remove the staging
            # directory: one still writing would hold its file's space (or recreate it)
            try:
                w.wait([op for op, _ in ops])
            except Exception:  # noqa: BLE001 - the first error is the one reported
                pass
        finally:
            if opened is not None:
                opened.close()
            self.sources = []

    def collective_arguments(self) -> list:
        """What every rank of a save must pass alike, agreed in the plan before any byte is
        written: a rank saving with another ``overwrite``, ``async_save`` or plan options
        than its peers would replace, or chunk, what the others do not expect."""
        return [
            ("checkpoint path", os.path.normpath(self.path)),
            ("overwrite flag", bool(self.overwrite)),
            ("async_save flag", bool(self.async_save)),
            ("SaveOptions.plan", repr(self.opts.plan)),
            ("SaveOptions.exchange_budget_bytes", int(self.opts.exchange_budget_bytes)),
            ("SaveOptions.check_replicas", bool(self.opts.check_replicas)),
            ("SaveOptions.compression", repr(self.codec)),
        ]

    def write_error(self, e: BaseException) -> errors.ShardpointError:
        """``e``, raised while creating arrays or writing chunks, as the error to report: a
        storage failure (the backend's own error carrying an ``OSError``, or the ``OSError``
        itself) becomes :meth:`write_failed`, whichever step a full disk happened to hit."""
        if isinstance(e, errors.SaveFailedError) and isinstance(e.__cause__, OSError):
            return self.write_failed(e.__cause__, str(e))
        return e if isinstance(e, errors.ShardpointError) else self.write_failed(e)

    def write_failed(self, e: BaseException, said: str = "") -> errors.SaveFailedError:
        """A failed write as the documented error: the checkpoint, the cause (a full disk
        names the file it could not write) and what to do about it. ``said``: the backend's
        message, kept where it already holds the cause and fix and names more (the packed
        writer names the tensor whose chunk did not fit)."""
        text = os_error_text(e)
        return errors.SaveFailedError(
            f"cannot write checkpoint {self.path!r} (into its staging directory "
            f"{self.staging!r}): {said if text in said else text}. Nothing was committed: a "
            "previous checkpoint at that path is untouched, and the partial files are removed"
        )

    # ---------------------------------------------------------------------- phase 4: commit
    def commit(self, comm: Comm) -> SaveResult:
        """Every rank reports; if all succeeded the coordinator writes the manifest and
        renames the staging directory into place, else it removes it and all ranks raise."""
        t = time.perf_counter()
        # what this rank's writes recorded for the chunk tables ([SP-MAN-7]) came with its
        # flush; taken here as well on every other outcome, so nothing stays in the backend
        if self.writer is not None:
            self.writer.take_chunk_crc32c()
        if self.error is not None:
            self.crcs = {}

        def report() -> bytes:
            e = self.error
            if e is not None:
                raise (
                    e
                    if isinstance(e, errors.ShardpointError)
                    else errors.SaveFailedError(f"{type(e).__name__}: {e}")
                )
            # the crc32c of the units this rank wrote, for the chunk tables ([SP-MAN-7])
            return msgpack.packb(
                [[p, [[f, b] for f, b in d.items()]] for p, d in self.crcs.items()],
                use_bin_type=True,
            )

        comm.after_failure = after_commit(self.path)
        try:
            files = msgpack.unpackb(
                run_collectively(comm, report, self._publish, errors.SaveFailedError)
            )
        except errors.ShardpointError:
            self.group.plan = None
            if comm.is_coordinator and self.writer is not None:
                self.writer.abort()
            raise
        if self.opts.cache_plan:
            self.group.plan = (self.struct, self.global_plan)
        self.times["commit"] = time.perf_counter() - t
        self.times["total"] = time.perf_counter() - self.t0
        self.times["staging_bytes"] = self.staging_bytes
        st = self.stats
        if comm.is_coordinator:
            log.info(
                "shardpoint save %s: %d tensors, %.1f MiB unique, %.1f MiB exchanged, "
                "plan %.3fs%s, write %.3fs, commit %.3fs, total %.3fs",
                self.path,
                st["tensors"],
                st["unique_bytes"] / 2**20,
                st["exchange_bytes"] / 2**20,
                self.times["plan_total"],
                " (cached)" if self.plan_hit else "",
                self.times.get("write", 0.0),
                self.times["commit"],
                self.times["total"],
            )
        return SaveResult(
            self.path,
            comm.size,
            st["tensors"],
            st["unique_bytes"],
            st["exchange_bytes"],
            st["chunks"],
            self.written,
            self.times,
            files=files,
            rank_chunk_files=len(self._planned_work().writes),
        )

    def abandon(self) -> None:
        """After an interrupt (KeyboardInterrupt, SystemExit, an exception a signal handler
        raised) cut a phase short: the coordinator removes the staging directory and drops
        its lock, as a failed save does, instead of leaving a whole checkpoint's worth of
        partial files behind for ``recover`` (and the lock held while the process lives)."""
        if self.comm.is_coordinator and self.writer is not None:
            self.writer.abort()

    def _publish(self, payloads: list) -> list:
        """Coordinator, every rank having succeeded: manifest last, then the rename (or the
        marker); on any failure the writer aborts, nothing of the save stays."""
        plan, w = self.global_plan, self._planned_writer()
        try:
            m = Manifest(
                plan.tree,
                _entries(plan.tensors, payloads),
                plan.objects,
                save_world_size=self.comm.size,
            )
            if self.codec is not None and m.tensors:
                m.format_version = FORMAT_VERSION_1_5  # compressed arrays [SP-ARRAY-7]
            elif any(e.chunk_crc32c is not None for e in m.tensors.values()):
                m.format_version = FORMAT_VERSION_1_3  # the bytes hold a 1.3 construct
            else:
                m.format_version = FORMAT_VERSION
            w.commit(m)
            if m.packed is not None:  # its own data objects (not its bases') and the manifest
                index = m.packed
                files = 1 + sum(index.base_of(i) is None for i in range(len(index.objects)))
            else:
                st = self.stats
                files = st["chunks"] + st["tensors"] + 1 + st.get("groups", 0)
        except BaseException as e:
            w.abort()  # a no-op where the commit aborted already
            if isinstance(e, OSError) and not isinstance(e, errors.ShardpointError):
                # the manifest's own write found the disk full
                raise errors.SaveFailedError(
                    f"cannot commit checkpoint {self.path!r}: {os_error_text(e)}. Nothing "
                    "was committed; the staged files are removed"
                ) from e
            raise
        return [msgpack.packb(files)] * self.comm.size
