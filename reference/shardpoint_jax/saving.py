"""save(): the collective pipeline (spec/format.md sections 8, 9), one save transaction of
the core (:class:`~shardpoint_core.transactions.writer.CheckpointWriter`). Every process
states its local plan (metadata only, msgpack); process 0 merges and checks them, picks grids
and begins the save (the target checked, the staging location made); each process joins it
and writes the chunks of its replica-0 shards, makes them durable and reports the crc32c of
what it wrote; once every process succeeded, process 0 commits the manifest with its chunk
tables (a rename on files, the manifest as commit marker on object stores, format.md 9 and
9.1), else aborts."""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Optional, Union

import jax
import numpy as np

from shardpoint_core.arrays.identity import join_tables
from shardpoint_core.commit.base import Overwrite, check_overwrite
from shardpoint_core.format import errors as core_errors
from shardpoint_core.format.manifest import (
    FORMAT_VERSION,
    FORMAT_VERSION_1_3,
    Manifest,
    ObjectValues,
    TensorEntry,
    array_path_for,
)
from shardpoint_core.format.spec import ArraySpec
from shardpoint_core.format.treemerge import merge_many
from shardpoint_core.transactions.packed import incremental_backend
from shardpoint_core.transactions.protocol import StorageBackend
from shardpoint_core.transactions.writer import CheckpointWriter
from shardpoint_jax import errors as E
from shardpoint_jax.async_save import POOL, AsyncSave, wait_for_previous
from shardpoint_jax.comm import Comm
from shardpoint_jax.dtypes import name_of
from shardpoint_jax.grid import chunk_shape, local_chunk_shape
from shardpoint_jax.storage import checkpoint_path, chunk_pieces
from shardpoint_jax.tree import ShardedObject, is_array, tree_node
from shardpoint_jax.values import check_value, is_scalar_value, pack, unpack

WRITER = "shardpoint-jax/0.1.0"


def is_global(a: Any) -> bool:
    """A jax.Array laid out over the job (written shard by shard); others are local copies."""
    return isinstance(a, jax.Array) and (jax.process_count() == 1 or not a.is_fully_addressable)


def blocks_of(a: jax.Array) -> list:
    """Every device's block of ``a`` as (start, stop) per dimension."""
    return [
        [(s.start or 0, a.shape[d] if s.stop is None else s.stop) for d, s in enumerate(idx)]
        for idx in a.sharding.devices_indices_map(a.shape).values()
    ]


class LocalPlan:
    """What this process holds: its tree node, tensors, objects and arrays to write."""

    def __init__(self, tree: Any) -> None:
        self.arrays: dict = {}
        self.tensors: dict = {}
        self.objects: dict = {}
        self.node = tree_node(tree, self._leaf)

    def _leaf(self, path: tuple, key: str, v: Any) -> dict:
        if isinstance(v, ShardedObject):
            v.check(key)
            check_value(v.value, key)
            rep = [v.replica_id] if isinstance(v.replica_id, int) else list(v.replica_id)
            self.objects[key] = [list(v.cell), list(v.grid), rep, v.value]
            return {"object": key}
        if is_array(v):
            if isinstance(v, np.ndarray) and v.dtype.byteorder == ">":
                v = v.astype(v.dtype.newbyteorder("<"))  # the format is little-endian
            dt = name_of(v.dtype, key)
            glob = is_global(v)
            chunk = (
                chunk_shape(key, v.shape, blocks_of(v))
                if glob
                else local_chunk_shape(v.shape, np.dtype(v.dtype).itemsize)
            )
            self.arrays[key] = v
            self.tensors[key] = {
                "shape": list(v.shape),
                "dtype": dt,
                "global": glob,
                "chunk": chunk,
            }
            return (
                {"tensor": key} if isinstance(v, jax.Array) else {"tensor": key, "origin": "numpy"}
            )
        check_value(v, key)  # refuses what msgpack cannot carry, naming the key
        if not is_scalar_value(v):
            raise E.UnsupportedValueError(
                f"{key}: a {type(v).__name__} is not a value "
                "leaf; store numbers, str, bytes or None",
                spec_id="SP-VALUE-1",
            )
        return {"value": v}

    def encode(self) -> bytes:
        return pack({"tree": self.node, "tensors": self.tensors, "objects": self.objects})


