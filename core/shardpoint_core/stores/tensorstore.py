"""A :class:`~shardpoint_core.stores.base.ByteStore` over TensorStore's key-value stores (its
C++ ``file``, ``memory``, ``s3`` and ``gcs`` kvstore drivers).

``TensorStoreStore("s3://bucket/run")`` (or ``file:///dir``, a plain path, ``memory://name/p``,
``gs://bucket/p``) opens the driver of that scheme; the registry selects it for
``tensorstore+<scheme>://...`` paths (:mod:`.registry`). TensorStore is imported on first
use, so the core imports without it.

Why these choices:
- Conditional writes are TensorStore's generations: ``put(if_absent=True)`` writes only where
  the key has no value, ``put(if_match=version)`` only over that generation; a write whose
  condition fails returns no generation and becomes ``FileExistsError`` (``FileNotFoundError``
  for ``if_match`` on a key that is gone). They are atomic on ``file`` (a lock file and a
  rename), ``memory`` (one mutex), ``gcs`` (``ifGenerationMatch``) and ``s3`` with
  ``conditional_writes`` (``If-None-Match``/``If-Match``; TensorStore's own default on a
  non-AWS endpoint is a HEAD before the PUT, which is not atomic, so this store asks for the
  headers, as :class:`~.s3.S3Store` does).
- TensorStore exposes neither an object's size nor its modification time beside its bytes.
  ``head`` on ``file`` stats the file; elsewhere the size comes from the one request that
  names it (a read past the end, refused with the object's size), and ``mtime`` is the time
  of the request: off ``file`` a lease's age therefore never grows, so recovery there does
  not reclaim a dead save's prefix by age (:class:`~.s3.S3Store` does). ``list`` costs one
  such request per key off ``file`` and carries no version. For these reasons the plain
  schemes keep their own stores (``benchmarks/RESULTS.md``, "Byte stores").
- Every wait is bounded (``timeout_s``) and requests are retried a bounded number of times;
  every TensorStore error becomes one of the core's (``FileNotFoundError``,
  ``FileExistsError``, :class:`~shardpoint_core.format.errors.StoreUnavailableError`, ...).
- A vectored ``put`` is joined into one ``bytes`` (TensorStore takes one value); objects over
  5 GiB cannot go to ``s3`` (TensorStore has no multipart upload).

Example::

    store = TensorStoreStore("memory://demo/run")
    v = store.put("a/b", [b"hello ", b"world"], if_absent=True)
    store.put("a/b", b"again", if_match=v)
    assert store.get_range("a/b", 0, 5) == b"again"
"""

from __future__ import annotations

import errno
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple
from urllib.parse import urlsplit

from shardpoint_core.format.errors import (
    InvalidKeyError,
    InvalidOptionError,
    StoreAccessDeniedError,
    StoreNotFoundError,
    StoreUnavailableError,
)
from shardpoint_core.stores.base import ObjectInfo, PutData, StoreCapabilities
from shardpoint_core.stores.keys import check_key, check_prefix

NO_VALUE = b"\x02"  # TensorStore's generation of a key without a value
_PAST_END = 1 << 62  # a start no object reaches: the refusal names the size
_SIZE = re.compile(r"value of size (\d+)|total size (\d+)|<ActualObjectSize>(\d+)<")
_OS_ERRNO = re.compile(r"os_error_code='(\d+)'")
_BATCH = 256  # keys whose sizes are asked at once in a listing
_NAMED: Dict[str, Any] = {}  # memory store name -> the TensorStore Context holding it
_NAMED_LOCK = threading.Lock()
_TRANSIENT = ("UNAVAILABLE", "ABORTED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED")


