"""What replacing or removing a checkpoint on an object store deletes ([SP-COMMIT-14]): the
objects the protocol wrote for the arrays its marker names, and prefixes, leases last.

Kept apart from :mod:`.object_store` so that what the committer may delete (nothing it did
not write) is decided in one place.
"""

from __future__ import annotations

from typing import List

from shardpoint_core.commit.lease import LEASE_NAME
from shardpoint_core.commit.object_marker import SAVE_PREFIX, _array_dirs, _join
from shardpoint_core.format.spec import MANIFEST_NAME
from shardpoint_core.stores.base import ByteStore

__all__ = ["_delete_arrays", "_delete_last_lease", "_named_objects"]


def _delete_arrays(store: ByteStore, target: str, envelope: bytes, keep: str = "") -> None:
    """Delete the objects a replaced or removed manifest named ([SP-COMMIT-14])."""
    _delete_last_lease(store, _named_objects(store, target, envelope, keep))


def _delete_last_lease(store: ByteStore, keys: List[str]) -> None:
    """Delete ``keys``, leases last: a deletion cut short leaves a prefix that recovery
    still recognises as this protocol's ([SP-COMMIT-16])."""
    leases = [k for k in keys if k.endswith("/" + LEASE_NAME)]
    rest = [k for k in keys if not k.endswith("/" + LEASE_NAME)]
    if rest:
        store.delete(rest)
    if leases:
        store.delete(leases)


def _named_objects(store: ByteStore, target: str, envelope: bytes, keep: str = "") -> List[str]:
    """What the protocol wrote for the arrays a manifest names, ``keep`` excepted: below
    each save prefix its ``tensors/``, its root group, its lease and a staged manifest
    copy (writers before 1.3); below each plain array path (section 3), all of it.
    Nothing else below a save prefix is ours to delete."""
    try:
        dirs, packed = _array_dirs(envelope)
    except Exception:  # noqa: BLE001 - a damaged old marker: its objects stay, recover
        return []  # finds unreferenced save prefixes; nothing else is ours to guess
    prefixes, saves = set(), set()
    for d in dirs:
        top, _, rest = d.partition("/")
        if top.startswith(SAVE_PREFIX) and top != keep:
            saves.add(_join(target, top))
            # one listing per save: its arrays all lie below tensors/ ([SP-LAYOUT-4])
            prefixes.add(
                _join(target, top, "tensors") + "/"
                if rest.startswith("tensors/")
                else _join(target, d) + "/"
            )
        elif not top.startswith(SAVE_PREFIX):
            prefixes.add(_join(target, d) + "/")
    out = [i.key for p in sorted(prefixes) for i in store.list(p)]
    for save in sorted(saves) if packed else ():  # (1.4) its data objects [SP-PACK-8]
        out += [i.key for i in store.list(_join(save, "packed") + "/")]
    for save in sorted(saves):  # its root group [SP-LAYOUT-5], a 1.2 staged copy
        out += [_join(save, "zarr.json"), _join(save, MANIFEST_NAME), _join(save, LEASE_NAME)]
    return out
