"""The manifest of a checkpoint as :class:`~shardpoint_core.transactions.backend.ZarrBackend`
writes and reads it: the save's Zarr group metadata written before its manifest goes to the
committer, and an object store's manifest read in one GET that also gives the commit's
identity ([SP-COMMIT-14]).

Kept apart from the backend so that the manifest's requests, size cap and errors are in one
place, beside the arrays' handles (:mod:`.backend_handles`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, Union

from shardpoint_core.arrays import local
from shardpoint_core.arrays.groups import array_paths_of, start_groups, write_groups
from shardpoint_core.format.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StoreNotFoundError,
)
from shardpoint_core.format.manifest import Manifest
from shardpoint_core.format.spec import MANIFEST_NAME
from shardpoint_core.stores.registry import is_local

__all__ = ["MAX_MANIFEST_BYTES", "read_remote_manifest", "write_manifest_groups"]

MAX_MANIFEST_BYTES = local.MAX_MANIFEST_BYTES


def write_manifest_groups(
    store: Any,
    key: str,
    root: str,
    data: Union[bytes, Manifest],
    local_submit: Any,
    remote_submit: Any,
) -> None:
    """The Zarr group metadata ([SP-LAYOUT-5]) of the save at ``root`` (``key`` below
    ``store``) whose manifest is ``data``: on files written and durable (``local_submit``'s
    pool), on an object store PUT (``remote_submit``'s) and waited for; nothing for a packed
    manifest or bytes that are not a manifest."""
    arrays = (
        [e.array for e in data.tensors.values()]
        if isinstance(data, Manifest)
        else array_paths_of(data)
    )  # None: not a manifest, no groups to write
    if isinstance(data, Manifest) and data.packed is not None:
        arrays = None  # the packed layout has no zarr.json ([SP-PACK-1]): a copy's commit
    local_files = is_local(root)
    # An OSError names its file and goes to the caller as the manifest's own would (the
    # save reports it as a failed commit, with the fix for a full disk).
    if arrays is not None and local_files:
        write_groups(store, key, arrays, local_submit)
    groups = (
        start_groups(store, key, arrays, remote_submit)
        if arrays is not None and not local_files
        else []
    )
    # Object stores: no staged copy below the save prefix (spec 1.3, [SP-COMMIT-11]): a
    # prefix holding a manifest looks like a checkpoint to anyone who opens it.
    for f in groups:
        f.result()


def read_remote_manifest(
    store: Any,
    key: str,
    path: str,
    identity: bool,
    checkpoint_identity: Callable[[str], Optional[list[Any]]],
    state: Callable[[str], str],
) -> Tuple[bytes, Optional[list[Any]]]:
    """(the bytes of the manifest of the checkpoint ``path`` at ``key`` of an object store,
    its commit identity where ``identity``): one GET, at most one byte over the cap; the
    identity from that GET where the store gives it (``get_versioned``), else
    ``checkpoint_identity`` first. No manifest: IncompleteCheckpointError where ``state``
    says objects are there, else CheckpointNotFoundError."""
    mkey = f"{key}/{MANIFEST_NAME}" if key else MANIFEST_NAME
    getv = getattr(store, "get_versioned", None) if identity else None
    ident = None
    if identity and getv is None:
        ident = checkpoint_identity(path)
    try:  # one request: at most one byte over the cap, so a bigger one is seen
        if getv is not None:
            data, info = getv(mkey, MAX_MANIFEST_BYTES + 1)
            ident = [info.version, info.size]
        else:
            data = store.get_range(mkey, 0, MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError as e:
        if isinstance(e, StoreNotFoundError):
            raise
        if state(path) == "incomplete":
            raise IncompleteCheckpointError(
                f"{path} has objects but no manifest.msgpack: not a checkpoint; an "
                "unfinished save (crashed or still running) or an incomplete copy",
                spec_id="SP-COMMIT-3",
            ) from None
        raise CheckpointNotFoundError(
            f"no checkpoint at {path} (no manifest.msgpack)", spec_id="SP-COMMIT-3"
        ) from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(
            f"{path}/{MANIFEST_NAME} is over the 1 GiB cap", spec_id="SP-SEC-2"
        )
    return data, ident
