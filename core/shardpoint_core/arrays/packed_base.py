"""Incremental packed checkpoints (format 1.4, spec/format.md section 13, [SP-PACK-9] to
[SP-PACK-11]): a save names *bases*, sibling checkpoints (one path component beside it, in
the same parent directory or prefix) whose data objects its records point into instead of
rewriting unchanged chunks.

- :func:`sibling_path`: where a base named ``name`` lies beside a checkpoint, on files and
  object stores alike (the name is one safe component: nothing outside the parent is
  reachable, and a moved parent keeps every reference working).
- :func:`manifest_identity`: a checkpoint's identity as a base, the sha256 of its manifest
  body (the envelope's own field: one read, no decoding of the body).
- :class:`Base`: what a writer compares its chunks against: the base's index, each chunk's
  owner (the base itself or one of its own bases: references are flattened, never chained),
  looked up by array path.
- :class:`BasedStore`: the store a reader's chunk view reads through: keys of the form
  ``<prefix>/../<base>/<path>`` go to the base's location, after its identity was checked
  once per load ([SP-PACK-9]: a missing or replaced base is an error naming the base, the
  tensor and the rule, never other bytes).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, Iterable, Iterator, Optional, Tuple

import msgpack

from shardpoint_core.format.errors import CorruptCheckpointError
from shardpoint_core.format.packed import (
    BASE_PREFIX,
    IDENTITY_BYTES,
    PackedArray,
    PackedIndex,
    chunk_hash,
)
from shardpoint_core.format.spec import MANIFEST_NAME
from shardpoint_core.stores import location
from shardpoint_core.stores.base import ByteStore, ObjectInfo
from shardpoint_core.stores.registry import is_local

#: one owner of a referenced chunk: (base name, identity, object path in it, object size)
Owner = Tuple[str, bytes, str, int]


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


def sibling_path(path: str, name: str) -> str:
    """The checkpoint ``name`` beside ``path`` (same parent directory or prefix)."""
    if is_local(path):
        return os.path.join(os.path.dirname(os.path.abspath(os.fspath(path))), name)
    return os.fspath(path).rstrip("/").rpartition("/")[0] + "/" + name


def base_name(path: str) -> str:
    """The last component of a checkpoint path (its name as a base)."""
    if is_local(path):
        return os.path.basename(os.path.abspath(os.fspath(path)))
    return os.fspath(path).rstrip("/").rpartition("/")[2]


def identity_of(envelope: bytes) -> Optional[bytes]:
    """The identity recorded in a manifest's envelope (its body's sha256), None where the
    bytes are no envelope."""
    try:
        env = msgpack.unpackb(envelope, raw=False, strict_map_key=False)
        got = env.get("sha256") if isinstance(env, dict) else None
    except (ValueError, msgpack.ExtraData, TypeError):
        return None
    return got if isinstance(got, bytes) and len(got) == IDENTITY_BYTES else None


def manifest_identity(path: str) -> Optional[bytes]:
    """The identity of the committed checkpoint at ``path``; None where there is none."""
    store, prefix = location.locate(path).pair()
    try:
        raw = store.get(_join(prefix, MANIFEST_NAME))
    except FileNotFoundError:
        return None
    return identity_of(raw)


def _base_error(key: str, base: str, where: str, msg: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"tensor {key!r}: base {base!r} ({where}): {msg}", spec_id="SP-PACK-9"
    )


# ------------------------------------------------------------------------------ writing
class Base:
    """The committed checkpoint an incremental save builds on: ``name`` (beside the target),
    ``identity``, its decoded ``index`` and tensor entries by array path. :meth:`candidates`
    gives, for one array of the new save, each chunk's owner and record where the base has a
    comparable chunk (same shape, dtype, chunk shape and inner chunks, with a hash)."""

    def __init__(self, name: str, identity: bytes, manifest: Any) -> None:
        from shardpoint_core.format.manifest import array_path_for

        self.name, self.identity, self.manifest = name, identity, manifest
        self.index: Optional[PackedIndex] = manifest.packed
        self.by_path: Dict[str, Any] = {}
        for e in manifest.tensors.values():
            self.by_path[array_path_for(e.key)] = e
        self.hashed = self.index is not None and self.index.hashes is not None
        owners = []
        if self.index is not None:
            for i, (p, s) in enumerate(self.index.objects):
                b = self.index.base_of(i)
                who = (name, identity) if b is None else self.index.bases[b]
                owners.append((who[0], who[1], p, s))
        self.owners: list[Owner] = owners

    def candidates(
        self, array_path: str, shape: Any, dtype: str, chunk: Any, inner: Any
    ) -> Optional[PackedArray]:
        """The base's part for ``array_path`` when its chunks are comparable, else None."""
        e = self.by_path.get(array_path)
        if e is None or not self.hashed or e.packed is None:
            return None
        same = (
            tuple(e.shape) == tuple(shape)
            and e.dtype == dtype
            and tuple(e.chunk_shape) == tuple(chunk)
            and (None if e.packed.inner is None else tuple(e.packed.inner))
            == (None if inner is None else tuple(inner))
        )
        return e.packed if same else None


def load_base(path: str, read_manifest: Any, name: Optional[str] = None) -> Base:
    """The :class:`Base` at ``path`` (``read_manifest(path) -> bytes``: the backend's, so the
    manifest's checks are the reader's)."""
    from shardpoint_core.format.manifest import decode_manifest

    raw = read_manifest(path)
    ident = identity_of(raw)
    assert ident is not None, "a manifest that decodes has an identity"
    return Base(name or base_name(path), ident, decode_manifest(raw))


