"""save(): the collective pipeline (spec/format.md sections 8, 9), one save transaction of
the core (:class:`~shardpoint_core.transactions.writer.CheckpointWriter`). Every process
states its local plan (metadata only, msgpack); process 0 merges and checks them, picks grids
and begins the save (the target checked, the staging location made); each process joins it
and writes the chunks of its replica-0 shards, makes them durable and reports the crc32c of
what it wrote; once every process succeeded, process 0 commits the manifest with its chunk
tables (a rename on files, the manifest as commit marker on object stores, format.md 9 and
9.1), else aborts.

This module holds the save's steps and what passes between processes; the plans' rules are
in :mod:`.saving_plan`, the chunk writes in :mod:`.saving_writes` (their public names
re-exported here)."""

from __future__ import annotations

from typing import Any, Optional, Union

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
from shardpoint_core.transactions.packed import incremental_backend
from shardpoint_core.transactions.protocol import StorageBackend
from shardpoint_core.transactions.writer import CheckpointWriter
from shardpoint_jax import errors as E
from shardpoint_jax.async_save import POOL, AsyncSave, wait_for_previous
from shardpoint_jax.comm import Comm
from shardpoint_jax.saving_plan import LocalPlan, plan_global
from shardpoint_jax.saving_plan import blocks_of as blocks_of  # re-exported
from shardpoint_jax.saving_plan import is_global as is_global  # re-exported
from shardpoint_jax.saving_plan import plan_objects as plan_objects  # re-exported
from shardpoint_jax.saving_writes import WRITE_AHEAD_BYTES as WRITE_AHEAD_BYTES  # re-exported
from shardpoint_jax.saving_writes import Writes as Writes  # re-exported
from shardpoint_jax.saving_writes import local_regions, write_regions
from shardpoint_jax.storage import checkpoint_path
from shardpoint_jax.values import pack, unpack

WRITER = "shardpoint-jax/0.1.0"


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