@dataclass(frozen=True)
class TensorStoreOptions:
    """How to reach the driver. ``None`` fields fall back to the standard environment
    (``AWS_ENDPOINT_URL``, ``AWS_REGION``/``AWS_DEFAULT_REGION``, AWS credentials;
    ``TENSORSTORE_GCS_HTTP_URL`` and Google credentials for ``gcs``)."""

    endpoint_url: Optional[str] = None  # s3: an S3-compatible endpoint
    region: Optional[str] = None  # s3
    conditional_writes: bool = True  # s3: the server honours If-None-Match / If-Match
    file_sync: bool = True  # file: fsync every write before it returns
    max_retries: int = 6  # per request, on transient errors
    concurrency: int = 32  # requests in flight (s3, gcs)
    timeout_s: float = 300.0  # the longest wait for one request's answer

    def __post_init__(self) -> None:
        if self.max_retries < 1 or self.concurrency < 1 or not self.timeout_s > 0:
            raise InvalidOptionError(
                "TensorStoreOptions: max_retries and concurrency must be >= 1 and timeout_s > 0"
            )


def _ts() -> Any:
    try:
        import tensorstore
    except ImportError as e:  # an optional dependency: say which extra brings it
        raise InvalidOptionError(
            "TensorStoreStore needs the 'tensorstore' package (pip install tensorstore)"
        ) from e
    return tensorstore


def parse_url(url: str) -> Tuple[str, str, str]:
    """``(driver, bucket or root, prefix)`` of a store URL: ``file:///dir`` or a plain path
    (``file``, the directory, ""), ``memory://name/prefix``, ``s3://bucket/prefix``,
    ``gs://bucket/prefix``; a leading ``tensorstore+`` in the scheme is dropped."""
    p = os.fspath(url)
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", p)
    if m is None:
        return "file", os.path.abspath(p), ""
    scheme = m.group(1).lower()
    if scheme.startswith("tensorstore+"):
        scheme = scheme[len("tensorstore+") :]
    rest = p[m.end() :]
    if scheme == "file":
        if rest.startswith("localhost/"):
            rest = rest[len("localhost") :]
        rest = rest or "/"  # the registry's root of tensorstore+file:///a/b
        if not rest.startswith("/"):
            raise InvalidOptionError(f"{url!r}: a file:// URL names an absolute path")
        return "file", os.path.normpath(rest), ""
    driver = {"memory": "memory", "s3": "s3", "gs": "gcs"}.get(scheme)
    if driver is None:
        raise InvalidOptionError(
            f"{url!r}: TensorStoreStore opens file://, memory://, s3:// and gs:// URLs"
        )
    parts = urlsplit(f"x://{rest}")
    prefix = parts.path.strip("/")
    if not parts.netloc or (prefix and any(c in ("", ".", "..") for c in prefix.split("/"))):
        raise InvalidOptionError(
            f"{url!r}: the URL is {scheme}://NAME/PREFIX, and the prefix "
            "has no empty, '.' or '..' component"
        )
    return driver, parts.netloc, prefix


def _join(data: PutData) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, (bytearray, memoryview)):
        return bytes(memoryview(data).cast("B"))
    return b"".join(memoryview(b).cast("B") for b in data)


