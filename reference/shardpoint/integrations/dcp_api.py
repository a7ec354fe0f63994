"""``dcp.save``/``dcp.load``/``dcp.async_save`` with shardpoint storage: the one-line switch.

    from shardpoint import dcp            # instead of: import torch.distributed.checkpoint as dcp
    dcp.save(state_dict, checkpoint_id="/ckpt/step_100")
    dcp.load(state_dict, checkpoint_id="/ckpt/step_100")

Each function is DCP's own (same arguments, same planners, same collectives), with two
changes: a bare ``checkpoint_id`` gets :class:`ShardpointWriter`/:class:`ShardpointReader`
(DCP 2.x picks storage for a bare id from a fixed list, its file system and fsspec classes, so
no registration could make ``torch.distributed.checkpoint.save`` choose shardpoint; the import
is the switch), and a failure that is shardpoint's is raised as its documented class
(:class:`~shardpoint.UnsupportedValueError`, :class:`~shardpoint.CheckpointExistsError`, ...)
instead of inside DCP's ``CheckpointException``, which stays attached as ``__cause__``. A
failure that is not shardpoint's (DCP's own "Size mismatch", a planner error) is DCP's
``CheckpointException`` as before. A ``storage_writer``/``storage_reader`` given explicitly
is used as it is (DCP's ``FileSystemWriter`` too).
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any, Optional

import torch.distributed.checkpoint as _dcp
from torch.distributed.checkpoint.api import CheckpointException

from shardpoint_core.format.errors import ShardpointError
from shardpoint.integrations.dcp import ShardpointReader, ShardpointWriter


def shardpoint_error(exc: BaseException) -> Optional[ShardpointError]:
    """The shardpoint error inside a DCP ``CheckpointException`` (the lowest rank's), or
    None when no rank failed with one."""
    failures = getattr(exc, "failures", None)
    if not isinstance(exc, CheckpointException) or not isinstance(failures, dict):
        return None
    for rank in sorted(failures):
        inner = failures[rank][0] if isinstance(failures[rank], tuple) else None
        if isinstance(inner, ShardpointError):
            return inner
    return None


def _unwrapped(exc: BaseException) -> BaseException:
    inner = shardpoint_error(exc)
    if inner is None:
        return exc
    inner.__cause__ = exc
    return inner


def save(
    state_dict: Any,
    *,
    checkpoint_id: "str | os.PathLike | None" = None,
    storage_writer: Any = None,
    planner: Any = None,
    process_group: Any = None,
    no_dist: bool = False,
    use_collectives: bool = True,
) -> Any:
    """``torch.distributed.checkpoint.save`` writing a shardpoint checkpoint at
    ``checkpoint_id`` (see the module docstring)."""
    if storage_writer is None and checkpoint_id is not None:
        storage_writer = ShardpointWriter(checkpoint_id, group=process_group)
    try:
        return _dcp.save(
            state_dict,
            checkpoint_id=checkpoint_id,
            storage_writer=storage_writer,
            planner=planner,
            process_group=process_group,
            no_dist=no_dist,
            use_collectives=use_collectives,
        )
    except CheckpointException as e:
        raise _unwrapped(e) from e


def load(
    state_dict: dict,
    *,
    checkpoint_id: "str | os.PathLike | None" = None,
    storage_reader: Any = None,
    planner: Any = None,
    process_group: Any = None,
    no_dist: bool = False,
) -> None:
    """``torch.distributed.checkpoint.load`` reading the shardpoint checkpoint at
    ``checkpoint_id`` in place into ``state_dict``."""
    if storage_reader is None and checkpoint_id is not None:
        storage_reader = ShardpointReader(checkpoint_id, group=process_group)
    try:
        _dcp.load(
            state_dict,
            checkpoint_id=checkpoint_id,
            storage_reader=storage_reader,
            planner=planner,
            process_group=process_group,
            no_dist=no_dist,
        )
    except CheckpointException as e:
        raise _unwrapped(e) from e


def async_save(
    state_dict: Any,
    *,
    checkpoint_id: "str | os.PathLike | None" = None,
    storage_writer: Any = None,
    planner: Any = None,
    process_group: Any = None,
    **kwargs: Any,
) -> Any:
    """``torch.distributed.checkpoint.async_save`` writing a shardpoint checkpoint; the
    returned future's ``result()`` raises shardpoint's errors as they are too."""
    if storage_writer is None and checkpoint_id is not None:
        storage_writer = ShardpointWriter(checkpoint_id, group=process_group)
    try:
        fut = _dcp.async_save(
            state_dict,
            checkpoint_id=checkpoint_id,
            storage_writer=storage_writer,
            planner=planner,
            process_group=process_group,
            **kwargs,
        )
    except CheckpointException as e:
        raise _unwrapped(e) from e
    if not isinstance(fut, concurrent.futures.Future):
        return fut
    out: concurrent.futures.Future = concurrent.futures.Future()
    fut.add_done_callback(lambda f: _settle(f, out))
    return out


def _settle(done: concurrent.futures.Future, out: concurrent.futures.Future) -> None:
    exc = done.exception()
    if exc is None:
        out.set_result(done.result())
    else:
        out.set_exception(_unwrapped(exc))


__all__ = ["async_save", "load", "save", "shardpoint_error"]
