"""An S3 (or S3-compatible) :class:`~shardpoint_core.stores.base.ByteStore`, through boto3.

``s3://bucket/prefix`` roots a store below ``prefix`` of ``bucket``. Endpoint, credentials and
region come from the standard AWS configuration that boto3 reads (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``AWS_REGION``,
``AWS_PROFILE`` and the shared config files), or from explicit :class:`S3Options`.

Why these choices:
- boto3 is imported on first use, so the core imports no S3 client unless a job uses S3.
- Every request has bounded connect and read timeouts and botocore's ``standard`` retry mode:
  throttling (503 SlowDown), 5xx and dropped connections are retried with jittered exponential
  backoff, a bounded number of times and never after the operation's deadline (``deadline_s``
  from its first attempt: an endpoint that accepts connections and never answers costs one
  or two read timeouts, not ``max_attempts`` of them); what still fails becomes a documented
  error (:class:`~shardpoint_core.format.errors.StoreUnavailableError`, ``StoreAccessDeniedError``,
  ``StoreNotFoundError``) naming the endpoint and bucket, never a hang. The defaults can be
  changed per process with ``SHARDPOINT_S3_CONNECT_TIMEOUT_S``, ``SHARDPOINT_S3_READ_TIMEOUT_S``,
  ``SHARDPOINT_S3_DEADLINE_S`` and ``SHARDPOINT_S3_MAX_ATTEMPTS`` (what ``s3://`` paths use).
- One object per chunk (the Zarr layer's shards): a put is a single PUT below
  ``multipart_threshold`` and a multipart upload of parallel parts above it; vectored puts are
  streamed from the caller's buffers without joining them. Loads use ranged GETs.
- Conditional writes (``If-None-Match: *``, ``If-Match: <etag>``) are what the object-store
  committer builds on ([SP-COMMIT-10]); S3 has them since 2024, and so does moto.

Example::

    store = S3Store.from_url("s3://bucket/run/step_1")
    store.put("tensors/w/zarr.json", b"{}")
    assert store.get("tensors/w/zarr.json") == b"{}"
"""

from __future__ import annotations

import bisect
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, List, Optional, Sequence, Tuple
from urllib.parse import urlsplit

from shardpoint_core.stores.env import numbers_from_env
from shardpoint_core.format.errors import (
    InvalidOptionError,
    StoreAccessDeniedError,
    StoreNotFoundError,
    StoreUnavailableError,
)
from shardpoint_core.stores.base import Buffer, ObjectInfo, PutData, StoreCapabilities

if TYPE_CHECKING:  # the buffer protocol, for annotations only (typeshed ships it)
    from typing_extensions import Buffer as WritableBuffer

_DENIED = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AuthorizationHeaderMalformed",
    "403",
}
_MISSING_KEY = {"NoSuchKey", "404", "NotFound"}
_PRECONDITION = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}
_DELETE_BATCH = 1000


@dataclass(frozen=True)
class S3Options:
    """How to reach S3 and how hard to push it. ``None`` fields fall back to boto3's standard
    configuration (environment, profile, config files)."""

    endpoint_url: Optional[str] = None
    region: Optional[str] = None
    profile: Optional[str] = None
    access_key_id: Optional[str] = None
    secret_access_key: Optional[str] = None
    session_token: Optional[str] = None
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 10.0  # a socket idle this long fails the attempt
    max_attempts: int = 6  # per request, first try included
    deadline_s: float = 20.0  # no retry starts later than this after the first
    max_connections: int = 64  # requests in flight per process
    multipart_threshold: int = 64 << 20  # objects above this go up in parallel parts
    part_size: int = 16 << 20
    conditional_writes: bool = True  # the server honours If-None-Match / If-Match

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.max_connections < 1:
            raise InvalidOptionError("S3Options: max_attempts and max_connections must be >= 1")
        if not all(
            0 < t < float("inf")
            for t in (self.connect_timeout_s, self.read_timeout_s, self.deadline_s)
        ):
            raise InvalidOptionError(
                "S3Options: connect_timeout_s, read_timeout_s and "
                "deadline_s must be positive and finite"
            )
        if self.part_size < 5 << 20 or self.multipart_threshold < self.part_size:
            raise InvalidOptionError(
                "S3Options: part_size must be >= 5 MiB (S3's minimum part) "
                "and multipart_threshold >= part_size"
            )

    @classmethod
    def from_env(cls, **fields: Any) -> "S3Options":
        """The options with the process's ``SHARDPOINT_S3_*`` settings (timeouts, deadline,
        attempts) over the defaults; ``fields`` over both."""
        env = {
            "connect_timeout_s": ("SHARDPOINT_S3_CONNECT_TIMEOUT_S", float),
            "read_timeout_s": ("SHARDPOINT_S3_READ_TIMEOUT_S", float),
            "deadline_s": ("SHARDPOINT_S3_DEADLINE_S", float),
            "max_attempts": ("SHARDPOINT_S3_MAX_ATTEMPTS", int),
        }
        got = numbers_from_env(env)
        got.update(fields)
        return cls(**got)


