"""Byte stores: the seam beneath the format (see :mod:`.base`): local files, memory, and the
stores registered by URL scheme (:mod:`.registry`)."""

from shardpoint_core.stores.base import ByteStore, ObjectInfo, StoreCapabilities
from shardpoint_core.stores.files import FileStore
from shardpoint_core.stores.keys import check_key
from shardpoint_core.stores.memory import MemoryStore
from shardpoint_core.stores.registry import (
    check_path,
    is_local,
    local_path,
    open_store,
    register_store,
    registered_schemes,
    unregister_store,
)

__all__ = [
    "ByteStore",
    "FileStore",
    "MemoryStore",
    "ObjectInfo",
    "StoreCapabilities",
    "check_key",
    "check_path",
    "is_local",
    "local_path",
    "open_store",
    "register_store",
    "registered_schemes",
    "unregister_store",
]
