"""Which base an incremental packed save builds on ([SP-PACK-9]): a committed packed
checkpoint beside the target, named by the caller (a sibling's name or path) or, with
``True``, the newest committed checkpoint there (files: by its manifest's time).

The base must lie beside the target (the index names it by one path component, so a moved
parent keeps every reference working and nothing outside the parent is reachable) and is
never the target itself (a save replacing its own base would delete what it refers to).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Union

from shardpoint_core.arrays.packed_base import Base, base_name, load_base, sibling_path
from shardpoint_core.format.errors import InvalidOptionError
from shardpoint_core.format.spec import MANIFEST_NAME
from shardpoint_core.stores.registry import is_local

log = logging.getLogger("shardpoint")


def newest_sibling(path: str) -> Optional[str]:
    """The name of the newest committed checkpoint beside ``path`` on files (by its
    manifest's modification time; names starting with ``.`` are staging and leftovers);
    None where there is none or ``path`` is a URL."""
    if not is_local(path):
        return None
    me = base_name(path)
    parent = os.path.dirname(os.path.abspath(os.fspath(path)))
    best = None
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return None
    for n in names:
        if n == me or n.startswith("."):
            continue
        try:
            t = os.stat(os.path.join(parent, n, MANIFEST_NAME)).st_mtime_ns
        except (FileNotFoundError, NotADirectoryError):
            continue
        if best is None or (t, n) > best:
            best = (t, n)
    return None if best is None else best[1]


def resolve_base(path: str, incremental: Union[bool, str], zarr: Any) -> Optional[Base]:
    """The :class:`Base` of an incremental save of ``path``: ``incremental`` a sibling's
    name, a path beside ``path``, or ``True`` (:func:`newest_sibling`; None: there is none,
    the save is a full one that records hashes). InvalidOptionError for a base elsewhere,
    the target itself, or one not in the packed layout; CheckpointNotFoundError where none
    is committed there."""
    if incremental is True and not is_local(path):
        raise InvalidOptionError(
            f"incremental=True for {path!r}: on an object store name the base (its name "
            "beside the target, or its URL); a CheckpointManager(incremental=True) does so"
        )
    if incremental is True:
        name = newest_sibling(path)
        if name is None:
            return None
    elif incremental is False:
        return None
    else:
        given = os.fspath(incremental)
        name = base_name(given) if ("/" in given or "\\" in given) else given
        if ("/" in given or "\\" in given) and _norm(sibling_path(path, name)) != _norm(given):
            raise InvalidOptionError(
                f"incremental={given!r}: the base of a save of {path!r} must lie beside it "
                "(in the same directory or prefix); the index names it by its name alone "
                "([SP-PACK-9])"
            )
    if name in ("", ".", "..") or name == base_name(path):
        raise InvalidOptionError(
            f"incremental={incremental!r}: a save of {path!r} cannot build on the checkpoint "
            "it replaces (its bytes are deleted when the new one commits)"
        )
    base = load_base(sibling_path(path, name), zarr.read_manifest, name)
    if base.index is None:
        raise InvalidOptionError(
            f"incremental base {sibling_path(path, name)!r} is not in the packed layout: only "
            "packed checkpoints can be built on (it was saved with backend=ZarrBackend(); "
            "the default backend saves packed)"
        )
    if not base.hashed:  # nothing to compare against: a full save, which records hashes
        log.warning(
            "incremental save of %s: its base %s records no chunk hashes ([SP-PACK-10]; it "
            "was saved without incremental= or hashes=True), so every chunk is written again; "
            "this save records them, so the next one can build on it",
            path,
            sibling_path(path, name),
        )
    return base


def _norm(p: str) -> str:
    return os.path.abspath(p) if is_local(p) else p.rstrip("/")
