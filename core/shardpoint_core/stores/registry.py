"""Stores chosen from a checkpoint's path: plain paths and ``file://`` are local files,
``memory://name/...`` a process-wide memory store, ``shm://job/...`` the memory tier's store
of a job (host shared memory, replicated to peer hosts: :mod:`.shm`), ``s3://`` and ``gs://``
the object stores
(:mod:`.s3`, :mod:`.gcs`), ``tensorstore+file://``, ``tensorstore+memory://``,
``tensorstore+s3://`` and ``tensorstore+gs://`` the same places through TensorStore's kvstore
drivers (:mod:`.tensorstore`), and any other scheme whatever was
registered for it (``register_store("s3", factory)``: object stores plug in here).

A path with a scheme nobody registered is refused (:class:`UnsupportedStoreError`, naming the
scheme and the registered ones), never taken for a local path: before this, ``save(state,
"s3://bucket/x")`` wrote a local directory ``s3:``.

Example::

    register_store("mystore", lambda url: MyStore(url))
    store = open_store("mystore://bucket/run/step_5")     # a MyStore rooted there
    local_path("file:///ckpt/step_5", "load")             # '/ckpt/step_5'
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from shardpoint_core.format.errors import InvalidOptionError, UnsupportedStoreError
from shardpoint_core.stores.base import ByteStore

StoreFactory = Callable[[str], ByteStore]
TENSORSTORE_SCHEMES = ("tensorstore+file", "tensorstore+memory", "tensorstore+s3", "tensorstore+gs")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_LOCK = threading.Lock()
_FACTORIES: Dict[str, StoreFactory] = {}


def split_url(path: Any) -> Tuple[Optional[str], str]:
    """(scheme in lower case, the rest after ``://``) of a URL; (None, path) for a plain path
    (also an ``os.PathLike``). Only ``scheme://`` makes a URL: ``a:b`` is a file name."""
    p = os.fspath(path)
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    m = _SCHEME.match(p)
    if m is None:
        return None, p
    return m.group(1).lower(), p[m.end() :]


def register_store(scheme: str, factory: StoreFactory, *, replace: bool = False) -> None:
    """Make ``scheme://...`` paths open ``factory(url)`` (a store rooted at ``url``).
    Registering a scheme twice is an error unless ``replace`` (two plugins fighting over
    one scheme should not go unnoticed)."""
    s = scheme.lower()
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", s):
        raise ValueError(
            f"{scheme!r} is not a URL scheme (a letter, then letters, digits, '+', '-' or '.')"
        )
    if s == "file":
        raise ValueError("'file' is built in: plain paths and file:// are local files")
    with _LOCK:
        if s in _FACTORIES and not replace and _FACTORIES[s] is not factory:
            raise ValueError(
                f"a store is already registered for {s}://; pass replace=True to replace it"
            )
        _FACTORIES[s] = factory


def unregister_store(scheme: str) -> None:
    """Forget the store of ``scheme`` (tests; a plugin being unloaded)."""
    with _LOCK:
        _FACTORIES.pop(scheme.lower(), None)


def registered_schemes() -> List[str]:
    """Every scheme a path may use here, ``file`` included, sorted."""
    with _LOCK:
        return sorted({"file", *_FACTORIES})


def _file_path(rest: str, url: str) -> str:
    if rest.startswith("localhost/"):
        rest = rest[len("localhost") :]
    if not rest.startswith("/"):
        raise UnsupportedStoreError(
            f"{url!r}: a file:// URL names an absolute path "
            "(file:///dir/ckpt); use a plain path for a relative one"
        )
    return rest


def _unknown(scheme: str, url: str, call: str) -> UnsupportedStoreError:
    return UnsupportedStoreError(
        f"{call}: {url!r} names the store scheme {scheme + '://'!r}, for which no store is "
        f"registered (registered: {', '.join(s + '://' for s in registered_schemes())}); a "
        "URL is never taken for a local path. Register one with shardpoint_core.stores."
        "register_store, or give a local path"
    )


def open_store(url: Any, call: str = "open_store") -> ByteStore:
    """The store rooted at ``url`` (a plain path or ``file://``: a :class:`FileStore`)."""
    scheme, rest = split_url(url)
    if scheme is None or scheme == "file":
        from shardpoint_core.stores.files import FileStore

        return FileStore(rest if scheme is None else _file_path(rest, os.fspath(url)))
    with _LOCK:
        factory = _FACTORIES.get(scheme)
    if factory is None:
        raise _unknown(scheme, os.fspath(url), call)
    return factory(os.fspath(url))


def _no_nul(path: Any, call: str) -> None:
    """Refuse a path with a NUL byte (no file system or store takes one) as the documented
    InvalidOptionError, not the ValueError ``open`` would raise somewhere below."""
    text = os.fsdecode(path)
    if "\x00" in text:
        raise InvalidOptionError(
            f"{call}: the path {text!r} contains a NUL byte; no file system or store accepts one"
        )


def check_path(path: Any, call: str) -> None:
    """Refuse (:class:`UnsupportedStoreError`) a path whose scheme nobody registered, and
    (:class:`InvalidOptionError`) one with a NUL byte."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        return
    _no_nul(path, call)
    scheme, _rest = split_url(path)
    if scheme is not None and scheme != "file":
        with _LOCK:
            known = scheme in _FACTORIES
        if not known:
            raise _unknown(scheme, os.fsdecode(path), call)


def is_local(path: Any) -> bool:
    """True for plain paths and ``file://`` URLs."""
    return split_url(path)[0] in (None, "file")


def local_path(path: Any, call: str) -> str:
    """The local file system path of ``path`` (plain, or ``file://``), for operations that
    work on local files only; any other scheme is refused with :class:`UnsupportedStoreError`
    (one nobody registered, or a registered one ``call`` does not support yet)."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        # not a path at all: the caller's own check says so (returned as it came)
        return path  # type: ignore[no-any-return]
    _no_nul(path, call)
    scheme, rest = split_url(path)
    if scheme is None:
        return rest
    if scheme == "file":
        return _file_path(rest, os.fsdecode(path))
    check_path(path, call)
    raise UnsupportedStoreError(
        f"{call}: {os.fspath(path)!r} is on the {scheme}:// store, and {call} works on local "
        "files (plain paths, file://) only"
    )


def _memory_store(url: str) -> ByteStore:
    from shardpoint_core.stores.memory import MemoryStore

    _s, rest = split_url(url)
    name, _sep, prefix = rest.partition("/")
    if not name:
        raise UnsupportedStoreError(f"{url!r}: a memory store URL is memory://NAME/PATH")
    return MemoryStore.named(name, prefix=prefix)


def _s3_store(url: str) -> ByteStore:
    from shardpoint_core.stores.s3 import S3Store  # boto3 is imported on first request

    return S3Store.from_url(url)


def _gcs_store(url: str) -> ByteStore:
    from shardpoint_core.stores.gcs import GcsStore  # google-cloud-storage: on first request

    return GcsStore.from_url(url)


def _tensorstore_store(url: str) -> ByteStore:
    from shardpoint_core.stores.tensorstore import TensorStoreStore  # tensorstore: on first use

    return TensorStoreStore(url)


register_store("memory", _memory_store)
register_store("s3", _s3_store)
register_store("gs", _gcs_store)
# TensorStore's kvstore drivers, chosen by the path: tensorstore+s3://bucket/run (see
# benchmarks/RESULTS.md, "Byte stores", for why the plain schemes keep their own stores).
for _scheme in TENSORSTORE_SCHEMES:
    register_store(_scheme, _tensorstore_store)


# The environment names the endpoint, credentials, timeouts and deadlines (s3.ENV_SETTINGS,
# gcs.ENV_SETTINGS): a store opened under other settings is not reused (a job, or a test,
# that points AWS_ENDPOINT_URL elsewhere or shortens a timeout gets a new one).
_STORE_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_PROFILE",
    "AWS_REGION",
    "STORAGE_EMULATOR_HOST",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "SHARDPOINT_S3_CONNECT_TIMEOUT_S",
    "SHARDPOINT_S3_READ_TIMEOUT_S",
    "SHARDPOINT_S3_DEADLINE_S",
    "SHARDPOINT_S3_MAX_ATTEMPTS",
    "SHARDPOINT_GCS_CONDITIONAL_WRITES",
    "SHARDPOINT_GCS_READ_TIMEOUT_S",
    "SHARDPOINT_GCS_CONNECT_TIMEOUT_S",
    "SHARDPOINT_GCS_DEADLINE_S",
)
_BUCKETS: dict[tuple[Optional[str], ...], ByteStore] = {}


def bucket_store(url: Any, call: str = "open") -> tuple[ByteStore, str]:
    """``(store, key)`` of a URL: the store of its bucket, one per bucket and environment in a
    process (so one connection pool serves every checkpoint of a job), and the key below it.
    Both front ends locate object-store paths through this."""
    scheme, rest = split_url(url)
    bucket, _, key = rest.partition("/")
    root = f"{scheme}://{bucket}"
    ident = (root, *(os.environ.get(k) for k in _STORE_ENV))
    with _LOCK:
        store = _BUCKETS.get(ident)
    if store is None:
        store = open_store(root, call)
        with _LOCK:
            store = _BUCKETS.setdefault(ident, store)
    return store, key.strip("/")


def url_of(url: str, key: str) -> str:
    """The URL of ``key`` in the bucket of ``url`` (``s3://bucket/key``)."""
    scheme, rest = split_url(url)
    return f"{scheme}://{rest.partition('/')[0]}/{key}"


def _shm_store(url: str) -> ByteStore:
    from shardpoint_core.stores.shm import ShmStore  # the memory tier's store of a job

    _s, rest = split_url(url)
    job = rest.partition("/")[0]
    if not job:
        raise UnsupportedStoreError(f"{url!r}: a memory-tier URL is shm://JOB/PATH")
    return ShmStore.named(job)


register_store("shm", _shm_store)
