"""Which backend serves a path: the caller's when given, else a shared
:class:`~shardpoint_core.transactions.packed.PackedBackend` (one for local files,
:func:`get_backend`; one for every registered URL scheme): saves write the packed layout
(format 1.4) unless a caller asks for the per-array one with ``ZarrBackend()``, and every
backend reads both. Also the refusal of a scheme no store is registered for, and
:func:`read_metadata`, the manifest of a checkpoint without its tensors.

Example::

    path, be = resolve("s3://bucket/run/step_5", None, "save")
    staging = be.staging_path(path, token="a1b2c3d4")
"""

from __future__ import annotations

import os
from typing import Any, Optional, Tuple

from shardpoint_core.format.manifest import Manifest, decode_manifest
from shardpoint_core.stores.registry import split_url
from shardpoint_core.transactions.packed import PackedBackend
from shardpoint_core.transactions.protocol import StorageBackend

__all__ = ["backend_for", "manifest_with_identity", "get_backend", "read_metadata", "resolve"]

_DEFAULT: Optional[Any] = None


def backend_for(path: Any, backend: Any = None) -> Any:
    """The backend for ``path``: ``backend`` when given, the shared object-store default for
    a URL of a registered store other than files, else the default (local files)."""
    if backend is not None:
        return backend
    scheme, _ = split_url(path)
    if scheme is None or scheme == "file":
        return get_backend()
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = PackedBackend()
    return _DEFAULT


def resolve(path: Any, backend: Any, call: str) -> Tuple[str, Any]:
    """``(path, backend)`` for an API call: a local path (plain or ``file://``) with the
    default backend, or the URL of a registered store with the object-store default; a
    scheme nobody registered is refused before any I/O (UnsupportedStoreError)."""
    from shardpoint_core.stores.registry import check_path, is_local, local_path

    if not isinstance(path, (str, bytes, os.PathLike)):  # the caller's own check says so
        return path, get_backend(backend)
    if is_local(path) or backend is not None:
        return str(local_path(path, call)) if is_local(path) else str(path), backend_for(
            path, backend
        )
    check_path(path, call)
    return str(path), backend_for(path)


def manifest_with_identity(be: Any, path: str) -> Tuple[bytes, Optional[list[Any]]]:
    """(the manifest's bytes, the identity of the commit they belong to), for a reader that
    checks the identity again after its last read (a checkpoint replaced meanwhile is seen):
    from one GET where the backend can (``read_manifest_with_identity``: object stores give
    the version with the bytes), else the identity first and the manifest after it."""
    both = getattr(be, "read_manifest_with_identity", None)  # optional (storage.py)
    if both is not None:
        got: Tuple[bytes, Optional[list[Any]]] = both(path)
        return got
    identity = getattr(be, "checkpoint_identity", None)
    ident = identity(path) if identity else None
    return be.read_manifest(path), ident


_DEFAULT_LOCAL: Optional[StorageBackend] = None


def get_backend(backend: Optional[StorageBackend] = None) -> StorageBackend:
    """``backend`` if given, else the process-wide default backend (local files)."""
    global _DEFAULT_LOCAL
    if backend is not None:
        return backend
    if _DEFAULT_LOCAL is None:
        _DEFAULT_LOCAL = PackedBackend()
    return _DEFAULT_LOCAL


def read_metadata(path: str, *, backend: Any = None) -> Manifest:
    """The checkpoint's manifest, no tensor bytes read: ``.tree`` (the saved tree, typed
    leaves: :mod:`shardpoint_core.format.statetree`), keys, shapes, dtypes, chunk grids, version."""
    path, be = resolve(path, backend, "read_metadata")
    return decode_manifest(be.read_manifest(path))
