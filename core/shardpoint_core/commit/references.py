"""Who builds on a checkpoint ([SP-PACK-11]): an incremental packed checkpoint names its
*bases*, sibling checkpoints whose data objects its records point into ([SP-PACK-9]). The
committer owns those references: it refuses to delete or replace a checkpoint that a
committed sibling names (:func:`refuse_if_referenced`), and a manager's retention keeps
every base of what it keeps (:func:`bases_closure`), so no live checkpoint loses a byte.

A base is always a sibling (one path component beside the checkpoint), so the checkpoints
that may name ``<parent>/<name>`` are the committed checkpoints of ``<parent>``: their
manifests are read (the envelope and body decoded, nothing else) and their bases listed.
What a manifest names is kept per manifest version (its size, time and version tag: a
committed manifest never changes in place), so a manager's retention, which asks again at
every save, reads each manifest once and then only lists the parent.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Iterable, List, Optional, Set

import msgpack

from shardpoint_core.format.errors import CheckpointReferencedError
from shardpoint_core.format.spec import MANIFEST_NAME
from shardpoint_core.stores import location
from shardpoint_core.stores.registry import is_local


def bases_in(envelope: bytes) -> List[str]:
    """The base names a manifest's packed index lists (none for any other manifest, and
    for bytes that do not decode: a damaged manifest names nothing it could be trusted on)."""
    try:
        env = msgpack.unpackb(envelope, raw=False, strict_map_key=False)
        body = msgpack.unpackb(env["body"], raw=False, strict_map_key=False)
        bases = body.get("packed", {}).get("bases", [])
        return [b[0] for b in bases if isinstance(b, list) and b and isinstance(b[0], str)]
    except (ValueError, KeyError, TypeError, AttributeError, msgpack.ExtraData):
        return []


def may_be_base(envelope: bytes) -> bool:
    """Whether the checkpoint of this manifest can be a base at all: writers name a base's
    chunks only where its index holds their hashes ([SP-PACK-9], [SP-PACK-10]), so one
    without (every checkpoint of the per-array layout, a packed one saved without hashes)
    has no referrers and a deletion need not look for them. True where the bytes do not
    decode (nothing is assumed of a damaged manifest)."""
    try:
        env = msgpack.unpackb(envelope, raw=False, strict_map_key=False)
        body = msgpack.unpackb(env["body"], raw=False, strict_map_key=False)
        packed = body.get("packed")
        return isinstance(packed, dict) and "hashes" in packed
    except (ValueError, KeyError, TypeError, AttributeError, msgpack.ExtraData):
        return True


def target_may_be_base(path: str) -> bool:
    """:func:`may_be_base` of the committed checkpoint at ``path`` (False: none there)."""
    store, prefix = location.locate(path).pair()
    try:
        raw = store.get(f"{prefix}/{MANIFEST_NAME}" if prefix else MANIFEST_NAME)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return False
    return may_be_base(raw)


def _split(path: str) -> tuple[str, str]:
    if is_local(path):
        p = os.path.abspath(os.fspath(path))
        return os.path.dirname(p), os.path.basename(p)
    parent, _s, name = os.fspath(path).rstrip("/").rpartition("/")
    return parent, name


def _child(parent: str, name: str) -> str:
    return os.path.join(parent, name) if is_local(parent) else f"{parent}/{name}"


_KEPT = 4096
_lock = threading.Lock()
_known: dict[Any, List[str]] = {}  # (where, size, mtime, version) -> the bases it names


def _remembered(tag: Any, read: Callable[[], bytes]) -> List[str]:
    """The bases of the manifest whose version is ``tag`` (``read()``: its bytes), read
    once per version."""
    with _lock:
        got = _known.get(tag)
    if got is not None:
        return got
    try:
        got = bases_in(read())
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return []
    with _lock:
        if len(_known) >= _KEPT:
            _known.pop(next(iter(_known)))
        _known[tag] = got
    return got


def read_bases(path: str) -> List[str]:
    """The bases of the committed checkpoint at ``path`` (none where there is none)."""
    store, prefix = location.locate(path).pair()
    key = f"{prefix}/{MANIFEST_NAME}" if prefix else MANIFEST_NAME
    try:
        info = store.head(key)
    except (FileNotFoundError, NotADirectoryError):
        info = None
    if info is None:
        return []
    tag = (store.url, key, info.size, info.mtime, info.version)
    return _remembered(tag, lambda: store.get(key))


def siblings(path: str) -> List[str]:
    """The names of the committed checkpoints beside ``path`` (not ``path`` itself): on
    files the directories of its parent holding a manifest; on object stores the prefixes
    one level below the parent holding a marker."""
    parent, me = _split(path)
    out = []
    if is_local(path):
        try:
            names = os.listdir(parent)
        except FileNotFoundError:
            return []
        for n in names:
            if n != me and os.path.isfile(os.path.join(parent, n, MANIFEST_NAME)):
                out.append(n)
        return sorted(out)
    store, prefix = location.locate(parent).pair()
    base = f"{prefix}/" if prefix else ""
    for info in store.list(base):
        rest = info.key[len(base) :]
        name, _s, tail = rest.partition("/")
        if tail == MANIFEST_NAME and name != me:
            out.append(name)
    return sorted(set(out))


def referrers(path: str, read: Callable[[str], List[str]] = read_bases) -> List[str]:
    """The committed checkpoints beside ``path`` that name it as a base."""
    parent, me = _split(path)
    return [n for n in siblings(path) if me in read(_child(parent, n))]


def store_referrers(store: Any, key: str) -> List[str]:
    """:func:`referrers` of the checkpoint at ``key`` of an object ``store`` (the committer's
    own store: its siblings are the prefixes one level below the parent holding a marker)."""
    parent, _s, me = key.strip("/").rpartition("/")
    base = f"{parent}/" if parent else ""
    found = {}
    for info in store.list(base):
        name, _s, tail = info.key[len(base) :].partition("/")
        if tail == MANIFEST_NAME and name != me:
            found[name] = info
    out = []
    for n, info in sorted(found.items()):
        tag = (store.url, info.key, info.size, info.mtime, info.version)
        if me in _remembered(tag, _getter(store, info.key)):
            out.append(n)
    return out


def _getter(store: Any, key: str) -> Callable[[], bytes]:
    def get() -> bytes:
        got: bytes = store.get(key)
        return got

    return get


def refuse_if_referenced(path: str, what: str, users: Optional[List[str]] = None) -> None:
    """CheckpointReferencedError [SP-PACK-11] where a committed sibling builds on ``path``
    (``what``: the deletion refused, for the message; ``users``: the referrers, found by
    the caller); nothing is touched. A checkpoint that cannot be a base (:func:`may_be_base`)
    is not looked for."""
    if users is None:
        users = referrers(path) if target_may_be_base(path) else []
    if users:
        raise CheckpointReferencedError(
            f"{what} {path!r}: refused, the committed checkpoint(s) {users[:5]} beside it "
            "build on it (its data objects hold their unchanged chunks); remove them first, "
            "nothing was deleted",
            spec_id="SP-PACK-11",
        )


def bases_closure(
    parent: str, names: Iterable[str], read: Callable[[str], List[str]] = read_bases
) -> Set[str]:
    """Every checkpoint of ``parent`` that the checkpoints ``names`` build on, directly or
    through their bases (a base's own bases too, so a kept base stays whole and readable)."""
    seen: Set[str] = set()
    todo = list(names)
    while todo:
        for b in read(_child(parent, todo.pop())):
            if b not in seen:
                seen.add(b)
                todo.append(b)
    return seen


def parent_of(path: str) -> str:
    """The directory or prefix holding ``path``."""
    return _split(path)[0]


def name_of(path: str) -> Optional[str]:
    """The last component of ``path``."""
    return _split(path)[1] or None


__all__ = [
    "bases_in",
    "read_bases",
    "siblings",
    "referrers",
    "may_be_base",
    "store_referrers",
    "refuse_if_referenced",
    "bases_closure",
    "parent_of",
    "name_of",
]
