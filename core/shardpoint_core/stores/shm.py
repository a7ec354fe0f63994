"""The memory tier's store: ``shm://<job>/...`` objects in the host's shared memory, replicated
to ``k`` other hosts, read back from any host that still holds them.

Objects are files below ``<shm_dir>/<job>`` (``shm_dir``: ``$SHARDPOINT_SHM_DIR``, else
``/dev/shm/shardpoint``): a tmpfs, so they outlive the training process (a restarted job finds
them) but not the host. Each file holds the object's bytes exactly, with its crc32c in a
sidecar (:mod:`.shm_host`), so every copy is checked before its bytes are used: a damaged copy
is treated as absent and the next host's copy is read instead; never are corrupt bytes
returned. A put writes a temporary file and renames it into place (``link`` for a
conditional put), so readers see whole objects only.

Replication (after :meth:`ShmStore.set_peers`, which the torch front end's
:class:`shardpoint.api.memory_tier.MemoryTier` calls): a ``put`` writes here, then sends the
object to the next ``k`` hosts of the ring over the side channel (:mod:`.peers`) and returns
only once they all hold it; a peer that fails fails the put. The commit marker of a memory
checkpoint is an object like the others (the object-store committer's protocol, format.md
9.1), written by the coordinator after every rank's puts returned: a checkpoint is committed
only when every piece has its replicas. Reads look here first, then ask the other hosts; a
copy fetched from a peer is kept here (best effort, within the budget). ``list`` and
``delete`` span every reachable host.

Memory budget: ``budget_bytes`` per host; a put that would take this host (as this process
sees it: what was there when it first looked, plus what it put) past it raises
:class:`~shardpoint_core.format.errors.MemoryBudgetError` before writing. Nothing here evicts:
old steps go only when their owner deletes them.

Example::

    store = ShmStore.named("job")                  # what "shm://job/..." paths use
    store.put("step_1/a", b"bytes")
    assert store.get("step_1/a") == b"bytes"
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import crc32c

from shardpoint_core.format.errors import (
    InvalidOptionError,
    MemoryBudgetError,
    StoreUnavailableError,
)
from shardpoint_core.stores.base import Buffer, ObjectInfo, PutData, StoreCapabilities
from shardpoint_core.stores.keys import check_key
from shardpoint_core.stores.peers import (
    Body,
    Header,
    Payload,
    PeerClient,
    SendFile,
    request_or_none,
)
from shardpoint_core.stores.shm_host import SIDECAR, HostMemory, _Damaged, version_of

__all__ = ["DEFAULT_DIR", "SIDECAR", "PeerHost", "ShmStore", "too_few_hosts", "version_of"]
DEFAULT_DIR = "/dev/shm/shardpoint"
_NAMED: Dict[str, "ShmStore"] = {}
_NAMED_LOCK = threading.Lock()


def _views(data: PutData) -> List[memoryview]:
    bufs: Sequence[Buffer] = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    return [memoryview(b).cast("B") for b in bufs]


def _crc(views: Iterable[Buffer]) -> int:
    c = 0
    for v in views:
        c = crc32c.crc32c(v, value=c)
    return c


def too_few_hosts(k: int, others: int) -> str:
    """The refusal of a memory save asking for more replicas than there are other hosts."""
    return (
        f"memory tier: k={k} replicas on other hosts asked, the job has {others} other "
        f"host(s); a memory save needs k <= the number of other hosts (replicas on the "
        "same host do not survive its loss): restore, then save with a smaller k or on "
        "more hosts"
    )


@dataclass
class PeerHost:
    """Another host of the job: its name and the side-channel addresses of its ranks (any of
    them serves the host's shared memory)."""

    name: str
    clients: List[PeerClient] = field(default_factory=list)


class ShmStore(HostMemory):
    """A :class:`~shardpoint_core.stores.base.ByteStore` in this host's shared memory below
    ``root`` (:class:`~.shm_host.HostMemory`), replicated to peers once :meth:`set_peers`
    named them (see the module)."""

    capabilities = StoreCapabilities(conditional_put=True, ranged_get=True, durable_put=True)

    def __init__(
        self, root: str, *, name: str = "", budget_bytes: Optional[int] = None, host: str = ""
    ) -> None:
        super().__init__(
            root, url=f"shm://{name}" if name else "", budget_bytes=budget_bytes, host=host
        )
        self._others: List[PeerHost] = []  # the other hosts, ring order after this one
        self.k = 0
        # bytes this process moved over the side channel: replicas sent, objects fetched
        self.counters: Dict[str, int] = {"replica_bytes_sent": 0, "fetched_bytes": 0}

    @classmethod
    def named(cls, job: str) -> "ShmStore":
        """The process-wide store of ``job`` (made on first use, below ``$SHARDPOINT_SHM_DIR``
        or ``/dev/shm/shardpoint``): what ``shm://job/...`` paths open."""
        check_key(job)
        if "/" in job or job.startswith("."):
            raise InvalidOptionError(f"memory-tier job name {job!r} holds a '/' or starts with '.'")
        with _NAMED_LOCK:
            s = _NAMED.get(job)
            if s is None:
                base = os.environ.get("SHARDPOINT_SHM_DIR") or DEFAULT_DIR
                s = _NAMED[job] = cls(os.path.join(base, job), name=job)
        return s

    def configure(
        self,
        *,
        shm_dir: Optional[str] = None,
        budget_bytes: Optional[int] = None,
        host: Optional[str] = None,
    ) -> None:
        """Move the store's root to ``shm_dir/<job>`` and set its budget and host name (the
        tier does this when it starts, before any I/O of the job)."""
        with self._lock:
            if shm_dir is not None:
                self.root = os.path.join(os.path.abspath(shm_dir), os.path.basename(self.root))
                self._used = None
                self._verified.clear()
            if budget_bytes is not None:
                if budget_bytes <= 0:
                    raise InvalidOptionError(
                        f"memory budget_bytes={budget_bytes}: give a "
                        "positive number of bytes per host"
                    )
                self.budget_bytes = budget_bytes
            if host is not None:
                self.host = host

    def set_peers(self, others: Sequence[PeerHost], k: int) -> None:
        """Replicate every put to the first ``k`` of ``others`` (the job's other hosts, in
        ring order after this one) and read from any of them. With ``k`` > ``len(others)``
        (a job restarted on fewer hosts) reads work and puts are refused
        (:class:`InvalidOptionError`): replicas on one host do not survive its loss."""
        if k < 0:
            raise InvalidOptionError(f"memory tier: k={k} replicas; give 0 or more")
        with self._lock:
            old, self._others, self.k = self._others, list(others), k
        for h in old:
            for c in h.clients:
                c.close()

    def clear_peers(self) -> None:
        """Back to this host alone (the tier closed)."""
        self.set_peers([], 0)

    def __repr__(self) -> str:
        return f"ShmStore({self.url!r}, root={self.root!r}, k={self.k})"

    # -- the side channel's server side -------------------------------------------------------
    def handle(self, req: Header, payload: Payload) -> Tuple[Header, Body]:
        """Answer one request of another host (:class:`~.peers.PeerServer`'s handler)."""
        op = req.get("op")
        if op == "put":
            try:
                self.install(
                    req["key"],
                    payload.n,
                    payload.copy_to,
                    int(req["crc"]),
                    if_absent=bool(req.get("if_absent")),
                )
            except FileExistsError:
                return {"status": "exists"}, ()
            except MemoryBudgetError as e:
                return {"status": "budget", "msg": str(e)}, ()
            return {"status": "ok"}, ()
        if op == "get":
            try:
                got = self._checked_fd(req["key"])
            except _Damaged as e:
                return {"status": "damaged", "msg": str(e)}, ()
            if got is None:
                return {"status": "missing"}, ()
            return {"status": "ok", "crc": got[2]}, SendFile(got[0], got[1])
        if op == "head":
            info = self.local_info(req["key"])
            if info is None:
                return {"status": "missing"}, ()
            return {
                "status": "ok",
                "size": info.size,
                "mtime": info.mtime,
                "version": info.version,
            }, ()
        if op == "list":
            return {
                "status": "ok",
                "items": [
                    [i.key, i.size, i.mtime, i.version] for i in self.local_list(req["prefix"])
                ],
            }, ()
        if op == "delete":
            self.local_delete(req["keys"])
            return {"status": "ok"}, ()
        return {"status": "error", "msg": f"unknown op {op!r}"}, ()

    # -- the ByteStore ------------------------------------------------------------------------
    def _answer(self, host: PeerHost, req: Header) -> Optional[Tuple[Header, bytearray]]:
        """The first answer of any rank of ``host``; None where none answers."""
        for c in host.clients:
            got = request_or_none(c, req)
            if got is not None:
                return got
        return None

    def fetch(self, key: str) -> Tuple[Union[bytes, bytearray], int]:
        """(bytes, crc32c) of the first intact copy of ``key`` on another host, kept here too
        where the budget allows. ``FileNotFoundError`` where no reachable host holds one."""
        got = self._fetch(key, keep=True)
        if got is None:
            local = self.local_get(key)
            if local is not None:
                return local
            got = self._fetch(key, keep=False)  # changed meanwhile: once more
        if got is None:
            raise FileNotFoundError(
                errno.ENOENT, "no intact copy here after a fetch", f"{self.url}/{key}"
            )
        return got

    def fetch_here(self, key: str) -> None:
        """Copy ``key`` here, checked, from the first other host with an intact copy.
        ``FileNotFoundError`` where no reachable host holds one; :class:`MemoryBudgetError`
        where this host's budget has no room for it."""
        if self._fetch(key, keep=True, must_keep=True) is not None:
            raise AssertionError("unreachable: a kept copy returns None")

    def _fetch(
        self, key: str, *, keep: bool, must_keep: bool = False
    ) -> Optional[Tuple[bytearray, int]]:
        """Fetch ``key`` from the first other host with an intact copy: streamed into this
        host's memory (``keep``; returns None) or, where the budget refuses it and not
        ``must_keep``, into a buffer (returned with its crc32c)."""
        with self._lock:
            others = list(self._others)
        seen: List[str] = []

        def receive(resp: Header, payload: Payload) -> Tuple[str, Any]:
            if resp.get("status") != "ok":
                return str(resp.get("status")), None
            crc = int(resp["crc"])
            if keep:
                try:
                    self.install(key, payload.n, payload.copy_to, crc)
                    return "kept", None
                except MemoryBudgetError as e:
                    if must_keep:
                        return "budget", e
            data = payload.read_all()
            if crc32c.crc32c(data) != crc:
                return "damaged on its way", None
            return "read", (data, crc)

        for h in others:
            got = None
            for c in h.clients:
                try:
                    got = c.request({"op": "get", "key": key}, (), receive)
                    break
                except StoreUnavailableError as e:
                    seen.append(f"{h.name}: {e}")
            if got is None:
                continue
            status, value = got[1]
            if status == "kept":
                self._count("fetched_bytes", int(got[0].get("n", 0)))
                return None
            if status == "read":
                self._count("fetched_bytes", len(value[0]))
                return value  # type: ignore[no-any-return]
            if status == "budget":
                raise value
            seen.append(f"{h.name}: {status}")
        raise FileNotFoundError(
            errno.ENOENT,
            "no intact copy on this host or any reachable "
            f"one ({'; '.join(seen) or 'no other hosts'})",
            f"{self.url}/{key}",
        )

    def _whole(self, key: str) -> bytes:
        try:
            got = self.local_get(key)
        except _Damaged:
            got = None
        return got[0] if got is not None else bytes(self.fetch(key)[0])

    def get(self, key: str) -> bytes:
        return self._whole(key)

    def _ranged(self, key: str, start: int, length: int, out: Optional[memoryview]) -> bytes:
        """``length`` bytes from ``start`` of a checked copy (into ``out`` when given)."""
        fetched: Optional[Tuple[bytearray, int]] = None
        try:
            got = self._checked_fd(key)
        except _Damaged:
            got = None
        if got is None:
            fetched = self._fetch(key, keep=True)  # None: kept here, checked
            if fetched is None:
                try:
                    got = self._checked_fd(key)
                except _Damaged:
                    got = None
        if got is None:
            data = memoryview(fetched[0] if fetched is not None else self.fetch(key)[0])
            piece = data[start : start + length]
            if out is not None:
                out[: len(piece)] = piece
                return b""
            return bytes(piece)
        fd, size, _crc = got
        try:
            n = max(0, min(length, size - start))
            if out is None:
                return os.pread(fd, n, start) if n else b""
            view, pos = out[:n], 0
            while pos < n:
                r = os.preadv(fd, [view[pos:]], start + pos)
                if r <= 0:
                    break
                pos += r
            return b""
        finally:
            os.close(fd)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise ValueError(f"bad range start={start} length={length}")
        return self._ranged(key, start, length, None)

    def get_suffix(self, key: str, length: int) -> Tuple[bytes, int]:
        """(the last ``length`` bytes of ``key``, or all of it where shorter; its size)."""
        info = self.head(key)
        if info is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", f"{self.url}/{key}")
        start = max(0, info.size - length)
        return self._ranged(key, start, info.size - start, None), info.size

    def get_versioned(self, key: str, length: int) -> Tuple[bytes, ObjectInfo]:
        """(the first ``length`` bytes of ``key``; its :class:`ObjectInfo`), of one copy."""
        try:
            got = self.local_get(key)
        except _Damaged:
            got = None
        whole, crc = got if got is not None else self.fetch(key)
        info = self.local_info(key)
        return bytes(whole[: max(0, length)]), ObjectInfo(
            key, len(whole), info.mtime if info is not None else 0.0, version_of(crc, len(whole))
        )

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        out = memoryview(out).cast("B")
        if start < 0:
            raise ValueError(f"bad range start={start}")
        info = self.head(key)
        if info is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", f"{self.url}/{key}")
        if start + len(out) > info.size:
            raise EOFError(
                f"{self.url}/{key}: {len(out)} bytes from {start} asked, the "
                f"object holds {info.size}"
            )
        self._ranged(key, start, len(out), out)

    def put(self, key: str, data: PutData, *, if_absent: bool = False) -> None:
        with self._lock:
            targets, k = self._others[: self.k], self.k
        if len(targets) < k:
            raise InvalidOptionError(too_few_hosts(k, len(targets)))
        views = _views(data)
        crc = _crc(views)
        self.local_put(key, views, crc, if_absent=if_absent)
        for h in targets:
            got = self._send_put(h, key, views, crc)
            if got is None:
                raise StoreUnavailableError(
                    f"memory tier {self.url}: no rank of host {h.name} took the replica of "
                    f"{key!r}; the memory checkpoint is not committed"
                )
            resp = got[0]
            if resp.get("status") == "ok":
                self._count("replica_bytes_sent", sum(v.nbytes for v in views))
            if resp.get("status") == "budget":
                raise MemoryBudgetError(str(resp.get("msg")))
            if resp.get("status") != "ok":
                raise OSError(
                    errno.EIO,
                    f"replica of {key!r} refused by host {h.name}: "
                    f"{resp.get('status')} {resp.get('msg', '')}",
                    f"{self.url}/{key}",
                )
        return None

    def _count(self, what: str, n: int) -> None:
        with self._lock:
            self.counters[what] += n

    def _send_put(
        self, h: PeerHost, key: str, views: Sequence[memoryview], crc: int
    ) -> Optional[Tuple[Header, bytearray]]:
        for c in h.clients:
            got = request_or_none(c, {"op": "put", "key": key, "crc": crc}, views)
            if got is not None:
                return got
        return None

    def head(self, key: str) -> Optional[ObjectInfo]:
        info = self.local_info(key)
        if info is not None:
            return info
        with self._lock:
            others = list(self._others)
        for h in others:
            got = self._answer(h, {"op": "head", "key": key})
            if got is not None and got[0].get("status") == "ok":
                r = got[0]
                return ObjectInfo(key, int(r["size"]), float(r["mtime"]), str(r["version"]))
        return None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        found = {i.key: i for i in self.local_list(prefix)}
        with self._lock:
            others = list(self._others)
        with ThreadPoolExecutor(max(1, min(16, len(others)))) as pool:  # hosts at once
            answers = list(
                pool.map(lambda h: self._answer(h, {"op": "list", "prefix": prefix}), others)
            )
        for got in answers:
            if got is None or got[0].get("status") != "ok":
                continue
            for k, size, mtime, version in got[0]["items"]:
                found.setdefault(k, ObjectInfo(k, int(size), float(mtime), str(version)))
        for k in sorted(found):
            yield found[k]

    def delete(self, keys: Iterable[str]) -> None:
        keys = [check_key(k) for k in keys]
        self.local_delete(keys)
        with self._lock:
            others = list(self._others)
        for h in others:
            self._answer(h, {"op": "delete", "keys": keys})

    def make_durable(self, keys: Optional[Iterable[str]] = None) -> None:
        """Nothing to do: a put returns once every replica is in place."""
        return None


if TYPE_CHECKING:
    # static checks that the class satisfies the protocol it claims (runtime_checkable
    # compares method names only); mypy fails here on a regression
    from shardpoint_core.stores.base import ByteStore

    def _is_bytestore_shmstore(x: ShmStore) -> ByteStore:
        return x