class TensorStoreStore:
    """Objects below one root of a TensorStore kvstore. Thread-safe (TensorStore is)."""

    def __init__(self, url: str, options: Optional[TensorStoreOptions] = None) -> None:
        self.driver, self.bucket, self.prefix = parse_url(url)
        self.options = options or TensorStoreOptions()
        self._p = self.prefix + "/" if self.prefix else ""
        if self.driver == "file":
            self.root = self.bucket
            self.url = f"file://{self.root}"
        else:
            scheme = "gs" if self.driver == "gcs" else self.driver
            self.url = f"{scheme}://{self.bucket}/{self.prefix}".rstrip("/")
        cond = self.options.conditional_writes or self.driver != "s3"
        self.capabilities = StoreCapabilities(
            conditional_put=cond,
            conditional_replace=cond,
            ranged_get=True,
            durable_put=self.driver != "file" or self.options.file_sync,
        )
        self._kv: Any = None
        self._lock = threading.Lock()
        self._written: set[Any] = set()

    def __repr__(self) -> str:
        return f"TensorStoreStore({self.url!r}, driver={self.driver!r})"

    def with_options(self, **changes: Any) -> "TensorStoreStore":
        """The same root with changed :class:`TensorStoreOptions`."""
        return TensorStoreStore(self.url, replace(self.options, **changes))

    def kvstore_spec(self) -> dict[str, Any]:
        """The TensorStore kvstore spec of this store's root (what a third-party reader
        passes to TensorStore to reach the same bytes)."""
        return self._spec()[0]

    # -- the kvstore ----------------------------------------------------------------------
    def _spec(self) -> Tuple[dict[str, Any], dict[str, Any]]:
        """(kvstore spec, context spec) of this store."""
        o = self.options
        retries = {"max_retries": o.max_retries, "initial_delay": "0.05s", "max_delay": "2s"}
        if self.driver == "file":
            return (
                {"driver": "file", "path": self.root.rstrip("/") + "/"},
                {"file_io_sync": o.file_sync},
            )
        if self.driver == "memory":
            return {"driver": "memory", "path": self._p}, {}
        if self.driver == "s3":
            spec: dict[str, Any] = {
                "driver": "s3",
                "bucket": self.bucket,
                "path": self._p,
                "use_conditional_write": bool(o.conditional_writes),
            }
            endpoint = (
                o.endpoint_url
                or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL")
            )
            if endpoint:
                spec["endpoint"] = endpoint
            region = (
                o.region
                or os.environ.get("AWS_REGION")
                or os.environ.get("AWS_DEFAULT_REGION")
                or ("us-east-1" if endpoint else None)
            )
            if region:
                spec["aws_region"] = region
            if os.environ.get("AWS_ACCESS_KEY_ID") and not os.environ.get("AWS_PROFILE"):
                spec["aws_credentials"] = {"type": "environment"}
            return spec, {
                "s3_request_retries": retries,
                "s3_request_concurrency": {"limit": o.concurrency},
            }
        return (
            {"driver": "gcs", "bucket": self.bucket, "path": self._p},
            {"gcs_request_retries": retries, "gcs_request_concurrency": {"limit": o.concurrency}},
        )

    @property
    def kv(self) -> Any:
        """The open ``tensorstore.KvStore`` (opened on first use)."""
        if self._kv is None:
            with self._lock:
                if self._kv is None:
                    self._kv = self._open()
        return self._kv

    def _open(self) -> Any:
        ts = _ts()
        spec, ctx = self._spec()
        if self.driver == "memory":
            with _NAMED_LOCK:
                context = _NAMED.setdefault(self.bucket, ts.Context())
        else:
            context = ts.Context(ctx)
        return self._wait(lambda: ts.KvStore.open(spec, context=context), "", "open")

    @staticmethod
    def drop(name: str) -> None:
        """Forget the memory store ``name`` and its objects (tests clean up with this)."""
        with _NAMED_LOCK:
            _NAMED.pop(name, None)

    # -- errors ---------------------------------------------------------------------------
    def _where(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    def _error(self, exc: BaseException, key: str, what: str) -> BaseException:
        """The core's error for a TensorStore failure of ``what`` on ``key``."""
        where = self._where(key)
        msg = str(exc)
        code = msg.split(":", 1)[0].strip() if ":" in msg else ""
        if isinstance(exc, TimeoutError):
            return StoreUnavailableError(
                f"{what} of {where}: no answer within {self.options.timeout_s} s"
            )
        if msg.startswith("Invalid key") or "Invalid S3 object name" in msg:
            return InvalidKeyError(
                f"store key {key!r} is refused by TensorStore's {self.driver} driver ({msg[:200]})"
            )
        if what == "open" and code not in _TRANSIENT:
            return InvalidOptionError(
                f"TensorStore cannot open {self.url} with the {self.driver} driver: {msg[:300]}"
            )
        if "NoSuchBucket" in msg:
            return StoreNotFoundError(
                f"bucket {self.bucket!r} does not exist ({what} of "
                f"{where}); create it or fix the bucket in the URL"
            )
        if code in ("PERMISSION_DENIED", "UNAUTHENTICATED"):
            return StoreAccessDeniedError(
                f"{what} of {where} was refused ({msg[:300]}); check "
                "the credentials and the bucket's policy"
            )
        if code in _TRANSIENT:
            return StoreUnavailableError(
                f"{what} of {where}: the store kept failing after "
                f"{self.options.max_retries} attempts ({msg[:300]})"
            )
        if code == "NOT_FOUND":
            return FileNotFoundError(errno.ENOENT, f"no object {where}", where)
        m = _OS_ERRNO.search(msg)
        if m is not None:
            n = int(m.group(1))
            return OSError(n, f"{what} of {where} failed: {os.strerror(n)}", where)
        return OSError(f"{what} of {where} failed: {msg[:500]}")

    def _wait(self, make: Callable[[], Any], key: str, what: str) -> Any:
        """The result of the future ``make()`` starts (TensorStore also raises when a
        request is refused before it starts), within ``timeout_s``, or the core's error."""
        try:
            return make().result(timeout=self.options.timeout_s)
        except (ValueError, RuntimeError, OSError, TimeoutError) as e:
            if isinstance(e, (FileNotFoundError, FileExistsError)) or type(e).__module__.startswith(
                "shardpoint"
            ):
                raise
            raise self._error(e, key, what) from e

    # -- reads ----------------------------------------------------------------------------
    def _read(self, key: str, what: str, byte_range: Optional[slice] = None) -> Any:
        """The ReadResult of ``key`` (a value) or ``FileNotFoundError``; ``EOFError`` where
        ``byte_range`` is out of the object."""
        check_key(key)
        kv = self.kv
        try:
            fut = kv.read(key) if byte_range is None else kv.read(key, byte_range=byte_range)
            r = fut.result(timeout=self.options.timeout_s)
        except (ValueError, RuntimeError, TimeoutError) as e:
            if str(e).startswith("OUT_OF_RANGE"):
                raise EOFError(str(e)) from e
            raise self._error(e, key, what) from e
        if r.state != "value":
            raise FileNotFoundError(errno.ENOENT, f"no object {self._where(key)}", self._where(key))
        return r

    def get(self, key: str) -> bytes:
        """The whole object at ``key``."""
        return bytes(self._read(key, "read").value)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes from ``start``, fewer where the object ends: one ranged read
        (two where the range runs past the end: TensorStore refuses such a range)."""
        if start < 0 or length < 0:
            raise ValueError(f"bad range start={start} length={length}")
        if length == 0:
            self._read(key, "read", slice(0, 0))
            return b""
        try:
            return bytes(self._read(key, "ranged read", slice(start, start + length)).value)
        except EOFError:
            pass
        try:
            return bytes(self._read(key, "ranged read", slice(start, None)).value)
        except EOFError:
            return b""

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        """Fill ``out`` from ``start`` (``EOFError`` where the object is shorter)."""
        out = memoryview(out).cast("B")
        if len(out) == 0:
            return
        try:
            data = self._read(key, "ranged read", slice(start, start + len(out))).value
        except EOFError as e:
            raise EOFError(
                f"{self._where(key)}: {len(out)} bytes from {start} asked, past the object's end"
            ) from e
        out[:] = data

    def _size(self, key: str) -> int:
        """The object's size: a stat on files, elsewhere the refusal of a read past the end
        (it names the size), else (a driver that does not say it) the whole object's."""
        if self.driver == "file":
            try:
                return os.stat(os.path.join(self.root, check_key(key))).st_size
            except (FileNotFoundError, NotADirectoryError):
                raise FileNotFoundError(
                    errno.ENOENT, f"no object {self._where(key)}", self._where(key)
                ) from None
        try:
            r = self._read(key, "size", slice(_PAST_END, None))
        except EOFError as e:
            m = _SIZE.search(str(e))
            if m is not None:
                return int(next(g for g in m.groups() if g is not None))
            return len(self.get(key))
        return _PAST_END + len(r.value)  # never: no object is that big

    def _info(self, key: str, stamp: Any, size: Optional[int] = None) -> ObjectInfo:
        if self.driver == "file":
            try:
                st = os.stat(os.path.join(self.root, key))
            except (FileNotFoundError, NotADirectoryError):
                raise FileNotFoundError(
                    errno.ENOENT, f"no object {self._where(key)}", self._where(key)
                ) from None
            return ObjectInfo(
                key,
                st.st_size if size is None else size,
                st.st_mtime,
                bytes(stamp.generation).hex(),
            )
        return ObjectInfo(
            key,
            self._size(key) if size is None else size,
            float(stamp.time),
            bytes(stamp.generation).hex(),
        )

    def head(self, key: str) -> Optional[ObjectInfo]:
        """Size, time and version (the generation, in hex) of ``key``, or None."""
        try:
            r = self._read(key, "head", slice(0, 0))
            return self._info(key, r.stamp)
        except FileNotFoundError as e:
            if isinstance(e, StoreNotFoundError):
                raise
            return None

    def get_versioned(self, key: str, length: int) -> Tuple[bytes, ObjectInfo]:
        """(the first ``length`` bytes of ``key``, all of it where shorter; its
        :class:`ObjectInfo`), the version the one of the bytes read: the size first, then
        one read of at most ``length`` bytes (memory stays bounded by ``length``)."""
        length = max(1, length)
        size = self._size(key)
        if size <= length:  # (replaced meanwhile by a longer one: cut, its size said)
            r = self._read(key, "read")
            data = bytes(r.value)
            return data[:length], self._info(key, r.stamp, len(data))
        r = self._read(key, "read", slice(0, length))
        return bytes(r.value), self._info(key, r.stamp, size)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object below ``prefix``, in key order (sizes asked in batches; no version:
        TensorStore's listing has none)."""
        ts = _ts()
        p = check_prefix(prefix).encode()
        rng = ts.KvStore.KeyRange(p, _successor(p)) if p else ts.KvStore.KeyRange()
        kv = self.kv
        keys = sorted(k.decode() for k in self._wait(lambda: kv.list(rng), prefix, "list"))
        for i in range(0, len(keys), _BATCH):
            batch = keys[i : i + _BATCH]
            for _key, info in zip(batch, self._infos(batch)):
                if info is not None:
                    yield info

    def _infos(self, keys: List[str]) -> List[Optional[ObjectInfo]]:
        """ObjectInfo (None: gone meanwhile) of each key: stats on files; elsewhere the
        size refusals, all in flight at once."""
        out: List[Optional[ObjectInfo]] = []
        if self.driver == "file":
            for k in keys:
                try:
                    st = os.stat(os.path.join(self.root, k))
                except (FileNotFoundError, NotADirectoryError):
                    out.append(None)
                    continue
                out.append(ObjectInfo(k, st.st_size, st.st_mtime))
            return out
        kv = self.kv

        def size_read(k: str) -> Callable[[], Any]:
            return lambda: _Ready(kv.read(k, byte_range=slice(_PAST_END, None)))

        futs = [self._wait(size_read(k), k, "size") for k in keys]
        for k, f in zip(keys, futs):
            try:
                if f.result(timeout=self.options.timeout_s).state != "value":
                    out.append(None)  # deleted since the listing
                    continue
                size = None
            except (ValueError, RuntimeError, TimeoutError) as e:
                m = _SIZE.search(str(e))
                size = int(next(g for g in m.groups() if g is not None)) if m else None
            try:
                out.append(ObjectInfo(k, self._size(k) if size is None else size, time.time()))
            except FileNotFoundError:
                out.append(None)
        return out

    # -- writes ---------------------------------------------------------------------------
    def put(
        self, key: str, data: PutData, *, if_absent: bool = False, if_match: Optional[str] = None
    ) -> str:
        """Store ``data`` at ``key``; returns the new version. ``if_absent``: only where
        ``key`` has no value; ``if_match``: only over that version. A failed condition is
        ``FileExistsError`` (``FileNotFoundError`` where ``if_match`` finds no object)."""
        check_key(key)
        if (if_absent or if_match) and not self.capabilities.conditional_put:
            raise InvalidOptionError(
                f"{self.url}: a conditional write was asked for but "
                "TensorStoreOptions(conditional_writes=False) says the "
                "server has none"
            )
        cond: Optional[bytes] = None
        if if_absent:
            cond = NO_VALUE
        elif if_match:
            try:
                cond = bytes.fromhex(if_match)
            except ValueError:
                raise FileExistsError(
                    errno.EEXIST,
                    f"conditional write of {self._where(key)}"
                    f" refused: {if_match!r} is no version of this store",
                    self._where(key),
                ) from None
        blob = _join(data)
        kv = self.kv
        gen = bytes(
            self._wait(
                lambda: kv.write(key, blob) if cond is None else kv.write(key, blob, if_equal=cond),
                key,
                "write",
            ).generation
        )
        if cond is not None and not gen:
            if if_match and not if_absent and self.head(key) is None:
                raise FileNotFoundError(
                    errno.ENOENT,
                    f"conditional write of {self._where(key)}: no object to replace",
                    self._where(key),
                )
            raise FileExistsError(
                errno.EEXIST,
                f"conditional write of {self._where(key)} "
                "refused: the object exists or changed meanwhile",
                self._where(key),
            )
        if self.driver == "file" and not self.options.file_sync:
            with self._lock:
                self._written.add(key)
        return gen.hex()

    def delete(self, keys: Iterable[str]) -> None:
        """Remove these objects (all requests in flight at once); missing ones are not an
        error. On files, directories the delete left empty go too (as :class:`FileStore`)."""
        ks = [check_key(k) for k in keys]
        kv = self.kv

        def removal(k: str) -> Callable[[], Any]:
            return lambda: _Ready(kv.write(k, None))

        def done(f: Any) -> Callable[[], Any]:
            return lambda: f

        futs = [self._wait(removal(k), k, "delete") for k in ks]
        for k, f in zip(ks, futs):  # all in flight, then each awaited
            self._wait(done(f), k, "delete")
        if self.driver == "file":
            for k in ks:
                d = os.path.dirname(os.path.join(self.root, k))
                while d != self.root and d.startswith(self.root + os.sep):
                    try:
                        os.rmdir(d)
                    except OSError:
                        break
                    d = os.path.dirname(d)

    def make_durable(self, keys: Optional[Iterable[str]] = None) -> None:
        """Nothing where every write is durable when it returns (object stores, memory,
        files with ``file_sync``); else an fsync of each file put (or of ``keys``) and of
        the directories up to the root."""
        if self.capabilities.durable_put:
            return
        with self._lock:
            if keys is None:
                todo, self._written = sorted(self._written), set()
            else:
                todo = [check_key(k) for k in keys]
                self._written.difference_update(todo)
        paths = {os.path.join(self.root, k) for k in todo}
        dirs: set[Any] = set()
        for p in list(paths):
            d = os.path.dirname(p)
            while d.startswith(self.root) and d not in dirs:
                dirs.add(d)
                d = os.path.dirname(d)
        paths |= dirs
        files = sorted(p for p in paths if p not in dirs)
        with ThreadPoolExecutor(max(1, min(16, len(files)))) as pool:
            list(pool.map(_fsync, files))  # the files, in parallel, then
        for d in sorted(dirs, key=lambda q: -q.count(os.sep)):  # their directories
            _fsync(d)


def _fsync(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Ready:
    """A started future handed through :meth:`TensorStoreStore._wait` unawaited (so a
    refusal at the start maps like any error), its ``result`` the future itself."""

    def __init__(self, future: Any) -> None:
        self.future = future

    def result(self, timeout: float) -> Any:
        return self.future


def _successor(prefix: bytes) -> bytes:
    """The least key above every key that starts with ``prefix`` (b"" where none is)."""
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    if not p:
        return b""
    p[-1] += 1
    return bytes(p)


if TYPE_CHECKING:
    # static checks that the class satisfies the protocol it claims (runtime_checkable
    # compares method names only); mypy fails here on a regression
    from shardpoint_core.stores.base import ByteStore, ReplaceableStore

    def _is_bytestore_tensorstorestore(x: TensorStoreStore) -> ByteStore:
        return x

    def _is_replaceablestore_tensorstorestore(x: TensorStoreStore) -> ReplaceableStore:
        return x
