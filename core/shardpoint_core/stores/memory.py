"""A store in this process's memory: fast tests, and ``memory://name`` checkpoints that a
save and a later load in the same process share.

Objects are immutable ``bytes`` under a lock, so readers on many threads see whole objects
only. Named stores (``MemoryStore.named("x")``) live until :func:`MemoryStore.drop` or the
process ends; an anonymous ``MemoryStore()`` is freed with its last reference.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import TYPE_CHECKING, Dict, Iterable, Iterator, Optional, Tuple

from shardpoint_core.stores.base import ObjectInfo, PutData, StoreCapabilities
from shardpoint_core.stores.keys import check_key, check_prefix

_Entry = Tuple[bytes, float, int]  # data, mtime, version


class _Bucket:
    """The shared objects of one named (or anonymous) memory store."""

    def __init__(self) -> None:
        self.objects: Dict[str, _Entry] = {}
        self.lock = threading.Lock()


_NAMED: Dict[str, _Bucket] = {}
_NAMED_LOCK = threading.Lock()
_VERSIONS = itertools.count(1)


def _join(data: PutData) -> bytes:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(memoryview(data).cast("B")) if isinstance(data, memoryview) else bytes(data)
    return b"".join(memoryview(b).cast("B") for b in data)


class MemoryStore:
    """A :class:`~shardpoint_core.stores.base.ByteStore` in memory. ``prefix`` roots this
    view below a key of the bucket (``memory://name/run/step_1`` is bucket ``name``, prefix
    ``run/step_1/``): views of one bucket see each other's objects."""

    capabilities = StoreCapabilities(conditional_put=True, ranged_get=True, durable_put=True)

    def __init__(
        self, *, _bucket: Optional[_Bucket] = None, _name: str = "", prefix: str = ""
    ) -> None:
        self._b = _bucket if _bucket is not None else _Bucket()
        self._name = _name
        if prefix:
            check_key(prefix.strip("/"))
            prefix = prefix.strip("/") + "/"
        self._prefix = prefix
        self.url = (
            f"memory://{_name}/{prefix}".rstrip("/")
            if _name
            else f"memory://<anonymous {id(self._b):x}>/{prefix}".rstrip("/")
        )

    @classmethod
    def named(cls, name: str, prefix: str = "") -> "MemoryStore":
        """The process-wide store ``name`` (made on first use), rooted at ``prefix``."""
        check_key(name)
        if "/" in name:
            raise ValueError(f"memory store name {name!r} holds a '/'")
        with _NAMED_LOCK:
            bucket = _NAMED.setdefault(name, _Bucket())
        return cls(_bucket=bucket, _name=name, prefix=prefix)

    @staticmethod
    def drop(name: str) -> None:
        """Forget the named store ``name`` and its objects (tests clean up with this)."""
        with _NAMED_LOCK:
            _NAMED.pop(name, None)

    def __repr__(self) -> str:
        return f"MemoryStore({self.url!r})"

    def child(self, prefix: str) -> "MemoryStore":
        """A view of the same objects rooted at ``prefix`` below this one."""
        check_key(prefix.strip("/"))
        return MemoryStore(
            _bucket=self._b, _name=self._name, prefix=self._prefix + prefix.strip("/")
        )

    def _entry(self, key: str) -> _Entry:
        full = self._prefix + check_key(key)
        with self._b.lock:
            e = self._b.objects.get(full)
        if e is None:
            raise FileNotFoundError(2, "no such object", f"{self.url}/{key}")
        return e

    def get(self, key: str) -> bytes:
        return self._entry(key)[0]

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise ValueError(f"bad range start={start} length={length}")
        return self._entry(key)[0][start : start + length]

    def get_suffix(self, key: str, length: int) -> Tuple[bytes, int]:
        """(the last ``length`` bytes of ``key``, or all of it where shorter; its size)."""
        data = self._entry(key)[0]
        return data[max(0, len(data) - length) :], len(data)

    def get_versioned(self, key: str, length: int) -> Tuple[bytes, ObjectInfo]:
        """(the first ``length`` bytes of ``key``; its :class:`ObjectInfo`), both of one
        version of the object (see :meth:`S3Store.get_versioned`)."""
        data, mtime, version = self._entry(key)
        return data[: max(0, length)], ObjectInfo(key, len(data), mtime, str(version))

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        out = memoryview(out).cast("B")
        data = self._entry(key)[0]
        if start < 0 or start + len(out) > len(data):
            raise EOFError(
                f"{self.url}/{key}: {len(out)} bytes from {start} asked, the "
                f"object holds {len(data)}"
            )
        out[:] = memoryview(data)[start : start + len(out)]  # no chunk-sized copy

    def put(self, key: str, data: PutData, *, if_absent: bool = False) -> None:
        full = self._prefix + check_key(key)
        blob = _join(data)
        with self._b.lock:
            if if_absent and full in self._b.objects:
                raise FileExistsError(17, "object exists", f"{self.url}/{key}")
            self._b.objects[full] = (blob, time.time(), next(_VERSIONS))

    def head(self, key: str) -> Optional[ObjectInfo]:
        full = self._prefix + check_key(key)
        with self._b.lock:
            e = self._b.objects.get(full)
        if e is None:
            return None
        return ObjectInfo(key, len(e[0]), e[1], str(e[2]))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        full = self._prefix + check_prefix(prefix)
        n = len(self._prefix)
        with self._b.lock:
            items = [(k[n:], e) for k, e in self._b.objects.items() if k.startswith(full)]
        for k, e in sorted(items, key=lambda t: t[0]):
            yield ObjectInfo(k, len(e[0]), e[1], str(e[2]))

    def delete(self, keys: Iterable[str]) -> None:
        fulls = [self._prefix + check_key(k) for k in keys]
        with self._b.lock:
            for f in fulls:
                self._b.objects.pop(f, None)

    def make_durable(self, keys: Optional[Iterable[str]] = None) -> None:
        """Nothing to do: memory is as durable as it gets (the process)."""
        return None


if TYPE_CHECKING:
    # static checks that the class satisfies the protocol it claims (runtime_checkable
    # compares method names only); mypy fails here on a regression
    from shardpoint_core.stores.base import ByteStore

    def _is_bytestore_memorystore(x: MemoryStore) -> ByteStore:
        return x