def plan_global(plans: list, world: int) -> dict:
    """Checks and decisions of process 0 on every process's local plan [SP-PLAN-1]."""
    node = merge_many([p["tree"] for p in plans])
    tensors: dict = {}
    writers: dict = {}
    for rank, p in enumerate(plans):
        for key, t in p["tensors"].items():
            if key not in tensors:
                tensors[key], writers[key] = t, rank
                continue
            first = tensors[key]
            if (first["shape"], first["dtype"], first["global"]) != (
                t["shape"],
                t["dtype"],
                t["global"],
            ):
                raise E.InvalidShardingError(
                    f"tensor {key!r}: process {writers[key]} holds {first['dtype']} "
                    f"{first['shape']}, process {rank} {t['dtype']} {t['shape']} (global "
                    f"{first['global']} vs {t['global']})",
                    spec_id="SP-COVER-4",
                )
    objects = plan_objects(plans)
    return {"tree": node, "tensors": tensors, "writers": writers, "objects": objects}


def plan_objects(plans: list) -> dict:
    """Pick one entry per grid cell [SP-OBJ-1..3] [SP-REPL-2]."""
    entries: dict = {}
    for rank, p in enumerate(plans):
        for key, (cell, grid, rep, value) in p["objects"].items():
            entries.setdefault(key, []).append((rank, tuple(cell), tuple(grid), rep, value))
    out = {}
    for key, es in entries.items():
        grids = {g for _, _, g, _, _ in es}
        if len(grids) > 1:
            raise E.InvalidShardingError(
                f"sharded object {key!r}: processes disagree on the grid: {sorted(grids)}",
                spec_id="SP-OBJ-2",
            )
        grid = grids.pop()
        cells: dict = {}
        for rank, cell, _, rep, value in es:
            cells.setdefault(cell, []).append((rank, rep, value))
        values = []
        for flat in range(math.prod(grid)):
            cell = tuple(int(i) for i in np.unravel_index(flat, grid))
            held = cells.get(cell)
            if not held:
                raise E.InvalidShardingError(
                    f"sharded object {key!r}: no process holds cell {cell} of grid {grid}",
                    spec_id="SP-OBJ-3",
                )
            mains = [h for h in held if not any(h[1])]
            if len(mains) > 1:
                raise E.InvalidShardingError(
                    f"sharded object {key!r}: cell {cell} has main entries (replica id 0) on "
                    f"processes {[h[0] for h in mains]}; give the others replica id 1",
                    spec_id="SP-REPL-2",
                )
            values.append(min(held, key=lambda h: (tuple(h[1]), h[0]))[2])
        entry = {"count": len(values), "values": values}
        if len(grid) > 1:
            entry["shape"] = list(grid)  # [SP-OBJ-4]: omitted for a 1-D grid
        out[key] = entry
    return out


# -------------------------------------------------------------------------------- errors
def error_info(e: BaseException) -> list:
    ours = isinstance(e, E.ShardpointError)  # the core's classes (the committer's too)
    cls = type(e).__name__ if ours else "SaveFailedError"
    msg = str(e) if ours else f"{type(e).__name__}: {e}"
    return [cls, getattr(e, "spec_id", None), msg]


def raise_info(info: list, where: str) -> None:
    """Raise on this process the error another one reported (:func:`error_info`): the core's
    class of that name, so every class the core has (and gains) passes; else SaveFailedError."""
    cls, sid, msg = info
    klass = getattr(core_errors, cls, None)
    if not (isinstance(klass, type) and issubclass(klass, E.ShardpointError)):
        klass = E.SaveFailedError
    err = klass(msg, spec_id=None)
    err.spec_id = sid
    raise err


