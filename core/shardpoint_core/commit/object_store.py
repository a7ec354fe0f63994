"""The commit protocol for stores without rename (S3 and alike): [SP-COMMIT-10] .. [SP-COMMIT-15].

What S3 makes atomic: one PUT (or multipart completion) of one object, optionally conditional
(``If-None-Match: *``, ``If-Match: <etag>``). Nothing else: no rename, no transaction over
several objects, no atomic delete of a prefix. So a save never writes where a committed
checkpoint's bytes are; the one atomic step is the PUT of the manifest:

    <target>/save-<token>/lease.msgpack the save's lease, its first object ([SP-COMMIT-16])
    <target>/save-<token>/tensors/...   every chunk and zarr.json of the save with <token>
    <target>/manifest.msgpack           the commit marker: the manifest, its array paths
                                        below save-<token>/

The marker is encoded once and PUT once: a writer hands the committer its
:class:`~shardpoint_core.format.manifest.Manifest` (``write_manifest``), which is encoded with
``save-<token>/`` in front of every array path (:func:`encode_marker`) and kept until
``publish`` PUTs those bytes unchanged. Nothing is written below the save prefix for it (a
1.2 writer's staged copy is still read, and bytes with relative array paths still have their
paths moved below the prefix).

A crash before the marker's PUT leaves the previous checkpoint whole (its bytes are under
another prefix) and an unreferenced ``save-<token>/`` (a leftover); after it, the new one. A
reader sees one manifest or the other, and each names only its own save's objects, so no mix
is possible. A fresh target is claimed with ``If-None-Match: *`` (of two saves exactly one
wins), a replacement with ``If-Match`` on the manifest the save checked (a save that raced
another replacement loses instead of orphaning it). The replaced checkpoint's objects are
deleted after the new marker is in place.

The marker's bytes are :mod:`.object_marker`'s, the PUT that commits and the settling of its
outcome :mod:`.object_put`'s, what a replacement deletes :mod:`.object_delete`'s. Call order
and ranks as in :mod:`shardpoint_core.commit.base`. Targets, staging locations and leftovers
are keys (``/``-separated, no leading ``/``) of the committer's store.

Example::

    c = ObjectStoreCommitter(S3Store.from_url("s3://bucket/run"))
    staging = c.begin("step_5", token)        # every rank writes below it
    c.write_manifest(staging, manifest)       # a Manifest: encoded once, as the marker
    c.publish(staging, "step_5", overwrite=False)
"""

from __future__ import annotations

import itertools
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Tuple, Union

from shardpoint_core.commit.base import Overwrite, check_overwrite
from shardpoint_core.commit.lease import (
    LEASE_NAME,
    read_lease,
    reclaim_lease,
    start_lease,
    stop_lease,
)
from shardpoint_core.commit.leftovers import Leftover
from shardpoint_core.commit.references import may_be_base, refuse_if_referenced, store_referrers
from shardpoint_core.format.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    InvalidOptionError,
    SaveFailedError,
)
from shardpoint_core.format.manifest import Manifest
from shardpoint_core.format.spec import MANIFEST_NAME
from shardpoint_core.stores.base import ByteStore
from shardpoint_core.commit.object_delete import _delete_arrays, _delete_last_lease, _named_objects
from shardpoint_core.commit.object_marker import (
    SAVE_PREFIX,
    _array_dirs,
    _check_marker,
    _join,
    _rewrite_array_paths,
    encode_marker,
    save_dir_of,
)
from shardpoint_core.commit.object_put import (
    _commit_marker,
    _lease_intact,
    _read_with_version,
    _take_back,
)

# the committer's own names, and the marker's (:mod:`.object_marker`), importable from here
# as before the split
__all__ = [
    "SAVE_PREFIX",
    "ObjectStoreCommitter",
    "_rewrite_array_paths",
    "encode_marker",
    "save_dir_of",
]

log = logging.getLogger("shardpoint")
_TOKEN = re.compile(r"[0-9a-f]{8,64}\Z")


