"""Where a checkpoint lives: the one place a path or URL becomes a byte store and a key.

A local path (plain or ``file://``) is a :class:`~.files.FileStore` rooted at it (key ``""``);
a URL of a registered scheme (``s3://bucket/run/step_5``) is the shared store of its bucket
(one per bucket and environment in a process, :func:`~.registry.bucket_store`) and the key
below it. Every rung above (arrays, committers, transactions, managers) asks this module, so
a scheme nobody registered is refused here, before any I/O, with the same error everywhere.

Example::

    loc = locate("s3://bucket/run/step_5")
    loc.store.get_range(loc.child("manifest.msgpack"), 0, 16)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Tuple

from shardpoint_core.stores.base import ByteStore
from shardpoint_core.stores.files import FileStore
from shardpoint_core.stores.registry import bucket_store, check_path, is_local, local_path


@dataclass(frozen=True)
class Location:
    """``url``: the path as normalized (an absolute local path, or a URL without a trailing
    ``/``); ``store`` and ``key``: where its bytes are (``key`` is ``""`` at a store's root);
    ``local``: the store is a directory of this host's file system."""

    url: str
    store: ByteStore
    key: str
    local: bool

    def child(self, name: str) -> str:
        """The key of ``name`` below this location, in its store."""
        return f"{self.key}/{name}" if self.key else name

    def pair(self) -> Tuple[ByteStore, str]:
        """``(store, key)``, the form the array layer and the committers take."""
        return self.store, self.key

    def __str__(self) -> str:
        return self.url


def locate(
    path: Any, call: str = "open", *, fsync: bool = True, sync_method: str = "auto"
) -> Location:
    """The :class:`Location` of ``path``; ``call`` names the API call in a refusal
    (:class:`~shardpoint_core.format.errors.UnsupportedStoreError` for a scheme nobody
    registered). ``fsync``/``sync_method``: how a local store makes writes durable."""
    if is_local(path):
        p = os.path.abspath(local_path(os.fspath(path), call))
        return Location(p, FileStore(p, fsync=fsync, sync_method=sync_method), "", True)
    check_path(path, call)
    url = os.fspath(path).rstrip("/")
    store, key = bucket_store(url, call)
    return Location(url, store, key, False)
