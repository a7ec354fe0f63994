"""Which backend serves a path: the caller's when given, else the default one (local files
through :func:`shardpoint_core.storage.get_backend`, any registered URL scheme through a
shared :class:`~shardpoint_core.zarr.backend.ZarrBackend`), and the refusal of a scheme no
store is registered for. :data:`ObjectStoreBackend` is the backend's older name for object
stores (the same class: one format layer over every byte store).

Example::

    path, be = resolve("s3://bucket/run/step_5", None, "save")
    staging = be.staging_path(path, token="a1b2c3d4")
"""
from __future__ import annotations

import os
from typing import Any, Optional, Tuple

from shardpoint_core.store.registry import split_url
from shardpoint_core.zarr.backend import ZarrBackend
from shardpoint_core.zarr.committers import UrlCommitter

ObjectStoreBackend = ZarrBackend
__all__ = ["ObjectStoreBackend", "UrlCommitter", "backend_for", "manifest_with_identity",
           "resolve"]

_DEFAULT: Optional[ZarrBackend] = None


def backend_for(path: Any, backend: Any = None) -> Any:
    """The backend for ``path``: ``backend`` when given, the shared object-store default for
    a URL of a registered store other than files, else the default (local files)."""
    if backend is not None:
        return backend
    scheme, _ = split_url(path)
    if scheme is None or scheme == "file":
        from shardpoint_core.storage import get_backend
        return get_backend()
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = ZarrBackend()
    return _DEFAULT


def resolve(path: Any, backend: Any, call: str) -> Tuple[str, Any]:
    """``(path, backend)`` for an API call: a local path (plain or ``file://``) with the
    default backend, or the URL of a registered store with the object-store default; a
    scheme nobody registered is refused before any I/O (UnsupportedStoreError)."""
    from shardpoint_core.store.registry import check_path, is_local, local_path
    if not isinstance(path, (str, bytes, os.PathLike)):    # the caller's own check says so
        from shardpoint_core.storage import get_backend
        return path, get_backend(backend)
    if is_local(path) or backend is not None:
        return str(local_path(path, call)) if is_local(path) else str(path), \
            backend_for(path, backend)
    check_path(path, call)
    return str(path), backend_for(path)


def manifest_with_identity(be: Any, path: str) -> Tuple[bytes, Optional[list[Any]]]:
    """(the manifest's bytes, the identity of the commit they belong to), for a reader that
    checks the identity again after its last read (a checkpoint replaced meanwhile is seen):
    from one GET where the backend can (``read_manifest_with_identity``: object stores give
    the version with the bytes), else the identity first and the manifest after it."""
    both = getattr(be, "read_manifest_with_identity", None)     # optional (storage.py)
    if both is not None:
        got: Tuple[bytes, Optional[list[Any]]] = both(path)
        return got
    identity = getattr(be, "checkpoint_identity", None)
    ident = identity(path) if identity else None
    return be.read_manifest(path), ident