# -------------------------------------------------------------------------------- save
def save(
    path: str,
    tree: Any,
    *,
    overwrite: Overwrite = False,
    async_save: bool = False,
    extensions: Optional[dict] = None,
    backend: Optional[StorageBackend] = None,
    incremental: Union[None, bool, str] = None,
) -> Optional[AsyncSave]:
    """Save ``tree`` (a pytree of jax.Arrays, numpy arrays, ShardedObjects and values) at
    ``path``: a local path, or the URL of a registered store (``s3://bucket/run/step_5``,
    ``memory://name/ck``). Collective: every process of the job calls it with its own tree.

    With ``async_save=True`` the call returns once the plan is agreed and this process holds
    data nobody can change (:mod:`.async_save`: CPU JAX arrays held as they are, numpy leaves
    copied to a reused pool), so the arrays may be changed, deleted or donated right away;
    the writes and the commit run in the background and the returned :class:`AsyncSave`
    says when the checkpoint is in. Any
    save first waits for the previous asynchronous one and raises its error if nobody saw
    it yet.

    ``extensions``: the manifest's ``extensions`` map (versioning.md), process 0's, each entry
    a map with ``"must_understand": False`` that readers ignore; front ends keep what their
    host keeps beside a checkpoint there (the Orbax handler: shardings, PRNG key kinds).

    ``backend``: the storage backend of this save (default: the core's default for the
    path, :func:`~shardpoint_core.transactions.resolve.backend_for`: the packed layout, a few
    data objects per process, spec/format.md section 13, on files and object stores alike);
    ``backend=ZarrBackend()`` (:mod:`shardpoint_core.transactions.backend`) writes the
    per-array layout of 1.0-1.3, a directory and chunk files per tensor; each process with a
    backend object of its own. ``incremental``: build on a committed packed checkpoint
    beside ``path`` (its name or path; ``True``: the newest one beside it, on files),
    referring to its chunks whose bytes are unchanged instead of writing them again
    ([SP-PACK-9]); the save is packed and records chunk hashes, as the torch
    ``sp.save(..., incremental=...)``."""
    overwrite = check_overwrite(overwrite)  # InvalidOptionError (InvalidRequestError)
    backend = incremental_backend(backend, incremental)
    for name, ext in (extensions or {}).items():
        if not (
            isinstance(name, str) and isinstance(ext, dict) and ext.get("must_understand") is False
        ):
            raise E.InvalidRequestError(
                f"extensions[{name!r}] must be a map holding "
                "'must_understand': False (versioning.md)"
            )
    wait_for_previous()
    path = checkpoint_path(path, "save(path, tree)")
    comm = Comm("save")
    plan, decision, writer, err = agree_plan(comm, path, tree, overwrite, backend)
    decision["extensions"] = dict(extensions or {})  # process 0's go into the manifest
    regions: list = []
    try:
        regions = local_regions(decision, plan, comm.rank)
        if async_save:
            regions = POOL.stage(regions)
    except Exception as e:  # noqa: BLE001 - reported to every process at the write step
        err = err or e
    if not async_save:
        write_and_commit(comm, writer, decision, regions, err)
        return None
    return AsyncSave(lambda: write_and_commit(comm, writer, decision, regions, err), path)


def agree_plan(
    comm: Comm,
    path: str,
    tree: Any,
    overwrite: Overwrite,
    backend: Optional[StorageBackend] = None,
) -> tuple:
    """Every process's plan to process 0, which checks and merges them, begins the save
    (:func:`prepare`) and sends back its decision: ``(local plan, decision, writer, error)``,
    the writer this process's part of the save (process 0's began it, the others join it),
    each through its own ``backend`` (None: the path's default); ``error``: why this
    process could not join (reported to every process at the write step), else None."""
    plan, err = None, None
    try:
        plan = LocalPlan(tree)
        mine = plan.encode()
    except Exception as e:  # noqa: BLE001 - reported to every process
        err, mine = e, pack({"error": error_info(e)})
    gathered = comm.gather("plan", mine)
    decision: dict = {}
    writer: Optional[CheckpointWriter] = None
    if comm.rank == 0:
        try:
            plans = [unpack(b) for b in gathered]
            bad = [p["error"] for p in plans if "error" in p]
            if bad:
                decision = {"error": bad[0]}
            else:
                decision, writer = prepare(path, plan_global(plans, comm.world), overwrite, backend)
                decision["world"] = comm.world
            packed = pack(decision)
        except Exception as e:  # noqa: BLE001
            if writer is not None:
                writer.abort()  # nothing of a save the others never hear of stays
                writer = None
            decision = {"error": error_info(e)}
            packed = pack(decision)
        comm.broadcast("decision", packed)
    else:
        decision = unpack(comm.broadcast("decision"))
        if "error" not in decision:
            try:
                writer = CheckpointWriter.join(
                    path, decision["staging"], backend=backend, call=CALL
                )
            except Exception as e:  # noqa: BLE001 - reported at the write step
                err = err or e
    if "error" in decision:
        if err is not None:
            raise err
        raise_info(decision["error"], "plan")
    return plan, decision, writer, err


