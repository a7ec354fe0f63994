"""``from shardpoint import dcp``: ``torch.distributed.checkpoint`` with shardpoint storage.

Use it in place of ``import torch.distributed.checkpoint as dcp``: ``dcp.save``,
``dcp.load`` and ``dcp.async_save`` given a bare ``checkpoint_id`` write and read shardpoint
checkpoints and raise shardpoint's errors as they are (:mod:`shardpoint.integrations.dcp_api`);
every other name (``dcp.FileSystemWriter``, ``dcp.state_dict``, ...) is DCP's own. The storage
classes ``ShardpointWriter``/``ShardpointReader`` also work with DCP's functions directly
(:mod:`shardpoint.integrations.dcp`). A facade above the layers: nothing inside the package
imports it."""

import torch.distributed.checkpoint as _torch_dcp

from shardpoint.integrations.dcp import ShardpointReader, ShardpointWriter
from shardpoint.integrations.dcp_api import async_save, load, save, shardpoint_error

__all__ = ["ShardpointReader", "ShardpointWriter", "async_save", "load", "save", "shardpoint_error"]


def __getattr__(name: str):
    return getattr(_torch_dcp, name)