class ObjectStoreCommitter:
    """Publishes checkpoints in one :class:`~shardpoint_core.stores.base.ByteStore` that has no
    rename, with the manifest as the single atomic commit marker ([SP-COMMIT-10])."""

    def __init__(self, store: ByteStore, *, lease_s: Optional[float] = None) -> None:
        from shardpoint_core.commit.lease import DEFAULT_LEASE_S

        self.store = store
        self.lease_s = float(
            lease_s if lease_s is not None else getattr(store, "lease_s", DEFAULT_LEASE_S)
        )
        self.conditional = bool(store.capabilities.conditional_put)
        self.replace_if_match = bool(getattr(store.capabilities, "conditional_replace", False))
        # staging key -> (bytes, True for a marker encoded once, False for a manifest whose
        # array paths are relative to the save prefix), from write_manifest until publish
        self._pending: Dict[str, Tuple[bytes, bool]] = {}

    # -- what is at a target ------------------------------------------------------------
    def _manifest_key(self, target: str) -> str:
        return _join(target, MANIFEST_NAME)

    def _foreign(self, target: str, listing: Optional[Iterable[Any]] = None) -> List[str]:
        """Objects under ``target/`` (``listing``: the store's list of it, when the caller
        started it) that are neither the marker nor below a save prefix or a committed
        array path (someone else's: never replaced, never deleted)."""
        out = []
        if listing is None:
            listing = self.store.list(_join(target) + "/" if target else "")
        for info in listing:
            rel = info.key[len(_join(target)) + 1 :] if target else info.key
            if rel == MANIFEST_NAME or rel.startswith(SAVE_PREFIX):
                continue
            out.append(info.key)
        return out

    def state(self, target: str) -> str:
        """'committed' (the marker is there), 'incomplete' (objects, no marker) or 'missing'."""
        if self.store.head(self._manifest_key(target)) is not None:
            return "committed"
        prefix = _join(target) + "/" if target else ""
        return "incomplete" if next(iter(self.store.list(prefix)), None) else "missing"

    def check_target(self, target: str, overwrite: Overwrite) -> None:
        """Refuse a committed checkpoint without ``overwrite`` ([SP-COMMIT-5]) and, with or
        without it, objects under the target that this protocol did not write
        ([SP-COMMIT-13]): nothing deletes what it did not create (so ``"any"`` acts as
        ``True`` here: there is no non-checkpoint it would let a save replace). The marker's
        HEAD and the first page of the target's listing are in flight together (one round
        trip)."""
        overwrite = check_overwrite(overwrite)
        with ThreadPoolExecutor(1, thread_name_prefix="sp-commit") as side:
            marker = side.submit(self.store.head, self._manifest_key(target))
            listing = iter(self.store.list(_join(target) + "/" if target else ""))
            first = list(itertools.islice(listing, 1))  # fetches the first page
            committed = marker.result() is not None
        if committed and not overwrite:
            raise CheckpointExistsError(
                f"{self._url(target)} holds a committed checkpoint; pass overwrite=True to "
                "replace it, or save to another path",
                spec_id="SP-COMMIT-5",
            )
        if not committed:
            foreign = self._foreign(target, itertools.chain(first, listing))
            if foreign:
                raise CheckpointExistsError(
                    f"{self._url(target)} holds {len(foreign)} object(s) that are not a "
                    f"shardpoint checkpoint (first: {foreign[0]!r}); a save never replaces or "
                    "deletes them: choose another path or remove them yourself",
                    spec_id="SP-COMMIT-13",
                )

    def _refuse_if_referenced(self, target: str, envelope: bytes, what: str) -> None:
        """[SP-PACK-11]: CheckpointReferencedError, nothing touched, where a committed
        sibling builds on the checkpoint at ``target`` (whose manifest is ``envelope``);
        looked for only where it can be a base (one LIST of the parent, each sibling's
        manifest read once per version)."""
        if may_be_base(envelope):
            refuse_if_referenced(self._url(target), what, store_referrers(self.store, target))

    def _url(self, key: str) -> str:
        return f"{self.store.url.rstrip('/')}/{key}"

    # -- a save ---------------------------------------------------------------------------
    def begin(self, target: str, token: str) -> str:
        """The save's prefix ``<target>/save-<token>`` ([SP-COMMIT-11]), claimed by its lease
        ([SP-COMMIT-16]): the first object below it, renewed until publish or abort."""
        if not _TOKEN.match(token):
            raise InvalidOptionError(f"save token {token!r}: 8 to 64 lower-case hex digits")
        staging = _join(target, SAVE_PREFIX + token)
        start_lease(self.store, staging, token, self.lease_s)
        return staging

    def prepare_manifest(self, staging: str, data: Union[bytes, Manifest]) -> Tuple[bytes, bool]:
        """What :meth:`publish` PUTs for the manifest ``data`` of the save at ``staging``:
        a :class:`Manifest` is encoded once, as the marker (:func:`encode_marker`), and PUT
        unchanged; bytes (array paths relative to the save prefix) have their paths moved
        below it at publish. ``(bytes, is_marker)``."""
        if isinstance(data, Manifest):
            return encode_marker(data, save_dir_of(staging)), True
        return bytes(data), False

    def write_manifest(self, staging: str, data: Union[bytes, Manifest]) -> None:
        """Keep the save's manifest until :meth:`publish` PUTs it as the marker: nothing is
        written below the save prefix (spec 1.3, [SP-COMMIT-11])."""
        self._pending[_join(staging)] = self.prepare_manifest(staging, data)

    def publish(
        self,
        staging: str,
        target: str,
        *,
        overwrite: Overwrite,
        manifest: Optional[bytes] = None,
        marker: Optional[bytes] = None,
    ) -> None:
        """Write the marker ``<target>/manifest.msgpack`` in one conditional PUT
        ([SP-COMMIT-12]), check that recovery did not take the save for dead meanwhile
        ([SP-COMMIT-16]), then delete what it replaced ([SP-COMMIT-14]). The marker is, in
        this order: ``marker`` (bytes encoded once with every array path below the save
        prefix, :func:`encode_marker`: checked, then PUT unchanged); ``manifest`` (bytes with
        array paths relative to the save prefix, moved below it here); what
        :meth:`write_manifest` kept; else the staged copy below the save prefix (writers
        before 1.3 wrote one).

        A PUT whose answer is lost (a dropped connection, a 5xx after the server applied it,
        a retry that gets 412 for this save's own marker) is settled by reading the marker
        back ([SP-COMMIT-17]): this save's bytes there mean it committed."""
        overwrite = check_overwrite(overwrite)
        save_dir = staging[len(_join(target)) + 1 :] if target else staging
        if not save_dir.startswith(SAVE_PREFIX) or "/" in save_dir:
            raise InvalidOptionError(f"{staging!r} is not a save prefix of {target!r}")
        pending = self._pending.pop(_join(staging), None)
        if marker is None and manifest is None and pending is not None:
            if pending[1]:
                marker = pending[0]
            else:
                manifest = pending[0]
        lease = stop_lease(self.store, staging)
        if lease is not None and lease.lost:
            raise self._reclaimed(staging)
        staged_key = _join(staging, MANIFEST_NAME)
        staged = manifest
        from_store = staged is None and marker is None  # a 1.2 writer's staged copy
        if from_store:
            try:
                staged = self.store.get(staged_key)
            except FileNotFoundError as e:
                if lease is not None and not _lease_intact(self.store, lease):
                    raise self._reclaimed(staging) from e
                raise IncompleteCheckpointError(
                    f"{self._url(staged_key)} is missing: the save wrote no manifest; nothing "
                    "was committed",
                    spec_id="SP-COMMIT-1",
                ) from e
        if marker is None:
            assert staged is not None
            marker = _rewrite_array_paths(staged, save_dir, self._url(staged_key))
        _check_marker(marker, save_dir, self._url(target))
        key = self._manifest_key(target)
        # A fresh commit on a conditional store: If-None-Match refuses any marker there.
        old = None if self.conditional and not overwrite else _read_with_version(self.store, key)
        if old is not None and not overwrite:
            raise CheckpointExistsError(
                f"{self._url(target)}: another save committed a checkpoint there while this one "
                "ran; this save was not committed (pass overwrite=True to replace)",
                spec_id="SP-COMMIT-12",
            )
        if old is not None:
            self._refuse_if_referenced(target, old[0], "replacing the checkpoint")
        # The objects the replaced marker names are listed while the PUT is in flight (a
        # committed save prefix never changes); deleted only once the PUT succeeded and the
        # lease is found intact ([SP-COMMIT-14], [SP-COMMIT-16]).
        side = ThreadPoolExecutor(1, thread_name_prefix="sp-commit") if old else None
        try:
            named = (
                side.submit(_named_objects, self.store, target, old[0], save_dir)
                if side is not None and old is not None
                else None
            )
            version = _commit_marker(
                self.store, key, marker, old, target, self.conditional, self.replace_if_match
            )
            if lease is not None and not _lease_intact(self.store, lease):
                _take_back(self.store, key, marker, version, old, target, self.replace_if_match)
                raise SaveFailedError(
                    f"{self._url(staging)}: recovery removed this save's lease while it "
                    "committed (the save was paused or stalled for longer than its lease); "
                    "its marker was taken back and nothing was committed",
                    spec_id="SP-COMMIT-16",
                )
            try:
                doomed = named.result() if named is not None else []
                if from_store:
                    doomed.append(staged_key)
                _delete_last_lease(self.store, doomed)
            except OSError as e:
                # Committed: what is left is recovery's ([SP-COMMIT-15]). Raising would make
                # the caller abort the save, deleting the checkpoint it just committed.
                log.warning(
                    "shardpoint: committed %s, but could not delete what it "
                    "replaced (%s); recovery removes it",
                    self._url(target),
                    e,
                )
        finally:
            if side is not None:
                side.shutdown(wait=False)

    def _reclaimed(self, staging: str) -> SaveFailedError:
        return SaveFailedError(
            f"{self._url(staging)}: recovery reclaimed this save's lease (the save was paused "
            "or stalled for longer than it); nothing was committed, the previous checkpoint "
            "is intact",
            spec_id="SP-COMMIT-16",
        )

    def abort(self, staging: str) -> None:
        """Delete everything below this save's own prefix (its lease last), unless a marker
        names it: a save whose commit outcome was misjudged never deletes committed data
        ([SP-COMMIT-17]). The target is never touched."""
        self._pending.pop(_join(staging), None)
        stop_lease(self.store, staging)
        target, _, name = _join(staging).rpartition("/")
        refs = self._referenced(target) if name.startswith(SAVE_PREFIX) else set()
        if name in refs or "*" in refs:
            log.warning(
                "shardpoint: %s is named by the marker at %s; not removed",
                self._url(staging),
                self._url(target),
            )
            return
        _delete_last_lease(self.store, [i.key for i in self.store.list(_join(staging) + "/")])

    # -- retention and recovery -----------------------------------------------------------
    def remove(self, target: str) -> bool:
        """Delete a committed checkpoint: the marker first (the target is then not a
        checkpoint for any reader), then the objects it named. Live saves' prefixes are not
        named by it and stay. Without a marker: False where nothing or only save prefixes
        are there (as on files, where a save stages beside its target), and
        CheckpointNotFoundError, deleting nothing, where other objects are."""
        key = self._manifest_key(target)
        old = _read_with_version(self.store, key)
        if old is None:
            foreign = self._foreign(target)
            if foreign:
                raise CheckpointNotFoundError(
                    f"{self._url(target)} is not a committed checkpoint (no {MANIFEST_NAME}; "
                    f"it holds {len(foreign)} other object(s), first {foreign[0]!r}); "
                    "retention removes checkpoints only: nothing removed",
                    spec_id="SP-COMMIT-3",
                )
            return False  # gone already, or only a save's own prefix
        self._refuse_if_referenced(target, old[0], "removing the checkpoint")
        self.store.delete([key])
        _delete_arrays(self.store, target, old[0])
        return True

    def leftovers(self, directory: str, *, now: Optional[float] = None) -> list[Any]:
        """Save prefixes below ``directory`` that this protocol wrote (their lease names their
        token, [SP-COMMIT-16]) and that no committed marker names: crashed saves, saves that
        lost a race, replaced checkpoints whose deletion was cut short, and saves still
        running, whose lease is live (``in_use`` True). A prefix that merely looks like a save
        prefix (a user's ``save-20240101/``) or one written before spec 1.3 is not listed:
        nothing on the store says it is ours."""
        prefix = _join(directory) + "/" if _join(directory) else ""
        groups: Dict[str, list[Any]] = {}
        for info in self.store.list(prefix):
            parts = info.key.split("/")
            for i, part in enumerate(parts[:-1]):
                if part.startswith(SAVE_PREFIX) and _TOKEN.match(part[len(SAVE_PREFIX) :]):
                    groups.setdefault("/".join(parts[: i + 1]), []).append(info)
                    break
        out = []
        referenced: Dict[str, set[Any]] = {}
        now = time.time() if now is None else now
        for save, infos in sorted(groups.items()):
            target, _, name = save.rpartition("/")
            if not any(i.key == f"{save}/{LEASE_NAME}" for i in infos):
                continue
            if target not in referenced:
                referenced[target] = self._referenced(target)
            if name in referenced[target] or "*" in referenced[target]:
                continue
            token = name[len(SAVE_PREFIX) :]
            lease = read_lease(self.store, save, token, now)
            if lease is None:
                continue
            newest = max(i.mtime for i in infos)
            has_manifest = any(i.key == f"{save}/{MANIFEST_NAME}" for i in infos)
            out.append(
                Leftover(
                    path=save,
                    target=target,
                    kind="tmp",
                    token=token,
                    has_manifest=has_manifest,
                    newest_mtime=newest,
                    in_use=lease.live,
                )
            )
        return out

    def _referenced(self, target: str) -> set[Any]:
        """The save prefixes the marker of ``target`` names (empty where there is none)."""
        try:
            data = self.store.get(self._manifest_key(target))
            return {d.split("/", 1)[0] for d in _array_dirs(data)[0]}
        except FileNotFoundError:
            return set()
        except Exception:  # noqa: BLE001 - an unreadable marker: treat every prefix as named
            return {"*"}

    def restore(self, leftover: str, target: str) -> bool:
        """Object stores have nothing to restore: a replaced checkpoint's marker is gone the
        moment the new one lands, and the previous one is never moved aside. As on every
        store, a committed ``target`` is never replaced (CheckpointExistsError)."""
        if self.state(target) == "committed":
            raise CheckpointExistsError(
                f"cannot restore {self._url(leftover)}: "
                f"{self._url(target)} holds a committed checkpoint; "
                "nothing was moved",
                spec_id="SP-COMMIT-6",
            )
        raise InvalidOptionError(
            f"{leftover!r}: nothing to restore on an object store; a "
            "save prefix that no marker names is removed by discard()"
        )

    def discard(self, leftover: str, *, now: Optional[float] = None) -> bool:
        """Delete a save prefix this protocol wrote that no marker names, once its save is
        dead: its lease is first reclaimed (so that save can no longer renew or commit), the
        marker is read again, and only if it still does not name the prefix is the rest
        deleted ([SP-COMMIT-15], [SP-COMMIT-16]). False, deleting nothing, when the lease is
        live or was renewed meanwhile (a running save) or the prefix is not ours. ``now``:
        the time to judge the lease's age at (tests: a time past its expiry)."""
        target, _, name = _join(leftover).rpartition("/")
        if not name.startswith(SAVE_PREFIX) or not _TOKEN.match(name[len(SAVE_PREFIX) :]):
            raise InvalidOptionError(f"{leftover!r} is not a save prefix")
        token = name[len(SAVE_PREFIX) :]

        def named() -> bool:
            refs = self._referenced(target)
            return name in refs or "*" in refs

        if named():
            raise CheckpointExistsError(
                f"{self._url(leftover)} holds the data of the committed "
                f"checkpoint {self._url(target)}; not removed",
                spec_id="SP-COMMIT-15",
            )
        lease = read_lease(self.store, _join(leftover), token, now)
        if (
            lease is None
            or lease.live
            or not reclaim_lease(self.store, _join(leftover), token, lease)
        ):
            return False
        if named():  # its save committed between our two reads: whole, and kept
            return False
        _delete_last_lease(self.store, [i.key for i in self.store.list(_join(leftover) + "/")])
        return True


if TYPE_CHECKING:
    # static checks that the class satisfies the protocol it claims (runtime_checkable
    # compares method names only); mypy fails here on a regression
    from shardpoint_core.commit.base import Committer

    def _is_committer_objectstorecommitter(x: ObjectStoreCommitter) -> Committer:
        return x
