"""The public entry points: ``save``, ``load`` and ``read_metadata``.

``save`` and ``load`` are thin wrappers over the default :class:`Checkpointer`, which owns
the plan cache, the async save queue and side groups per process group. Both are collective
over a process group (a world of one when torch.distributed is not initialized). Their
pipelines (:class:`SaveJob`, :class:`LoadJob`) live in :mod:`.saving` and :mod:`.loading`;
this module is the stable import path for users and the manager.
"""

from __future__ import annotations

from shardpoint.planning.load_planner import LoadOptions
from shardpoint.api.checkpointer import load, save
from shardpoint.api.loading import LoadJob, LoadReport, LoadResult, read_metadata
from shardpoint.api.async_save import AsyncSave
from shardpoint.api.saving import SaveJob, SaveOptions, SaveResult
from shardpoint.api.checkpointer import Checkpointer, default_checkpointer

__all__ = [
    "save",
    "load",
    "read_metadata",
    "SaveOptions",
    "SaveResult",
    "AsyncSave",
    "LoadReport",
    "LoadResult",
    "LoadOptions",
    "Checkpointer",
    "default_checkpointer",
    "SaveJob",
    "LoadJob",
]