def write_and_commit(
    comm: Comm,
    writer: Optional[CheckpointWriter],
    decision: dict,
    regions: list,
    err: Optional[BaseException],
) -> None:
    """Each process writes its regions, makes them durable and reports to process 0 (the
    crc32c of what it wrote, or its error), which commits once every process succeeded and
    aborts otherwise. Raises what failed anywhere."""
    crcs: dict = {}
    if err is None and writer is not None:
        try:
            crcs = write_regions(writer, regions, decision["tensors"], comm.rank == 0)
        except Exception as e:  # noqa: BLE001
            err = e
    if err is not None and writer is not None:
        writer.take_chunk_crc32c()  # nothing of this save stays in the backend
    status = pack(
        {"error": error_info(err)}
        if err is not None
        else {"crc32c": [[p, [[n, b] for n, b in d.items()]] for p, d in crcs.items()]}
    )
    statuses = comm.gather("written", status)
    outcome = b""
    if comm.rank == 0:
        try:
            reports = [unpack(s) for s in statuses]
            failed = [r["error"] for r in reports if "error" in r]
            if failed:
                raise_info(failed[0], "write")
            assert writer is not None  # process 0 began the save
            writer.commit(manifest_of(decision, [r["crc32c"] for r in reports]))
        except Exception as e:  # noqa: BLE001
            if writer is not None:
                writer.abort()  # idempotent: a failed commit aborted already
            outcome = pack(error_info(e))
        comm.broadcast("commit", outcome)
    else:
        outcome = comm.broadcast("commit")
    if outcome:
        if err is not None:
            raise err
        raise_info(unpack(outcome), "commit")


CALL = "save(path, tree)"


def prepare(
    path: str, plan: dict, overwrite: Overwrite, backend: Optional[StorageBackend] = None
) -> tuple:
    """Process 0: begin the save: a taken path refused [SP-COMMIT-5] [SP-COMMIT-13], the
    staging location created and locked [SP-COMMIT-6, 11]. Returns ``(decision, writer)``."""
    writer = CheckpointWriter.begin(path, backend=backend, overwrite=overwrite, call=CALL)
    entries = {
        key: {
            "array": array_path_for(key),
            "shape": t["shape"],
            "dtype": t["dtype"],
            "chunk_shape": t["chunk"],
        }
        for key, t in sorted(plan["tensors"].items())  # keys sorted, as the torch planner
    }
    return {
        "staging": writer.staging,
        "tree": plan["tree"],
        "tensors": entries,
        "global": {k: t["global"] for k, t in plan["tensors"].items()},
        "writers": plan["writers"],
        "objects": plan["objects"],
    }, writer


# Bytes of writes in flight (each holds its encoded chunks, and for arrays on an accelerator
# a host copy): enough to keep the disk busy, bounded so a save adds little memory.
WRITE_AHEAD_BYTES = 64 << 20


class Writes:
    """Writes in flight, at most ``window`` bytes of them (the oldest is waited for before
    more start); every one is waited for before an error is raised, so none may still be
    writing into a staging directory that is being removed."""

    def __init__(self, window: int, writer: CheckpointWriter) -> None:
        self.queue: deque = deque()
        self.window, self.inflight, self.writer = window, 0, writer
        self.error: Optional[tuple] = None  # (key, exception) of the first failure

    def add(self, ops: list, nbytes: int, key: str) -> None:
        self.queue.append((ops, nbytes, key))
        self.inflight += nbytes
        while self.inflight > self.window and len(self.queue) > 1:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        ops, nbytes, key = self.queue.popleft()
        self.inflight -= nbytes
        try:
            self.writer.wait(ops)
        except Exception as e:  # noqa: BLE001 - the first one is raised by the caller
            self.error = self.error or (key, e)

    def drain(self) -> None:
        while self.queue:
            self._wait_oldest()


def local_regions(decision: dict, plan: LocalPlan, rank: int) -> list:
    """What this process writes, ``(key, array path, chunk shape, offset, data)``: replica-0 shards
    of global arrays, local arrays it was elected for [SP-GRID-1] [SP-REPL-1]; keys sorted,
    as the torch front end writes them (a packed save's data objects and index are then the
    same for the same state)."""
    out = []
    for key, a in sorted(plan.arrays.items(), key=lambda kv: kv[0]):
        entry = decision["tensors"][key]
        if a.size == 0:
            continue
        if decision["global"][key]:
            out += [
                (
                    key,
                    entry["array"],
                    entry["chunk_shape"],
                    [sl.start or 0 for sl in s.index],
                    s.data,
                )
                for s in a.addressable_shards
                if s.replica_id == 0
            ]
        elif decision["writers"][key] == rank:
            out.append((key, entry["array"], entry["chunk_shape"], [0] * a.ndim, a))
    return out


