"""A Google Cloud Storage :class:`~shardpoint_core.stores.base.ByteStore`, through the
``google-cloud-storage`` client (the ``gcs`` extra).

``gs://bucket/prefix`` roots a store below ``prefix`` of ``bucket``. Credentials are Google's
Application Default Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, ``gcloud auth
application-default login``, the metadata server), or a service-account file in
:class:`GcsOptions`. ``STORAGE_EMULATOR_HOST`` (or ``GcsOptions(endpoint_url=...)``) sends
requests to an emulator, anonymously.

Why this client and not TensorStore's ``gcs`` kvstore: the object-store commit and recovery
need an object's size, generation and modification time from a listing or a HEAD (the age
rule of [SP-COMMIT-15]); TensorStore's KvStore API lists keys only and gives no modification
time. Conditional writes are GCS's generation preconditions: ``if_absent`` is
``ifGenerationMatch=0``, ``if_match`` ``ifGenerationMatch=<generation>`` (the version of
:meth:`head`), which the commit's [SP-COMMIT-12] builds on.

Conditional writes are on by default (GCS honours them). An emulator may not: the
``gcp-storage-emulator`` package, which the tests run, ignores every precondition. Turn them
off there (``GcsOptions(conditional_writes=False)`` or ``SHARDPOINT_GCS_CONDITIONAL_WRITES=0``):
the store then says so in its capabilities, ``if_absent`` becomes a check-then-write that is
not atomic, ``if_match`` is refused, and the commit falls back to its documented plain-PUT mode
(two concurrent saves to one path are the caller's error, [SP-COMMIT-12]).

Example::

    store = GcsStore.from_url("gs://bucket/run")
    store.put("step_1/x", b"hello")
    assert store.get_range("step_1/x", 1, 3) == b"ell"
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, List, Optional
from urllib.parse import urlsplit

from shardpoint_core.stores.env import numbers_from_env
from shardpoint_core.format.errors import (
    InvalidOptionError,
    StoreAccessDeniedError,
    StoreNotFoundError,
    StoreUnavailableError,
)
from shardpoint_core.stores.base import ObjectInfo, PutData, StoreCapabilities
from shardpoint_core.stores.keys import check_key, check_prefix

CONDITIONAL_ENV = "SHARDPOINT_GCS_CONDITIONAL_WRITES"
ENV_SETTINGS = (
    CONDITIONAL_ENV,
    "SHARDPOINT_GCS_READ_TIMEOUT_S",
    "SHARDPOINT_GCS_CONNECT_TIMEOUT_S",
    "SHARDPOINT_GCS_DEADLINE_S",
)


@dataclass(frozen=True)
class GcsOptions:
    """How to reach GCS. ``None`` fields fall back to the environment (``STORAGE_EMULATOR_HOST``,
    ``SHARDPOINT_GCS_CONDITIONAL_WRITES``) and Application Default Credentials."""

    endpoint_url: Optional[str] = None  # an emulator or a private endpoint
    project: Optional[str] = None
    credentials_file: Optional[str] = None  # a service-account JSON key file
    timeout_s: float = 10.0  # per request: a socket idle this long fails it
    retry_timeout_s: float = 20.0  # no retry starts later than this after the first
    connect_timeout_s: float = 5.0
    max_connections: int = 64  # requests in flight per process
    conditional_writes: Optional[bool] = None  # None: $SHARDPOINT_GCS_CONDITIONAL_WRITES, else on

    def __post_init__(self) -> None:
        if self.max_connections < 1 or not all(
            0 < t < float("inf")
            for t in (self.timeout_s, self.retry_timeout_s, self.connect_timeout_s)
        ):
            raise InvalidOptionError(
                "GcsOptions: max_connections >= 1 and positive, finite timeouts"
            )

    @classmethod
    def from_env(cls, **fields: Any) -> "GcsOptions":
        """The options with the process's ``SHARDPOINT_GCS_*`` timeouts over the defaults;
        ``fields`` over both."""
        got = numbers_from_env(
            {
                "timeout_s": ("SHARDPOINT_GCS_READ_TIMEOUT_S", float),
                "connect_timeout_s": ("SHARDPOINT_GCS_CONNECT_TIMEOUT_S", float),
                "retry_timeout_s": ("SHARDPOINT_GCS_DEADLINE_S", float),
            }
        )
        got.update(fields)
        return cls(**got)

    @property
    def timeouts(self) -> tuple[Any, ...]:
        """(connect, read) seconds, as each request is given them."""
        return (self.connect_timeout_s, self.timeout_s)

    def conditional(self) -> bool:
        """Whether the server is trusted to honour generation preconditions."""
        if self.conditional_writes is not None:
            return bool(self.conditional_writes)
        v = os.environ.get(CONDITIONAL_ENV, "1").strip().lower()
        return v not in ("0", "false", "no", "off")

    def endpoint(self) -> Optional[str]:
        return self.endpoint_url or os.environ.get("STORAGE_EMULATOR_HOST") or None


def parse_gs_url(url: str) -> tuple[Any, ...]:
    """``(bucket, prefix)`` of ``gs://bucket/prefix``; the prefix has no surrounding ``/``."""
    parts = urlsplit(url)
    if parts.scheme != "gs" or not parts.netloc:
        raise InvalidOptionError(f"{url!r} is not a gs://bucket/prefix URL")
    prefix = parts.path.strip("/")
    if prefix:
        check_key(prefix)
    return parts.netloc, prefix


