"""The one PUT that commits a save on an object store ([SP-COMMIT-12]) and how its outcome
is settled: conditional where the store can, read back when the answer was not success
([SP-COMMIT-17]), retried with the same condition, and taken back when recovery removed the
save meanwhile ([SP-COMMIT-16]).

Kept apart from :mod:`.object_store`, whose committer decides what to PUT and what to delete,
so that the requests around the marker and their errors are in one place.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from shardpoint_core.commit.lease import LeaseState
from shardpoint_core.format.errors import (
    CheckpointExistsError,
    CorruptCheckpointError,
    SaveFailedError,
    StoreNotFoundError,
)
from shardpoint_core.stores.base import ByteStore, replaceable

__all__ = [
    "_MAX_MANIFEST",
    "_commit_marker",
    "_lease_intact",
    "_lost_race",
    "_put_marker",
    "_read_with_version",
    "_take_back",
]

log = logging.getLogger("shardpoint")
_MAX_MANIFEST = 1 << 30


def _url(store: ByteStore, key: str) -> str:
    return f"{store.url.rstrip('/')}/{key}"


def _commit_marker(
    store: ByteStore,
    key: str,
    marker: bytes,
    old: Optional[tuple[bytes, str]],
    target: str,
    conditional: bool,
    replace_if_match: bool,
) -> Optional[str]:
    """PUT the marker ([SP-COMMIT-12]) and return its version. Whatever the PUT answered,
    when it did not answer success the marker is read back: this save's own bytes mean
    the PUT (or a retry of it) landed ([SP-COMMIT-17]). A precondition that failed for a
    marker that is not ours is another save's win; a transport failure with the marker
    unchanged is retried with the same condition (never without it)."""
    attempts = 3
    for attempt in range(attempts):
        try:
            return _put_marker(store, key, marker, old, conditional, replace_if_match)
        except (FileExistsError, FileNotFoundError, OSError) as e:
            if isinstance(e, StoreNotFoundError):
                raise
            failure = e
        try:
            now = _read_with_version(store, key)
        except CheckpointExistsError:  # changing under our read: not settled
            now = (b"", "?")
        if now is not None and now[0] == marker:
            log.info(
                "shardpoint: the commit PUT of %s failed (%s) but the marker is "
                "this save's: committed",
                _url(store, target),
                failure,
            )
            return now[1]
        unchanged = (now is None and old is None) or (
            now is not None and old is not None and now[1] == old[1]
        )
        if isinstance(failure, (FileExistsError, FileNotFoundError)) or not unchanged:
            raise _lost_race(store, target, failure)  # a precondition failed, not for us
        if attempt + 1 < attempts:
            time.sleep(0.2 * (attempt + 1))
    raise SaveFailedError(
        f"{_url(store, target)}: the commit PUT failed {attempts} times ({failure}) and the "
        "marker there is unchanged: nothing was committed",
        spec_id="SP-COMMIT-12",
    ) from failure


def _lost_race(store: ByteStore, target: str, e: BaseException) -> CheckpointExistsError:
    err = CheckpointExistsError(
        f"{_url(store, target)}: another save committed or replaced the checkpoint there "
        "while this one ran (its conditional PUT won); this save was not committed",
        spec_id="SP-COMMIT-12",
    )
    err.__cause__ = e
    return err


def _put_marker(
    store: ByteStore,
    key: str,
    marker: bytes,
    old: Optional[tuple[bytes, str]],
    conditional: bool,
    replace_if_match: bool,
) -> Optional[str]:
    """The one PUT that commits ([SP-COMMIT-12]), conditional where the store can; the
    marker's new version (None where the store has none)."""
    if not conditional:  # [SP-COMMIT-12]: the last PUT wins, never a mix
        return store.put(key, marker)
    if old is None:
        return store.put(key, marker, if_absent=True)
    if replace_if_match:
        return replaceable(store).put(key, marker, if_match=old[1])
    return store.put(key, marker)  # no If-Match: a replacement race is the caller's


def _lease_intact(store: ByteStore, lease: LeaseState) -> bool:
    """The save's lease is where it wrote it last, unchanged: recovery has not begun to
    remove the save's prefix ([SP-COMMIT-16])."""
    try:
        return store.get(lease.key) == lease.data
    except FileNotFoundError:
        return False


def _take_back(
    store: ByteStore,
    key: str,
    marker: bytes,
    version: Optional[str],
    old: Optional[tuple[bytes, str]],
    target: str,
    replace_if_match: bool,
) -> None:
    """Undo this save's marker after its data was found removed: the replaced marker goes
    back (If-Match this save's marker), or, for a fresh target, the marker is deleted if
    it is still this save's."""
    try:
        if old is not None:
            if replace_if_match and version:
                replaceable(store).put(key, old[0], if_match=version)
            else:
                store.put(key, old[0])
            return
        now = _read_with_version(store, key)
        if now is not None and now[0] == marker:
            store.delete([key])
    except (OSError, CheckpointExistsError) as e:
        log.error(
            "shardpoint: could not take back the marker of %s (%s): it names "
            "objects recovery removed",
            _url(store, target),
            e,
        )


def _read_with_version(store: ByteStore, key: str) -> Optional[tuple[bytes, str]]:
    """(bytes, version) of ``key``, or None; the version is the one the bytes are of:
    one GET where the store gives the version with the bytes (``get_versioned``), else a
    HEAD before and after the GET."""
    getv = getattr(store, "get_versioned", None)
    if getv is not None:
        try:  # at most one byte over the cap, so a bigger one is seen
            data, info = getv(key, _MAX_MANIFEST + 1)
        except StoreNotFoundError:
            raise
        except FileNotFoundError:
            return None
        if info.size > _MAX_MANIFEST or len(data) > _MAX_MANIFEST:
            raise CorruptCheckpointError(
                f"{_url(store, key)} is {info.size} bytes, over 1 GiB", spec_id="SP-SEC-2"
            )
        return data, info.version
    info = store.head(key)
    if info is None:
        return None
    if info.size > _MAX_MANIFEST:
        raise CorruptCheckpointError(
            f"{_url(store, key)} is {info.size} bytes, over 1 GiB", spec_id="SP-SEC-2"
        )
    data = store.get(key)
    again = store.head(key)
    if again is None or again.version != info.version:
        raise CheckpointExistsError(
            f"{_url(store, key)} changed while it was read: another save is committing there",
            spec_id="SP-COMMIT-12",
        )
    return data, info.version