# ------------------------------------------------------------------------------ reading
class BasedStore:
    """A byte store over a checkpoint's location (``store`` at ``prefix``, the checkpoint
    ``root``) that also reaches its bases: ``<prefix>/../<name>/<path>`` is ``<path>`` of the
    base ``name`` beside ``root``, whose identity is checked against ``bases`` before its
    first byte is read (once per backend: ``checked``). Everything else goes to ``store``."""

    def __init__(
        self,
        store: ByteStore,
        prefix: str,
        root: str,
        bases: Iterable[Tuple[str, bytes]],
        key: str,
        checked: Dict[str, Any],
    ) -> None:
        self.inner, self.prefix, self.root, self.key = store, prefix, root, key
        self.bases = dict(bases)
        self.checked = checked
        self.capabilities = store.capabilities
        self.url = store.url
        self._lock = threading.Lock()
        self._marker = _join(prefix, BASE_PREFIX)

    def __getattr__(self, name: str) -> Any:  # ``root`` and other attributes of the store
        return getattr(self.inner, name)

    def _route(self, key: str) -> Tuple[Any, str]:
        if not key.startswith(self._marker):
            return self.inner, key
        name, _s, rest = key[len(self._marker) :].partition("/")
        return self.base(name), rest

    def base(self, name: str) -> Tuple[Any, str]:
        """(store, key prefix) of base ``name``: its key below it is ``prefix/path``. Its
        identity is checked first; a missing or replaced base raises CorruptCheckpointError
        [SP-PACK-9] naming the base, the tensor and the manifest's path."""
        if name not in self.bases:
            raise _base_error(self.key, name, "manifest.msgpack", "the index names no such base")
        where = sibling_path(self.root, name)
        memo = f"\0base:{where}:{self.bases[name].hex()}"
        got = self.checked.get(memo)
        if got is None:
            ident = manifest_identity(where)
            if ident is None:
                raise _base_error(
                    self.key,
                    name,
                    f"{where}/{MANIFEST_NAME}",
                    "the base checkpoint is missing (deleted, or not moved with this one); "
                    "its chunks cannot be read",
                )
            if ident != self.bases[name]:
                raise _base_error(
                    self.key,
                    name,
                    f"{where}/{MANIFEST_NAME}",
                    f"the base's identity {ident.hex()[:16]}... is not the "
                    f"{self.bases[name].hex()[:16]}... this checkpoint recorded: it was "
                    "replaced by another save, whose bytes are not this checkpoint's",
                )
            got = self.checked[memo] = location.locate(where).pair()
        return got

    def route_key(self, key: str) -> Tuple[Any, str]:
        store, rest = self._route(key)
        if store is self.inner:
            return store, rest
        base_store, base_prefix = store
        return base_store, _join(base_prefix, rest)

    # -- the ByteStore reads ------------------------------------------------------------
    def head(self, key: str) -> Optional[ObjectInfo]:
        s, k = self.route_key(key)
        return s.head(k)  # type: ignore[no-any-return]

    def get(self, key: str) -> bytes:
        s, k = self.route_key(key)
        return s.get(k)  # type: ignore[no-any-return]

    def get_range(self, key: str, start: int, length: int) -> bytes:
        s, k = self.route_key(key)
        return s.get_range(k, start, length)  # type: ignore[no-any-return]

    def get_suffix(self, key: str, length: int) -> Tuple[bytes, int]:
        s, k = self.route_key(key)
        return s.get_suffix(k, length)  # type: ignore[no-any-return]

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        s, k = self.route_key(key)
        s.read_into(k, start, out)

    def path(self, key: str) -> str:
        s, k = self.route_key(key)
        return s.path(k)  # type: ignore[no-any-return]

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def put(self, key: str, data: Any, *, if_absent: bool = False) -> Optional[str]:
        raise PermissionError(f"{key}: a checkpoint's bases are read-only")

    def delete(self, keys: Iterable[str]) -> None:
        raise PermissionError("a checkpoint's bases are read-only")

    def make_durable(self, keys: Optional[Iterable[str]] = None) -> None:
        return None


def based_store(
    store: ByteStore, prefix: str, root: str, part: PackedArray, key: str, checked: Dict[str, Any]
) -> Any:
    """``store`` itself for an array of no base, else a :class:`BasedStore` reaching its bases
    (its objects' existence and sizes are then checked through it, [SP-PACK-7])."""
    if not part.bases:
        return store
    return BasedStore(store, prefix, root, part.bases, key, checked)


def verify_hashes(view: Any) -> list[Any]:
    """Every chunk of a packed array read again and its [SP-PACK-10] hash compared with the
    index's (where the index holds hashes): ``(spec ID, message)`` per chunk whose bytes are
    not those the writer hashed. Chunks that cannot be read are reported by the reader's
    own checks, not here."""
    part = view.part
    if part.hashes is None:
        return []
    out = []
    for c in range(len(part.records)):
        path, off, n, _crc = part.chunk(c)
        try:
            raw = view.store.get_range(_join(view.prefix, path), off, n)
        except (OSError, EOFError, CorruptCheckpointError):
            continue
        if len(raw) == n and chunk_hash([raw]) != part.hash(c):
            out.append(
                (
                    "SP-PACK-10",
                    f"tensor {view.key!r}: chunk {c}: bytes {off}..{off + n} of data object "
                    f"{path}: their hash is not the index's (the bytes changed after they "
                    "were written)",
                )
            )
    return out