class GcsStore:
    """Objects below ``prefix`` of one GCS bucket. Thread-safe (one client, shared)."""

    def __init__(self, bucket: str, prefix: str = "", options: Optional[GcsOptions] = None) -> None:
        self.bucket_name = bucket
        self.prefix = prefix.strip("/")
        self._p = self.prefix + "/" if self.prefix else ""
        self.options = options or GcsOptions.from_env()
        self.conditional = self.options.conditional()
        self.url = f"gs://{bucket}/{self.prefix}".rstrip("/")
        self.capabilities = StoreCapabilities(
            conditional_put=self.conditional,
            ranged_get=True,
            durable_put=True,
            conditional_replace=self.conditional,
        )
        self._client: Any = None  # google.cloud.storage.Client, made on first use
        self._bucket: Any = None
        self._lock = threading.Lock()
        self._pool: Optional[ThreadPoolExecutor] = None

    @classmethod
    def from_url(cls, url: str, options: Optional[GcsOptions] = None) -> "GcsStore":
        """The store of ``gs://bucket/prefix``."""
        bucket, prefix = parse_gs_url(url)
        return cls(bucket, prefix, options)

    # -- the client -----------------------------------------------------------------------
    @property
    def bucket(self) -> Any:
        """The client's bucket handle, made on first use (the client is imported only then)."""
        if self._bucket is None:
            with self._lock:
                if self._bucket is None:
                    self._client = self._make_client()
                    self._bucket = self._client.bucket(self.bucket_name)
        return self._bucket

    def _make_client(self) -> Any:
        try:
            from google.cloud import storage
        except ImportError as e:  # pragma: no cover - the gcs extra is missing
            raise InvalidOptionError(
                "gs:// needs google-cloud-storage: pip install 'shardpoint[gcs]'"
            ) from e
        o = self.options
        endpoint = o.endpoint()
        try:
            if endpoint:
                from google.auth.credentials import AnonymousCredentials

                # google-auth's constructor carries no annotation
                anonymous = AnonymousCredentials()  # type: ignore[no-untyped-call]
                client = storage.Client(
                    project=o.project or "shardpoint",
                    credentials=anonymous,
                    client_options={"api_endpoint": endpoint},
                )
            elif o.credentials_file:
                client = storage.Client.from_service_account_json(
                    o.credentials_file, project=o.project
                )
            else:
                client = storage.Client(project=o.project)
        except Exception as e:  # noqa: BLE001 - google.auth's DefaultCredentialsError and alike
            raise StoreAccessDeniedError(
                f"no usable Google credentials for {self.url} ({type(e).__name__}: {e}); set "
                "GOOGLE_APPLICATION_CREDENTIALS, run `gcloud auth application-default login`, "
                "or pass GcsOptions(credentials_file=...)"
            ) from e
        try:  # the default pool holds 10 connections; a load keeps more in flight
            from requests.adapters import HTTPAdapter

            adapter = HTTPAdapter(pool_connections=4, pool_maxsize=o.max_connections)
            client._http.mount("https://", adapter)
            client._http.mount("http://", adapter)
        except Exception:  # noqa: BLE001 - a client without a requests session: its defaults
            pass
        return client

    @property
    def _retry(self) -> Any:
        from google.cloud.storage.retry import DEFAULT_RETRY

        return DEFAULT_RETRY.with_timeout(self.options.retry_timeout_s)

    def _error(self, exc: BaseException, key: str = "", what: str = "request") -> BaseException:
        """The documented error for a client failure on ``key`` (or the store itself)."""
        from google.api_core import exceptions as gx

        where = f"gs://{self.bucket_name}/{self._p}{key}" if key else self.url
        endpoint = self.options.endpoint() or "storage.googleapis.com"
        if isinstance(exc, gx.NotFound):
            if "bucket" in str(exc).lower() and "object" not in str(exc).lower():
                return StoreNotFoundError(
                    f"bucket {self.bucket_name!r} does not exist at {endpoint} ({what} of {where})"
                )
            return FileNotFoundError(2, f"no object {where}", where)
        if isinstance(exc, gx.PreconditionFailed):
            return FileExistsError(
                17,
                f"conditional write of {where} refused: the object exists or changed meanwhile",
                where,
            )
        if isinstance(exc, (gx.Forbidden, gx.Unauthorized)):
            return StoreAccessDeniedError(
                f"{what} of {where} at {endpoint} was refused "
                f"({exc}); check the Google credentials and the "
                "bucket's IAM policy"
            )
        if isinstance(exc, (gx.ServerError, gx.TooManyRequests, gx.RetryError)):
            return StoreUnavailableError(
                f"{what} of {where}: {endpoint} kept failing or not "
                f"answering for the {self.options.retry_timeout_s:g}s "
                "deadline of retries (read timeout "
                f"{self.options.timeout_s:g}s; {type(exc).__name__}: "
                f"{exc})"
            )
        import requests

        if isinstance(exc, (requests.ConnectionError, requests.Timeout)):
            return StoreUnavailableError(
                f"{what} of {where}: {endpoint} unreachable "
                f"({type(exc).__name__}: {exc}); check "
                "STORAGE_EMULATOR_HOST / GcsOptions(endpoint_url=...) "
                "and the network"
            )
        if isinstance(exc, gx.GoogleAPICallError):
            return OSError(f"{what} of {where} failed: {exc}")
        return exc

    def _do(self, fn: Callable[[], Any], key: str, what: str) -> Any:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - mapped to a documented error
            raise self._error(e, key, what) from e

    # -- reads ----------------------------------------------------------------------------
    def _blob(self, key: str) -> Any:
        return self.bucket.blob(self._p + check_key(key))

    def get(self, key: str) -> bytes:
        """The whole object at ``key``."""
        b = self._blob(key)
        data: bytes = self._do(
            lambda: b.download_as_bytes(
                raw_download=True, retry=self._retry, timeout=self.options.timeouts
            ),
            key,
            "GET",
        )
        return data

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes from ``start`` (fewer where the object ends): one ranged GET."""
        b = self._blob(key)
        if length <= 0:
            return b""
        from google.api_core.exceptions import RequestRangeNotSatisfiable

        try:
            data: bytes = b.download_as_bytes(
                start=start,
                end=start + length - 1,
                raw_download=True,
                retry=self._retry,
                timeout=self.options.timeouts,
            )
            return data
        except RequestRangeNotSatisfiable:
            return b""
        except Exception as e:  # noqa: BLE001 - mapped to a documented error
            raise self._error(e, key, "ranged GET") from e

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        """Fill ``out`` from ``start`` with one ranged GET."""
        out = memoryview(out).cast("B")
        if len(out) == 0:
            self._blob(key)
            return
        data = self.get_range(key, start, len(out))
        if len(data) < len(out):
            raise EOFError(f"{self.url}/{key}: {len(data)} bytes from {start}, {len(out)} wanted")
        out[:] = data

    def head(self, key: str) -> Optional[ObjectInfo]:
        """Size, modification time and generation of ``key``, or None."""
        name = self._p + check_key(key)
        b = self._do(
            lambda: self.bucket.get_blob(name, retry=self._retry, timeout=self.options.timeouts),
            key,
            "HEAD",
        )
        return None if b is None else self._info(b)

    def _info(self, b: Any) -> ObjectInfo:
        return ObjectInfo(
            b.name[len(self._p) :],
            int(b.size or 0),
            b.updated.timestamp() if b.updated else 0.0,
            str(b.generation),
        )

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object below ``prefix``, in key order (GCS lists in UTF-8 byte order)."""
        check_prefix(prefix)
        it = self._do(lambda: self._client_list(self._p + prefix), prefix, "LIST")
        try:
            for b in it:
                yield self._info(b)
        except Exception as e:  # noqa: BLE001 - mapped to a documented error
            raise self._error(e, prefix, "LIST") from e

    def _client_list(self, prefix: str, delimiter: Optional[str] = None) -> Any:
        _ = self.bucket  # the client exists
        return self._client.list_blobs(
            self.bucket_name,
            prefix=prefix,
            delimiter=delimiter,
            retry=self._retry,
            timeout=self.options.timeouts,
        )

    def list_children(self, prefix: str = "") -> List[str]:
        """The names one level below ``prefix`` that hold objects (``a`` for ``prefix/a/x``),
        from one delimited listing, without listing every object below them."""
        check_prefix(prefix)
        it = self._do(lambda: self._client_list(self._p + prefix, "/"), prefix, "LIST")
        try:
            for _ in it.pages:
                pass
        except Exception as e:  # noqa: BLE001 - mapped to a documented error
            raise self._error(e, prefix, "LIST") from e
        n = len(self._p + prefix)
        return sorted(p[n:].rstrip("/") for p in it.prefixes)

    # -- writes ---------------------------------------------------------------------------
    def put(
        self, key: str, data: PutData, *, if_absent: bool = False, if_match: Optional[str] = None
    ) -> str:
        """Store ``data`` at ``key``; returns the new generation. ``if_absent``:
        ``ifGenerationMatch=0``; ``if_match``: replace only the object of this generation.
        Both raise ``FileExistsError`` when the condition fails. Without conditional writes
        ``if_absent`` checks first (not atomic) and ``if_match`` is refused."""
        b = self._blob(key)
        if isinstance(data, (bytes, bytearray, memoryview)):
            body = bytes(data) if not isinstance(data, bytes) else data
        else:  # one copy per object (at most one chunk), never the whole checkpoint
            body = b"".join(memoryview(d).cast("B") for d in data)
        gen = None
        if if_match is not None:
            if not self.conditional:
                raise InvalidOptionError(
                    f"{self.url}: a replacement conditional on a generation "
                    "was asked for, but conditional writes are off "
                    f"({CONDITIONAL_ENV}=0 / GcsOptions)"
                )
            gen = int(if_match)
        elif if_absent:
            if self.conditional:
                gen = 0
            elif self.head(key) is not None:
                raise FileExistsError(17, f"{self.url}/{key} exists", key)
        retry = self._retry if gen is not None or not (if_absent or if_match) else None
        self._do(
            lambda: b.upload_from_string(
                body,
                content_type="application/octet-stream",
                if_generation_match=gen,
                retry=retry,
                timeout=self.options.timeouts,
            ),
            key,
            "PUT",
        )
        return str(b.generation)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    min(16, self.options.max_connections), thread_name_prefix="sp-gcs"
                )
            return self._pool

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` (in parallel requests); keys already gone are not an error."""
        names = [self._p + check_key(k) for k in keys]
        if not names:
            return

        def one(name: str) -> None:
            from google.api_core.exceptions import NotFound

            try:
                self.bucket.delete_blob(name, retry=self._retry, timeout=self.options.timeouts)
            except NotFound:
                pass
            except Exception as e:  # noqa: BLE001 - mapped to a documented error
                raise self._error(e, name[len(self._p) :], "DELETE") from e

        list(self._executor().map(one, names))

    def make_durable(self, keys: Optional[Iterable[str]] = None) -> None:
        """Nothing to do: GCS acknowledges a write once it is durable ([SP-COMMIT-10])."""

    def with_options(self, **changes: Any) -> "GcsStore":
        """The same store with some :class:`GcsOptions` fields changed."""
        return GcsStore(self.bucket_name, self.prefix, replace(self.options, **changes))

    def __repr__(self) -> str:
        return f"GcsStore({self.url!r}, conditional_writes={self.conditional})"


if TYPE_CHECKING:
    # static checks that the class satisfies the protocol it claims (runtime_checkable
    # compares method names only); mypy fails here on a regression
    from shardpoint_core.stores.base import ByteStore, ReplaceableStore

    def _is_bytestore_gcsstore(x: GcsStore) -> ByteStore:
        return x

    def _is_replaceablestore_gcsstore(x: GcsStore) -> ReplaceableStore:
        return x
