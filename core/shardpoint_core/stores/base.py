"""The byte store seam: what the format needs from a place that holds bytes.

A store knows keys and bytes, never tensors, Zarr or manifests: the Zarr layer
(:mod:`shardpoint_core.arrays`) and the committer (:mod:`shardpoint_core.commit`) sit above it,
so a new store (local files, memory, an object store) implements these few methods and
inherits the whole format. Keys are relative ``/``-separated paths below the store's root
(``tensors/model/w/c/0/0``); a key never starts with ``/`` and has no ``.`` or ``..``
component. Stores raise :class:`FileNotFoundError` for a missing key and ``OSError`` (with
``errno`` where there is one) for other I/O failures; the layers above turn those into the
documented :mod:`shardpoint_core.format.errors`.

Call order in a save (any rank that writes): ``put`` ... then ``make_durable`` once; the
committer then publishes. In a load: ``get``/``get_range``/``read_into`` from any thread.
``list`` and ``delete`` are the committer's and recovery's (coordinator only).

Example::

    store = MemoryStore()
    store.put("a/b", [b"hello ", b"world"])     # vectored: the pieces are concatenated
    assert store.get_range("a/b", 6, 5) == b"world"
    assert [i.key for i in store.list("a/")] == ["a/b"]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Callable,
    Iterable,
    Iterator,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    Union,
    cast,
    runtime_checkable,
)

if TYPE_CHECKING:
    # anything with the buffer protocol (PEP 688): bytes, bytearray, memoryview, contiguous
    # numpy arrays, which callers put as they are
    from typing_extensions import Buffer as Buffer
else:
    Buffer = Union[bytes, bytearray, memoryview]

# What ``put`` takes: one bytes-like object, or a sequence of buffers (numpy arrays among
# them) written as one object in order. A lone numpy array is not one buffer here: wrap it
# in a list (stores tell one buffer from a sequence by these three types).
PutData = Union[bytes, bytearray, memoryview, Sequence["Buffer"]]

# The optional methods of a ByteStore (see its docstring), as the layers above look them up
# (``getattr(store, "get_suffix", None)``): ``get_suffix(key, length) -> (bytes, size)``,
# ``get_versioned(key, length) -> (bytes, ObjectInfo)``.
SuffixRead = Callable[[str, int], Tuple[bytes, int]]
VersionedRead = Callable[[str, int], Tuple[bytes, "ObjectInfo"]]


@dataclass(frozen=True)
class StoreCapabilities:
    """What a store can do beyond the basic methods; the layers above choose their protocol
    from these (``supports_*`` in the house style), and tests skip with these as reasons."""

    atomic_rename: bool = False  # directories rename atomically (POSIX): commit by rename
    conditional_put: bool = False  # put(..., if_absent=True) is atomic on the server
    ranged_get: bool = True  # get_range reads only the bytes asked for
    local_path: bool = False  # keys are files below a local directory (fast paths)
    durable_put: bool = False  # a put is durable when it returns (object stores)
    conditional_replace: bool = False  # put(..., if_match=version) is atomic (S3 If-Match)


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: its key, size in bytes, modification time (seconds since the
    epoch) and an opaque version tag (inode+mtime on files, the ETag on object stores)."""

    key: str
    size: int
    mtime: float
    version: str = ""


@runtime_checkable
class ByteStore(Protocol):
    """Bytes under keys below one root. Thread-safe: a load reads from many threads."""

    url: str
    capabilities: StoreCapabilities

    def get(self, key: str) -> bytes:
        """The whole object at ``key``."""

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``key`` from ``start``; fewer only where the object ends."""

    # Optional (the Zarr layer falls back to ``head`` + ``get_range`` without it):
    # ``get_suffix(key, length) -> (bytes, size)``: the last ``length`` bytes of ``key``
    # (all of it where shorter) and the object's size, in one request where the store
    # can (S3's ``Range: bytes=-N``): a shard's index without a HEAD first.
    # ``get_versioned(key, length) -> (bytes, ObjectInfo)``: the first ``length`` bytes of
    # ``key`` and the info (size, version) of the object they were read from, in one
    # request (S3: a ranged GET's ETag and ``Content-Range``): a manifest and the version
    # a commit's ``If-Match`` or a load's identity check names, without a HEAD beside it.

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of ``key`` from ``start`` (exactly ``len(out)``;
        ``EOFError`` where the object is shorter): a load lands bytes in its own buffers."""

    def put(self, key: str, data: PutData, *, if_absent: bool = False) -> Optional[str]:
        """Store ``data`` (one buffer, or several written as one object, in order) at ``key``.
        ``if_absent``: fail with ``FileExistsError`` where ``key`` exists (atomic where
        ``capabilities.conditional_put``). Buffers must not change until this returns.
        Returns the new object's version where the store has versions (S3's ETag, GCS's
        generation), else None. Stores with ``capabilities.conditional_replace`` also take
        ``if_match=version``: replace only the object of that version (``FileExistsError``
        otherwise); callers check the capability before passing it."""

    def head(self, key: str) -> Optional[ObjectInfo]:
        """The object's :class:`ObjectInfo`, or None where there is none."""

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, in key order."""

    def delete(self, keys: Iterable[str]) -> None:
        """Remove these objects; keys already gone are not an error."""

    def make_durable(self, keys: Optional[Iterable[str]] = None) -> None:
        """Everything this process put (or ``keys``) survives a crash once this returns:
        fsync/syncfs on files, nothing to do where ``capabilities.durable_put``."""


class ReplaceableStore(ByteStore, Protocol):
    """A :class:`ByteStore` with ``capabilities.conditional_replace``: its ``put`` also takes
    ``if_match`` (replace only the object of that version). See :func:`replaceable`."""

    def put(
        self, key: str, data: PutData, *, if_absent: bool = False, if_match: Optional[str] = None
    ) -> Optional[str]:
        """:meth:`ByteStore.put`, and with ``if_match``: only over the object of that version
        (``FileExistsError`` otherwise)."""


def replaceable(store: ByteStore) -> ReplaceableStore:
    """``store`` as a :class:`ReplaceableStore`; ``ValueError`` where its capabilities do not
    say ``conditional_replace`` (the capability is the promise that ``put`` takes
    ``if_match``)."""
    if not store.capabilities.conditional_replace:
        raise ValueError(f"store {store.url} cannot replace conditionally (no if_match)")
    # the capability is the store's statement that put takes if_match; runtime_checkable
    # cannot tell signatures apart, so the narrowing is a cast
    return cast(ReplaceableStore, store)
