"""``save``: a collective save of a state tree, from local plans to the committed manifest.

Every rank calls it with its own tree; planning runs on the coordinator (rank 0 of the group)
and each phase ends in an agreement step, so a failure on any rank raises the same error on
every rank instead of leaving one waiting.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from shardpoint_core.format import errors
from shardpoint_core.commit.base import check_overwrite
from shardpoint.api.async_save import AsyncSave
from shardpoint.api.heap import release_free_heap
from shardpoint.exchange.comm import AFTER_SAVE, Comm, agree
from shardpoint_core.transactions.protocol import StorageBackend
from shardpoint_core.transactions.resolve import resolve
from shardpoint.api.save_options import SaveOptions, SaveResult
from shardpoint.api.save_job import SaveJob

__all__ = ["SaveJob", "SaveOptions", "SaveResult", "run_save"]


# -------------------------------------------------------------------------------- save
def run_save(
    state: Any,
    path: str,
    comm: Comm,
    be: Optional[StorageBackend],
    opts: SaveOptions,
    overwrite: "bool | str",
    group: Any,
    async_save: bool,
) -> "SaveResult | AsyncSave":
    """One save, phase by phase, with ``group`` (the checkpointer's state for ``comm``'s
    process group: plan cache, pending async save and its pool, side group). What
    :meth:`Checkpointer.save` runs."""
    path, be = resolve(path, be, "save")  # s3://... is never a local directory 's3:'
    ow = check_overwrite(overwrite)
    comm.after_failure = AFTER_SAVE
    saves = group.saves
    saves.settle(lambda err: agree(comm, err, errors.SaveFailedError))
    job = SaveJob(state, path, comm, be, opts, ow, group)
    job.async_save = async_save
    try:
        job.plan()
        if not async_save:
            job.stage()
            job.write(comm)
            res = job.commit(comm)
            release_free_heap()  # flat memory over save cycles: see api/heap.py
            return res
        job.stage(saves.pool)
        if job.error is not None:
            job.commit(comm)  # raises the staging failure on every rank, removes staging
        side = group.side_comm(comm)
    except BaseException:
        job.abandon()
        raise
    job.times["blocking"] = time.perf_counter() - job.t0

    def background() -> SaveResult:
        t = time.perf_counter()
        job.write(side)
        res = job.commit(side)
        res.timings["background"] = time.perf_counter() - t
        release_free_heap()
        return res

    return saves.start(background, job.staging_bytes, job.path, opts.async_priority)
