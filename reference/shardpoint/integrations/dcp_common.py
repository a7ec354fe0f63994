"""What the DCP writer and reader share: which ``checkpoint_id`` values shardpoint takes, the
group a ``no_dist`` call runs on, and the tree of a plan's items. Pure helpers over torch."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from shardpoint_core.format import errors
from shardpoint_core.stores.registry import check_path

_SOLO: dict = {}


def supports_checkpoint_id(checkpoint_id: Any) -> bool:
    """Whether shardpoint can write or read at ``checkpoint_id`` (DCP asks this to pick a
    storage class for a bare ``checkpoint_id``): a local path or ``file://`` URL, or the URL of
    a store scheme registered with shardpoint (``s3://``, ``memory://``); not an unknown scheme."""
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        return False
    try:
        check_path(checkpoint_id, "save")
    except errors.UnsupportedStoreError:
        return False
    return True


def planned_alone(plans: list) -> bool:
    """True when DCP planned this save or load for this rank alone (``no_dist=True``: every
    rank is its own coordinator and plans only itself), while a process group may be running.
    DCP tells storage nothing else that tells ``no_dist`` apart on rank 0; the coordinator of a
    collective call sees every rank's plan, and the other ranks never get here."""
    return len(plans) == 1


def registered(group: Any) -> bool:
    """Whether a process group made earlier is still live (it is not once the default group
    was destroyed, even if one was made again since)."""
    try:
        dist.get_process_group_ranks(group)
    except (ValueError, RuntimeError, KeyError):  # "Group ... is not registered"
        return False
    return True


def solo_group() -> Any:
    """A process group of this rank alone (for ``no_dist`` use inside a running world), made
    once per default group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    rank = dist.get_rank()
    if rank not in _SOLO or not registered(_SOLO[rank]):
        _SOLO[rank] = dist.new_group([rank], use_local_synchronization=True)
    return _SOLO[rank]


def nest(leaves: dict, where: str) -> dict:
    """``{path tuple: leaf}`` as nested dicts (list indexes become int keys, which shardpoint
    keys exactly as list positions)."""
    root: dict = {}
    for path, leaf in leaves.items():
        node = root
        for c in path[:-1]:
            nxt = node.setdefault(c, {})
            if not isinstance(nxt, dict):
                raise errors.InvalidKeyError(f"{where}: {path!r} lies under a leaf at {c!r}")
            node = nxt
        if path[-1] in node:
            raise errors.InvalidKeyError(f"{where}: two items map to the tree path {path!r}")
        node[path[-1]] = leaf
    return root
