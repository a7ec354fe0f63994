"""The commit protocol for stores without rename (S3 and alike): [SP-COMMIT-10] .. [SP-COMMIT-15].

What S3 makes atomic: one PUT (or multipart completion) of one object, optionally conditional
(``If-None-Match: *``, ``If-Match: <etag>``). Nothing else: no rename, no transaction over
several objects, no atomic delete of a prefix. So a save never writes where a committed
checkpoint's bytes are; the one atomic step is the PUT of the manifest:

    <target>/save-<token>/tensors/...   every chunk and zarr.json of the save with <token>
    <target>/save-<token>/manifest.msgpack   the save's own manifest (staging; array paths
                                             relative to the save prefix)
    <target>/manifest.msgpack           the commit marker: the manifest, its array paths
                                        rewritten to lie below save-<token>/

A crash before the marker's PUT leaves the previous checkpoint whole (its bytes are under
another prefix) and an unreferenced ``save-<token>/`` (a leftover); after it, the new one. A
reader sees one manifest or the other, and each names only its own save's objects, so no mix
is possible. A fresh target is claimed with ``If-None-Match: *`` (of two saves exactly one
wins), a replacement with ``If-Match`` on the manifest the save checked (a save that raced
another replacement loses instead of orphaning it). The replaced checkpoint's objects are
deleted after the new marker is in place.

Call order and ranks as in :mod:`shardpoint_core.commit.base`. Targets, staging locations
and leftovers are keys (``/``-separated, no leading ``/``) of the committer's store.

Example::

    c = ObjectStoreCommitter(S3Store.from_url("s3://bucket/run"))
    staging = c.begin("step_5", token)        # every rank writes below it
    c.publish(staging, "step_5", overwrite=False)
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Iterable, List, Optional

import msgpack

from shardpoint_core.errors import (CheckpointExistsError, CheckpointNotFoundError,
                                    CorruptCheckpointError, IncompleteCheckpointError,
                                    InvalidOptionError, StoreNotFoundError)
from shardpoint_core.manifest import decode_manifest
from shardpoint_core.storage import MANIFEST_NAME, Leftover

log = logging.getLogger("shardpoint")
SAVE_PREFIX = "save-"
_TOKEN = re.compile(r"[0-9a-f]{8,64}\Z")
_MAX_MANIFEST = 1 << 30


def _join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


def _rewrite_array_paths(envelope: bytes, save_dir: str, where: str) -> bytes:
    """The staged manifest with every array path moved below ``save_dir`` ([SP-COMMIT-11]).

    Works on the msgpack map itself, not on a decoded :class:`Manifest`, so that fields this
    implementation does not know (ignorable ones, extensions) travel unchanged."""
    try:
        env = msgpack.unpackb(envelope, raw=False, strict_map_key=False)
        body = env["body"]
        if hashlib.sha256(body).digest() != env["sha256"]:
            raise ValueError("sha256 mismatch")
        m = msgpack.unpackb(body, raw=False, strict_map_key=False)
        for entry in m["tensors"].values():
            entry["array"] = f"{save_dir}/{entry['array']}"
    except (ValueError, KeyError, TypeError, msgpack.ExtraData) as e:
        raise CorruptCheckpointError(f"staged manifest {where} is not a valid manifest ({e}); "
                                     "nothing was committed", spec_id="SP-MAN-1") from e
    new_body = msgpack.packb(m, use_bin_type=True)
    return msgpack.packb({"sha256": hashlib.sha256(new_body).digest(), "body": new_body},
                         use_bin_type=True)


def _array_dirs(envelope: bytes) -> List[str]:
    """The array paths a committed manifest names (what removing it must delete)."""
    env = msgpack.unpackb(envelope, raw=False, strict_map_key=False)
    m = msgpack.unpackb(env["body"], raw=False, strict_map_key=False)
    return [e["array"] for e in m.get("tensors", {}).values()]


class ObjectStoreCommitter:
    """Publishes checkpoints in one :class:`~shardpoint_core.store.base.ByteStore` that has no
    rename, with the manifest as the single atomic commit marker ([SP-COMMIT-10])."""

    def __init__(self, store) -> None:
        self.store = store
        self.conditional = bool(store.capabilities.conditional_put)
        self.replace_if_match = bool(getattr(store.capabilities, "conditional_replace", False))

    # -- what is at a target ------------------------------------------------------------
    def _manifest_key(self, target: str) -> str:
        return _join(target, MANIFEST_NAME)

    def _foreign(self, target: str, listing: Optional[Iterable] = None) -> List[str]:
        """Objects under ``target/`` (``listing``: the store's list of it, when the caller
        started it) that are neither the marker nor below a save prefix or a committed
        array path (someone else's: never replaced, never deleted)."""
        out = []
        if listing is None:
            listing = self.store.list(_join(target) + "/" if target else "")
        for info in listing:
            rel = info.key[len(_join(target)) + 1:] if target else info.key
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

    def check_target(self, target: str, overwrite: bool) -> None:
        """Refuse a committed checkpoint without ``overwrite`` ([SP-COMMIT-5]) and, with or
        without it, objects under the target that this protocol did not write
        ([SP-COMMIT-13]): nothing deletes what it did not create. The marker's HEAD and the
        first page of the target's listing are in flight together (one round trip)."""
        with ThreadPoolExecutor(1, thread_name_prefix="sp-commit") as side:
            marker = side.submit(self.store.head, self._manifest_key(target))
            listing = iter(self.store.list(_join(target) + "/" if target else ""))
            first = list(itertools.islice(listing, 1))      # fetches the first page
            committed = marker.result() is not None
        if committed and not overwrite:
            raise CheckpointExistsError(
                f"{self._url(target)} holds a committed checkpoint; pass overwrite=True to "
                "replace it, or save to another path", spec_id="SP-COMMIT-5")
        if not committed:
            foreign = self._foreign(target, itertools.chain(first, listing))
            if foreign:
                raise CheckpointExistsError(
                    f"{self._url(target)} holds {len(foreign)} object(s) that are not a "
                    f"shardpoint checkpoint (first: {foreign[0]!r}); a save never replaces or "
                    "deletes them: choose another path or remove them yourself",
                    spec_id="SP-COMMIT-13")

    def _url(self, key: str) -> str:
        return f"{self.store.url.rstrip('/')}/{key}"

    # -- a save ---------------------------------------------------------------------------
    def begin(self, target: str, token: str) -> str:
        """The save's prefix ``<target>/save-<token>`` ([SP-COMMIT-11]). Nothing is written:
        the prefix exists once a rank writes below it."""
        if not _TOKEN.match(token):
            raise InvalidOptionError(f"save token {token!r}: 8 to 64 lower-case hex digits")
        return _join(target, SAVE_PREFIX + token)

    def publish(self, staging: str, target: str, *, overwrite: bool,
                manifest: Optional[bytes] = None) -> None:
        """Write the marker ``<target>/manifest.msgpack`` in one conditional PUT
        ([SP-COMMIT-12]), then delete what it replaced and the staged manifest copy.
        ``manifest``: the staged copy's bytes, when the caller that just wrote them has them
        (not read back). Without ``overwrite`` on a store with conditional writes, the PUT's
        ``If-None-Match`` is the only check needed: no read of the marker before it."""
        save_dir = staging[len(_join(target)) + 1:] if target else staging
        if not save_dir.startswith(SAVE_PREFIX) or "/" in save_dir:
            raise InvalidOptionError(f"{staging!r} is not a save prefix of {target!r}")
        staged_key = _join(staging, MANIFEST_NAME)
        staged = manifest
        if staged is None:
            try:
                staged = self.store.get(staged_key)
            except FileNotFoundError as e:
                raise IncompleteCheckpointError(
                    f"{self._url(staged_key)} is missing: the save wrote no manifest; nothing "
                    "was committed", spec_id="SP-COMMIT-1") from e
        marker = _rewrite_array_paths(staged, save_dir, self._url(staged_key))
        decode_manifest(marker)    # every reader check passes before anything is visible
        key = self._manifest_key(target)
        # A fresh commit on a conditional store: If-None-Match refuses any marker there.
        old = None if self.conditional and not overwrite else self._read_with_version(key)
        if old is not None and not overwrite:
            raise CheckpointExistsError(
                f"{self._url(target)}: another save committed a checkpoint there while this one "
                "ran; this save was not committed (pass overwrite=True to replace)",
                spec_id="SP-COMMIT-12")
        # The objects the replaced marker names are listed while the PUT is in flight (a
        # committed save prefix never changes); deleted only once the PUT succeeded, with
        # the staged copy, in one delete ([SP-COMMIT-14]).
        side = ThreadPoolExecutor(1, thread_name_prefix="sp-commit") if old else None
        try:
            named = side.submit(self._named_objects, target, old[0], save_dir) if side \
                else None
            self._put_marker(key, marker, old, target)
            try:
                doomed = named.result() if named is not None else []
                self.store.delete(doomed + [staged_key])
            except OSError as e:
                # Committed: what is left is recovery's ([SP-COMMIT-15]). Raising would make
                # the caller abort the save, deleting the checkpoint it just committed.
                log.warning("shardpoint: committed %s, but could not delete what it "
                            "replaced (%s); recovery removes it", self._url(target), e)
        finally:
            if side is not None:
                side.shutdown(wait=False)

    def _put_marker(self, key: str, marker: bytes, old: Optional[tuple], target: str) -> None:
        """The one PUT that commits ([SP-COMMIT-12]), conditional where the store can."""
        try:
            if not self.conditional:     # [SP-COMMIT-12]: the last PUT wins, never a mix
                self.store.put(key, marker)
            elif old is None:
                self.store.put(key, marker, if_absent=True)
            elif self.replace_if_match:
                self.store.put(key, marker, if_match=old[1])
            else:                        # no If-Match: a replacement race is the caller's
                self.store.put(key, marker)
        except FileExistsError as e:
            raise CheckpointExistsError(
                f"{self._url(target)}: another save committed or replaced the checkpoint there "
                "while this one ran (its conditional PUT won); this save was not committed",
                spec_id="SP-COMMIT-12") from e
        except FileNotFoundError as e:     # If-Match on an object deleted meanwhile
            raise CheckpointExistsError(
                f"{self._url(target)}: the checkpoint this save was to replace was removed "
                "while it ran; this save was not committed", spec_id="SP-COMMIT-12") from e

    def _read_with_version(self, key: str) -> Optional[tuple]:
        """(bytes, version) of ``key``, or None; the version is the one the bytes are of:
        one GET where the store gives the version with the bytes (``get_versioned``), else a
        HEAD before and after the GET."""
        getv = getattr(self.store, "get_versioned", None)
        if getv is not None:
            try:        # at most one byte over the cap, so a bigger one is seen
                data, info = getv(key, _MAX_MANIFEST + 1)
            except StoreNotFoundError:
                raise
            except FileNotFoundError:
                return None
            if info.size > _MAX_MANIFEST or len(data) > _MAX_MANIFEST:
                raise CorruptCheckpointError(f"{self._url(key)} is {info.size} bytes, over "
                                             "1 GiB", spec_id="SP-SEC-2")
            return data, info.version
        info = self.store.head(key)
        if info is None:
            return None
        if info.size > _MAX_MANIFEST:
            raise CorruptCheckpointError(f"{self._url(key)} is {info.size} bytes, over 1 GiB",
                                         spec_id="SP-SEC-2")
        data = self.store.get(key)
        again = self.store.head(key)
        if again is None or again.version != info.version:
            raise CheckpointExistsError(f"{self._url(key)} changed while it was read: another "
                                        "save is committing there", spec_id="SP-COMMIT-12")
        return data, info.version

    def _delete_arrays(self, target: str, envelope: bytes, keep: str = "") -> None:
        """Delete the objects a replaced or removed manifest named ([SP-COMMIT-14])."""
        self.store.delete(self._named_objects(target, envelope, keep))

    def _named_objects(self, target: str, envelope: bytes, keep: str = "") -> List[str]:
        """The objects below the save prefixes (or plain array paths) a manifest names,
        ``keep`` excepted."""
        try:
            dirs = _array_dirs(envelope)
        except Exception:   # noqa: BLE001 - a damaged old marker: its objects stay, recover
            return []       # finds unreferenced save prefixes; nothing else is ours to guess
        prefixes = set()
        for d in dirs:
            top = d.split("/", 1)[0]
            if top.startswith(SAVE_PREFIX) and top != keep:
                prefixes.add(_join(target, top) + "/")
            elif not top.startswith(SAVE_PREFIX):
                prefixes.add(_join(target, d) + "/")
        return [i.key for p in sorted(prefixes) for i in self.store.list(p)]

    def abort(self, staging: str) -> None:
        """Delete everything below the save's prefix; the target is never touched."""
        self.store.delete([i.key for i in self.store.list(_join(staging) + "/")])

    # -- retention and recovery -----------------------------------------------------------
    def remove(self, target: str) -> bool:
        """Delete a committed checkpoint: the marker first (the target is then not a
        checkpoint for any reader), then the objects it named. Live saves' prefixes are not
        named by it and stay."""
        key = self._manifest_key(target)
        old = self._read_with_version(key)
        if old is None:
            if self.state(target) == "incomplete":
                raise CheckpointNotFoundError(f"{self._url(target)} is not a committed "
                                              "checkpoint; nothing removed",
                                              spec_id="SP-COMMIT-3")
            return False            # gone already
        self.store.delete([key])
        self._delete_arrays(target, old[0])
        return True

    def leftovers(self, directory: str) -> list:
        """Save prefixes below ``directory`` that no committed marker names: crashed saves,
        saves that lost a race, replaced checkpoints whose deletion was cut short, and (when
        recently written to) saves still running: ``in_use`` is None, since nothing on the store
        tells them apart; recovery skips those modified within its minimum age
        ([SP-COMMIT-15])."""
        prefix = _join(directory) + "/" if _join(directory) else ""
        groups: Dict[str, list] = {}
        for info in self.store.list(prefix):
            parts = info.key.split("/")
            for i, part in enumerate(parts[:-1]):
                if part.startswith(SAVE_PREFIX) and _TOKEN.match(part[len(SAVE_PREFIX):]):
                    groups.setdefault("/".join(parts[:i + 1]), []).append(info)
                    break
        out = []
        referenced: Dict[str, set] = {}
        for save, infos in sorted(groups.items()):
            target, _, name = save.rpartition("/")
            if target not in referenced:
                referenced[target] = self._referenced(target)
            if name in referenced[target] or "*" in referenced[target]:
                continue
            newest = max(i.mtime for i in infos)
            has_manifest = any(i.key == f"{save}/{MANIFEST_NAME}" for i in infos)
            out.append(Leftover(path=save, target=target, kind="tmp",
                                token=name[len(SAVE_PREFIX):], has_manifest=has_manifest,
                                newest_mtime=newest, in_use=None))
        return out

    def _referenced(self, target: str) -> set:
        """The save prefixes the marker of ``target`` names (empty where there is none)."""
        try:
            data = self.store.get(self._manifest_key(target))
            return {d.split("/", 1)[0] for d in _array_dirs(data)}
        except FileNotFoundError:
            return set()
        except Exception:   # noqa: BLE001 - an unreadable marker: treat every prefix as named
            return {"*"}

    def restore(self, leftover: str, target: str) -> bool:
        """Object stores have nothing to restore: a replaced checkpoint's marker is gone the
        moment the new one lands, and the previous one is never moved aside."""
        raise InvalidOptionError(f"{leftover!r}: nothing to restore on an object store; a "
                                 "save prefix that no marker names is removed by discard()")

    def discard(self, leftover: str) -> bool:
        """Delete an unreferenced save prefix (never one a marker names). The caller (recovery)
        decides it is not a running save ([SP-COMMIT-15])."""
        target, _, name = _join(leftover).rpartition("/")
        if not name.startswith(SAVE_PREFIX):
            raise InvalidOptionError(f"{leftover!r} is not a save prefix")
        refs = self._referenced(target)
        if name in refs or "*" in refs:
            raise CheckpointExistsError(f"{self._url(leftover)} holds the data of the committed "
                                        f"checkpoint {self._url(target)}; not removed",
                                        spec_id="SP-COMMIT-15")
        self.abort(leftover)
        return True