ENV_SETTINGS = (
    "SHARDPOINT_S3_CONNECT_TIMEOUT_S",
    "SHARDPOINT_S3_READ_TIMEOUT_S",
    "SHARDPOINT_S3_DEADLINE_S",
    "SHARDPOINT_S3_MAX_ATTEMPTS",
)


def parse_s3_url(url: str) -> tuple[Any, ...]:
    """``(bucket, prefix)`` of ``s3://bucket/prefix``; the prefix has no surrounding ``/``."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise InvalidOptionError(f"{url!r} is not an s3://bucket/prefix URL")
    prefix = parts.path.strip("/")
    if any(c in ("", ".", "..") for c in prefix.split("/")) and prefix:
        raise InvalidOptionError(f"{url!r}: the prefix has an empty, '.' or '..' component")
    return parts.netloc, prefix


def _check_key(key: str) -> str:
    if (
        not isinstance(key, str)
        or not key
        or "\\" in key
        or "\0" in key
        or any(p in ("", ".", "..") for p in key.split("/"))
    ):
        from shardpoint_core.format.errors import InvalidKeyError

        raise InvalidKeyError(
            f"store key {key!r}: empty, '.' or '..' component, leading or "
            "trailing '/', NUL or backslash"
        )
    return key


_CLOCK = "shardpoint_started"
_EXPIRED = "shardpoint_deadline"


def _start_clock(context: Optional[dict[str, Any]] = None, **_kw: Any) -> None:
    """Note when an operation started (its first attempt), for the deadline."""
    if context is not None:
        context.setdefault(_CLOCK, time.monotonic())


class _BuffersReader(io.RawIOBase):
    """A seekable file over several buffers, read in order without joining them (boto3 reads
    the body once for its checksum and once to send it)."""

    def __init__(self, buffers: Sequence[Buffer]) -> None:
        self._bufs = [m for m in (memoryview(b).cast("B") for b in buffers) if len(m)]
        self._starts: List[int] = []
        pos = 0
        for b in self._bufs:
            self._starts.append(pos)
            pos += len(b)
        self.size = pos
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, min(self.size, base + offset))
        return self._pos

    def readinto(self, buf: WritableBuffer) -> int:
        out = memoryview(buf).cast("B")
        done = 0
        while done < len(out) and self._pos < self.size:
            i = bisect.bisect_right(self._starts, self._pos) - 1
            b = self._bufs[i]
            off = self._pos - self._starts[i]
            n = min(len(out) - done, len(b) - off)
            out[done : done + n] = b[off : off + n]
            done += n
            self._pos += n
        return done


class S3Store:
    """Objects below ``prefix`` of one S3 bucket. Thread-safe (one boto3 client, shared)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        options: Optional[S3Options] = None,
        *,
        _client: Any = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._p = self.prefix + "/" if self.prefix else ""
        self.options = options or S3Options.from_env()
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.capabilities = StoreCapabilities(
            conditional_put=self.options.conditional_writes,
            ranged_get=True,
            durable_put=True,
            conditional_replace=self.options.conditional_writes,
        )
        self._client = _client
        self._lock = threading.Lock()
        self._pool: Optional[ThreadPoolExecutor] = None

    @classmethod
    def from_url(cls, url: str, options: Optional[S3Options] = None) -> "S3Store":
        """The store of ``s3://bucket/prefix``."""
        bucket, prefix = parse_s3_url(url)
        return cls(bucket, prefix, options)

    def child(self, sub: str) -> "S3Store":
        """A store rooted at ``sub`` below this one, sharing its client and connections."""
        _check_key(sub.strip("/"))
        return S3Store(self.bucket, self._p + sub.strip("/"), self.options, _client=self.client)

    # -- the client ---------------------------------------------------------------------
    @property
    def client(self) -> Any:
        """The boto3 client, created on first use (boto3 is imported only then). Typed Any:
        boto3 ships no annotations."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._make_client()
        return self._client

    def _make_client(self) -> Any:
        import boto3
        from botocore.config import Config

        o = self.options
        session = (
            boto3.session.Session(profile_name=o.profile) if o.profile else boto3.session.Session()
        )
        config = Config(
            connect_timeout=o.connect_timeout_s,
            read_timeout=o.read_timeout_s,
            retries={"mode": "standard", "max_attempts": o.max_attempts},
            max_pool_connections=o.max_connections,
            tcp_keepalive=True,
        )
        client = session.client(
            "s3",
            endpoint_url=o.endpoint_url,
            region_name=o.region,
            aws_access_key_id=o.access_key_id,
            aws_secret_access_key=o.secret_access_key,
            aws_session_token=o.session_token,
            config=config,
        )
        client.meta.events.register("before-call.s3", _start_clock)
        client.meta.events.register_first("needs-retry.s3", self._past_deadline)
        return client

    def _past_deadline(
        self,
        request_dict: Optional[dict[str, Any]] = None,
        caught_exception: Optional[BaseException] = None,
        response: Any = None,
        operation: Any = None,
        **_kw: Any,
    ) -> None:
        """Runs before botocore's retry handler after each failed or answered attempt: past
        the operation's deadline, a failure that would be retried is raised now instead."""
        ctx = (request_dict or {}).get("context") or {}
        started = ctx.get(_CLOCK)
        if started is None or time.monotonic() - started < self.options.deadline_s:
            return None
        if caught_exception is not None:
            ctx[_EXPIRED] = True
            raise caught_exception
        if response is not None:
            http, parsed = response
            status = getattr(http, "status_code", 200)
            if status >= 500 or status == 429:
                from botocore.exceptions import ClientError

                ctx[_EXPIRED] = True
                raise ClientError(parsed, getattr(operation, "name", "request"))
        return None

    @property
    def endpoint(self) -> str:
        """Where requests go (for messages)."""
        try:
            url: str = self.client.meta.endpoint_url
            return url
        except Exception:  # noqa: BLE001 - the client could not even be built
            return self.options.endpoint_url or "the default AWS endpoint"

    def _error(self, exc: BaseException, key: str = "", what: str = "request") -> BaseException:
        """The documented error for a botocore failure on ``key`` (or the store itself)."""
        from botocore import exceptions as bx

        where = f"s3://{self.bucket}/{self._p}{key}" if key else self.url
        if isinstance(exc, bx.ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "NoSuchBucket":
                return StoreNotFoundError(
                    f"bucket {self.bucket!r} does not exist at endpoint "
                    f"{self.endpoint} ({what} of {where}); create it or "
                    "fix the bucket name in the URL"
                )
            if code in _DENIED or status == 403:
                return StoreAccessDeniedError(
                    f"{what} of {where} at endpoint {self.endpoint} was refused ({code}: "
                    f"{err.get('Message', '')}); check the credentials (AWS_ACCESS_KEY_ID / "
                    "AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_PROFILE, or S3Options) "
                    "and the bucket policy"
                )
            if code in _MISSING_KEY or status == 404:
                return FileNotFoundError(2, f"no object {where}", where)
            if code in _PRECONDITION or status in (409, 412):
                return FileExistsError(
                    17,
                    f"conditional write of {where} refused: the object exists or changed meanwhile",
                    where,
                )
            if status is not None and (status >= 500 or status == 429 or code == "SlowDown"):
                return StoreUnavailableError(
                    f"{what} of {where}: endpoint {self.endpoint} kept answering {status} "
                    f"{code} after {self._tries()} with backoff"
                )
            return OSError(f"{what} of {where} failed: {code} {err.get('Message', '')}")
        if isinstance(exc, bx.NoCredentialsError):
            return StoreAccessDeniedError(
                f"no AWS credentials found for {where}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or pass S3Options(access_key_id=...)"
            )
        if isinstance(
            exc,
            (
                bx.EndpointConnectionError,
                bx.ConnectTimeoutError,
                bx.ReadTimeoutError,
                bx.ConnectionClosedError,
            ),
        ):
            return StoreUnavailableError(
                f"{what} of {where}: endpoint {self.endpoint} unreachable or not answering "
                f"after {self._tries()} ({type(exc).__name__}: {exc}); check "
                "AWS_ENDPOINT_URL / S3Options(endpoint_url=...) and the network"
            )
        if isinstance(exc, bx.BotoCoreError):
            return OSError(f"{what} of {where} failed: {exc}")
        return exc

    def _tries(self) -> str:
        o = self.options
        return (
            f"at most {o.max_attempts} attempts within the {o.deadline_s:g}s deadline "
            f"(connect timeout {o.connect_timeout_s:g}s, read timeout "
            f"{o.read_timeout_s:g}s)"
        )

    def _call(self, fn: Callable[..., Any], key: str, what: str, **kw: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(Bucket=self.bucket, **kw)
        except (ClientError, BotoCoreError) as e:
            raise self._error(e, key, what) from e

    # -- reads ----------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        """The whole object at ``key``."""
        r = self._call(self.client.get_object, key, "GET", Key=self._p + _check_key(key))
        return self._read_body(r, key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes from ``start`` (fewer where the object ends): one ranged GET."""
        if length <= 0:
            return b""
        from botocore.exceptions import ClientError

        try:
            r = self.client.get_object(
                Bucket=self.bucket,
                Key=self._p + _check_key(key),
                Range=f"bytes={start}-{start + length - 1}",
            )
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") == "InvalidRange":
                return b""
            raise self._error(e, key, "ranged GET") from e
        except Exception as e:  # noqa: BLE001 - mapped below
            raise self._error(e, key, "ranged GET") from e
        return self._read_body(r, key)

    def get_suffix(self, key: str, length: int) -> Tuple[bytes, int]:
        """(the last ``length`` bytes of ``key``, all of it where shorter; the object's
        size): one GET with a suffix range (``bytes=-N``), the size from ``Content-Range``,
        so a shard's index is read without a HEAD first."""
        r = self._call(
            self.client.get_object,
            key,
            "suffix GET",
            Key=self._p + _check_key(key),
            Range=f"bytes=-{max(1, length)}",
        )
        data = self._read_body(r, key)
        total = str(r.get("ContentRange", "")).rpartition("/")[2]
        return data, int(total) if total.isdigit() else len(data)

    def get_versioned(self, key: str, length: int) -> Tuple[bytes, ObjectInfo]:
        """(the first ``length`` bytes of ``key``, all of it where shorter; the object's
        :class:`ObjectInfo`) from one ranged GET: size from ``Content-Range``, version from
        the ETag of the same response, so the version is the one of the bytes read (a
        commit's marker and a load's identity without a HEAD beside the GET)."""
        from botocore.exceptions import ClientError

        try:
            r = self.client.get_object(
                Bucket=self.bucket,
                Key=self._p + _check_key(key),
                Range=f"bytes=0-{max(1, length) - 1}",
            )
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") != "InvalidRange":
                raise self._error(e, key, "GET") from e
            info = self.head(key)  # an empty object: no byte to range over
            if info is None:
                raise FileNotFoundError(
                    2, f"no object s3://{self.bucket}/{self._p}{key}", key
                ) from None
            return b"", info
        except Exception as e:  # noqa: BLE001 - mapped below
            raise self._error(e, key, "GET") from e
        data = self._read_body(r, key)
        total = str(r.get("ContentRange", "")).rpartition("/")[2]
        size = int(total) if total.isdigit() else len(data)
        return data, ObjectInfo(key, size, r["LastModified"].timestamp(), r.get("ETag", ""))

    def _read_body(self, r: dict[str, Any], key: str) -> bytes:
        from botocore.exceptions import BotoCoreError

        try:
            data: bytes = r["Body"].read()
            return data
        except (BotoCoreError, OSError) as e:
            raise self._error(e, key, "GET") from e

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        """Fill ``out`` from ``start`` with one ranged GET, straight into the buffer."""
        out = memoryview(out).cast("B")
        if len(out) == 0:
            return
        data = self.get_range(key, start, len(out))
        if len(data) < len(out):
            raise EOFError(
                f"s3://{self.bucket}/{self._p}{key}: {len(data)} bytes from "
                f"{start}, {len(out)} wanted"
            )
        out[:] = data

    def head(self, key: str) -> Optional[ObjectInfo]:
        """Size, time and ETag of ``key``, or None."""
        try:
            r = self._call(self.client.head_object, key, "HEAD", Key=self._p + _check_key(key))
        except FileNotFoundError as e:
            if isinstance(e, StoreNotFoundError):
                raise
            return None
        return ObjectInfo(
            key, int(r["ContentLength"]), r["LastModified"].timestamp(), r.get("ETag", "")
        )

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object below ``prefix``, in key order (S3 lists in UTF-8 byte order)."""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._p + prefix
        )
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            for page in pages:
                for o in page.get("Contents", ()):
                    yield ObjectInfo(
                        o["Key"][len(self._p) :],
                        int(o["Size"]),
                        o["LastModified"].timestamp(),
                        o.get("ETag", ""),
                    )
        except (ClientError, BotoCoreError) as e:
            raise self._error(e, prefix, "LIST") from e

    # -- writes ---------------------------------------------------------------------------
    def put(
        self, key: str, data: PutData, *, if_absent: bool = False, if_match: Optional[str] = None
    ) -> str:
        """Store ``data`` at ``key``; returns the new ETag. ``if_absent``: ``If-None-Match: *``;
        ``if_match``: replace only the object with this ETag. Both raise ``FileExistsError``
        when the condition fails (and are refused where the server lacks them)."""
        _check_key(key)
        if (if_absent or if_match) and not self.options.conditional_writes:
            raise InvalidOptionError(
                f"{self.url}: a conditional write was asked for but "
                "S3Options(conditional_writes=False) says the server "
                "has none"
            )
        bufs = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
        body = _BuffersReader(bufs)
        cond = {}
        if if_absent:
            cond["IfNoneMatch"] = "*"
        if if_match:
            cond["IfMatch"] = if_match
        if body.size > self.options.multipart_threshold:
            return self._put_multipart(key, body, cond)
        r = self._call(
            self.client.put_object,
            key,
            "PUT",
            Key=self._p + key,
            Body=body,
            ContentLength=body.size,
            **cond,
        )
        etag: str = r.get("ETag", "")
        return etag

    def _put_multipart(self, key: str, body: _BuffersReader, cond: dict[str, Any]) -> str:
        """Parts of ``part_size`` uploaded in parallel; the object appears (atomically) only
        at CompleteMultipartUpload, which carries the condition."""
        full = self._p + key
        up = self._call(self.client.create_multipart_upload, key, "multipart start", Key=full)
        uid = up["UploadId"]
        ps = self.options.part_size
        n = (body.size + ps - 1) // ps
        views = []
        for b, s in zip(body._bufs, body._starts):
            views.append((s, b))

        def part(i: int) -> dict[str, Any]:
            lo, hi = i * ps, min(body.size, (i + 1) * ps)
            pieces = [b[max(lo - s, 0) : hi - s] for s, b in views if s < hi and s + len(b) > lo]
            r = self._call(
                self.client.upload_part,
                key,
                f"part {i + 1}/{n} upload",
                Key=full,
                UploadId=uid,
                PartNumber=i + 1,
                Body=_BuffersReader(pieces),
                ContentLength=hi - lo,
            )
            return {"PartNumber": i + 1, "ETag": r["ETag"]}

        try:
            parts = list(self._executor().map(part, range(n)))
            r = self._call(
                self.client.complete_multipart_upload,
                key,
                "multipart completion",
                Key=full,
                UploadId=uid,
                MultipartUpload={"Parts": parts},
                **cond,
            )
            etag: str = r.get("ETag", "")
            return etag
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=uid)
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
            raise

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max(1, self.options.max_connections // 4), thread_name_prefix="sp-s3-part"
                )
            return self._pool

    def delete(self, keys: Iterable[str]) -> None:
        """Remove these objects (batches of 1000); missing ones are not an error."""
        batch: List[str] = []
        for k in keys:
            batch.append(self._p + _check_key(k))
            if len(batch) == _DELETE_BATCH:
                self._delete_batch(batch)
                batch = []
        if batch:
            self._delete_batch(batch)

    def _delete_batch(self, batch: List[str]) -> None:
        r = self._call(
            self.client.delete_objects,
            batch[0][len(self._p) :],
            "DELETE",
            Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
        )
        errors = [e for e in r.get("Errors", ()) if e.get("Code") != "NoSuchKey"]
        if errors:
            e = errors[0]
            raise OSError(
                f"delete of s3://{self.bucket}/{e.get('Key')} failed: "
                f"{e.get('Code')} {e.get('Message', '')} ({len(errors)} failed)"
            )

    def make_durable(self, keys: Optional[Iterable[str]] = None) -> None:
        """Nothing to do: S3 acknowledges a PUT only once the object is durable."""

    def check(self) -> None:
        """One request that proves the bucket exists and the credentials work (HEAD bucket),
        so a job fails before it stages anything."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                e.response.setdefault("Error", {})["Code"] = "NoSuchBucket"
            raise self._error(e, "", "HEAD bucket") from e
        except BotoCoreError as e:
            raise self._error(e, "", "HEAD bucket") from e

    def with_options(self, **changes: Any) -> "S3Store":
        """The same bucket and prefix with changed :class:`S3Options`."""
        return S3Store(self.bucket, self.prefix, replace(self.options, **changes))

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"


if TYPE_CHECKING:
    # static checks that the class satisfies the protocol it claims (runtime_checkable
    # compares method names only); mypy fails here on a regression
    from shardpoint_core.stores.base import ByteStore, ReplaceableStore

    def _is_bytestore_s3store(x: S3Store) -> ByteStore:
        return x

    def _is_replaceablestore_s3store(x: S3Store) -> ReplaceableStore:
        return x
