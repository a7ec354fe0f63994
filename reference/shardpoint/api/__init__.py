"""The public entry points: ``save``, ``load`` and ``read_metadata``.

Both ``save`` and ``load`` are collective over a process group (a world of one when
torch.distributed is not initialized). Their pipelines live in :mod:`.saving` and
:mod:`.loading`; this module is the stable import path for users and the manager.
"""
from __future__ import annotations

from shardpoint.planning.load_planner import LoadOptions
from shardpoint.api.loading import LoadReport, load, read_metadata
from shardpoint.api.async_save import AsyncSave
from shardpoint.api.saving import SaveOptions, SaveResult, save

__all__ = ["save", "load", "read_metadata", "SaveOptions", "SaveResult", "AsyncSave",
           "LoadReport", "LoadOptions"]
