"""Byte stores: the seam beneath the format (see :mod:`.base`)."""
from shardpoint_core.store.base import ByteStore, ObjectInfo, StoreCapabilities

__all__ = ["ByteStore", "ObjectInfo", "StoreCapabilities"]