def write_regions(
    writer: CheckpointWriter, regions: list, tensors: dict, coordinator: bool
) -> dict:
    """Write ``regions`` (:func:`local_regions`; ``tensors``: the decision's entries) chunk
    by chunk through ``writer``, several at once (:class:`Writes`); then make what was
    written durable at once [SP-COMMIT-1]. Returns the crc32c of the units written, for the
    chunk tables ([SP-MAN-7]). The coordinator also creates the arrays nobody writes a chunk
    of (a zero dimension)."""
    handles: dict = {}

    def opened(key: str) -> Any:
        e = tensors[key]
        if e["array"] not in handles:
            handles[e["array"]] = writer.open_array(
                e["array"], ArraySpec(tuple(e["shape"]), e["dtype"], tuple(e["chunk_shape"]))
            )
        return handles[e["array"]]

    writes = Writes(WRITE_AHEAD_BYTES, writer)
    key = ""
    try:
        if coordinator:
            for key, e in tensors.items():
                if 0 in e["shape"]:
                    opened(key)
        for key, _array, chunk, off, data in regions:
            if writes.error is not None:
                break
            host = np.asarray(data)
            h = opened(key)
            writes.add(
                [writer.write(h, lo, piece) for lo, piece in chunk_pieces(off, host, chunk)],
                host.nbytes,
                key,
            )
    except Exception as e:  # noqa: BLE001 - reported as this tensor's write failure
        writes.error = writes.error or (key, e)
    finally:
        writes.drain()
    staging = writer.staging
    if writes.error is not None:
        key, failure = writes.error
        if isinstance(failure, E.ShardpointError):
            named = _naming(failure, key)
            if named is failure:
                raise failure
            raise named from failure
        raise E.SaveFailedError(
            f"tensor {key!r}: writing its chunks under {staging!r} failed: {_short(failure)}"
        ) from None
    try:
        return writer.flush()
    except OSError as e:
        raise E.SaveFailedError(
            f"making the chunks written under {staging!r} durable failed: {e}"
        ) from None


def _naming(e: E.ShardpointError, key: str) -> E.ShardpointError:
    """``e`` naming tensor ``key``, whose chunks were being written when it was raised,
    where it names none (the packed layout's writer names the data object it could not
    write, which holds the chunks of many tensors); the same class and rule."""
    text = str(e)
    if repr(key) in text:
        return e
    sid = e.spec_id
    body = text.split("] ", 1)[1] if sid and text.startswith(f"[{sid}] ") else text
    try:
        return type(e)(f"tensor {key!r}: {body}", spec_id=sid)
    except TypeError:  # a class built otherwise: as it is
        return e


def _short(e: BaseException) -> str:
    """A storage error in a line, less any status prefix."""
    text = str(e).replace("RESOURCE_EXHAUSTED: ", "").replace("INTERNAL: ", "")
    return text if len(text) < 400 else text[:400] + "..."


def manifest_of(decision: dict, reports: list) -> Manifest:
    """The core's manifest of a save that process 0 decided (:func:`prepare`), each tensor
    with its chunk table where every chunk's writer reported its units' crc32c ([SP-MAN-7];
    ``reports``: each process's ``[[array path, [[chunk number, crc32c bytes]]]]``)."""
    merged: dict = {}
    for rep in reports:
        for array, chunks in rep:
            merged.setdefault(array, {}).update({int(n): bytes(b) for n, b in chunks})
    tensors = {
        k: TensorEntry(
            k,
            e["array"],
            tuple(e["shape"]),
            e["dtype"],
            tuple(e["chunk_shape"]),
            join_tables([merged], e["array"], e["shape"], e["chunk_shape"]),
        )
        for k, e in decision["tensors"].items()
    }
    objects = {k: ObjectValues(o["values"], o.get("shape")) for k, o in decision["objects"].items()}
    tables = any(t.chunk_crc32c is not None for t in tensors.values())
    return Manifest(
        decision["tree"],
        tensors,
        objects,
        writer=WRITER,
        format_version=FORMAT_VERSION_1_3 if tables else FORMAT_VERSION,
        save_world_size=decision["world"],
        extensions=decision.get("extensions") or {},
    )
