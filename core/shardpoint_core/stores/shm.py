"""The memory tier's store: ``shm://<job>/...`` objects in the host's shared memory, replicated
to ``k`` other hosts, read back from any host that still holds them.

Objects are files below ``<shm_dir>/<job>`` (``shm_dir``: ``$SHARDPOINT_SHM_DIR``, else
``/dev/shm/shardpoint``): a tmpfs, so they outlive the training process (a restarted job finds
them) but not the host. Each file is the object's bytes followed by an 8-byte trailer (its
crc32c, little-endian, and ``spm1``), so every copy is checked before its bytes are used: a
damaged copy is treated as absent and the next host's copy is read instead; never are
corrupt bytes returned. A put writes a temporary file and renames it into place (``link``
for a conditional put), so readers see whole objects only.

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
import itertools
import mmap
import os
import stat
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set,
                    Tuple, Union)

import crc32c

from shardpoint_core.format.errors import (InvalidOptionError, MemoryBudgetError,
                                           StoreUnavailableError)
from shardpoint_core.stores.base import Buffer, ObjectInfo, PutData, StoreCapabilities
from shardpoint_core.stores.keys import check_key, check_prefix
from shardpoint_core.stores.peers import (Body, Header, Payload, PeerClient, SendFile,
                                          request_or_none)

SIDECAR = struct.Struct("<IQ")       # crc32c, size: a copy's sidecar (see the module)
DEFAULT_DIR = "/dev/shm/shardpoint"
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_TMP_IDS = itertools.count()
_NAMED: Dict[str, "ShmStore"] = {}
_NAMED_LOCK = threading.Lock()


class _Damaged(Exception):
    """This host's copy of an object fails its crc32c or has no trailer."""


def _views(data: PutData) -> List[memoryview]:
    bufs: Sequence[Buffer] = [data] if isinstance(data, (bytes, bytearray, memoryview)) \
        else data
    return [memoryview(b).cast("B") for b in bufs]


def _crc(views: Iterable[Buffer]) -> int:
    c = 0
    for v in views:
        c = crc32c.crc32c(v, value=c)
    return c


def version_of(crc: int, size: int) -> str:
    """An object's version: its crc32c and size, so every host's copy has the same one (a
    load's identity check sees no change when it reads another host's copy)."""
    return f"{crc:08x}.{size}"


def too_few_hosts(k: int, others: int) -> str:
    """The refusal of a memory save asking for more replicas than there are other hosts."""
    return (f"memory tier: k={k} replicas on other hosts asked, the job has {others} other "
            f"host(s); a memory save needs k <= the number of other hosts (replicas on the "
            "same host do not survive its loss): restore, then save with a smaller k or on "
            "more hosts")


@dataclass
class PeerHost:
    """Another host of the job: its name and the side-channel addresses of its ranks (any of
    them serves the host's shared memory)."""

    name: str
    clients: List[PeerClient] = field(default_factory=list)


class ShmStore:
    """A :class:`~shardpoint_core.stores.base.ByteStore` in this host's shared memory below
    ``root``, replicated to peers once :meth:`set_peers` named them (see the module)."""

    capabilities = StoreCapabilities(conditional_put=True, ranged_get=True, durable_put=True)

    def __init__(self, root: str, *, name: str = "", budget_bytes: Optional[int] = None,
                 host: str = "") -> None:
        self.root = os.path.abspath(root)
        self.url = f"shm://{name}" if name else "shm://" + self.root
        self.budget_bytes, self.host = budget_bytes, host
        self._lock = threading.Lock()
        self._used: Optional[int] = None
        self._verified: Set[Tuple[int, int, int, int]] = set()
        self._others: List[PeerHost] = []     # the other hosts, ring order after this one
        self.k = 0
        # bytes this process moved over the side channel: replicas sent, objects fetched
        self.counters: Dict[str, int] = {"replica_bytes_sent": 0, "fetched_bytes": 0}

    @property
    def _tmp(self) -> str:
        return os.path.join(os.path.dirname(self.root), ".tmp", os.path.basename(self.root))

    @classmethod
    def named(cls, job: str) -> "ShmStore":
        """The process-wide store of ``job`` (made on first use, below ``$SHARDPOINT_SHM_DIR``
        or ``/dev/shm/shardpoint``): what ``shm://job/...`` paths open."""
        check_key(job)
        if "/" in job or job.startswith("."):
            raise InvalidOptionError(f"memory-tier job name {job!r} holds a '/' or starts "
                                     "with '.'")
        with _NAMED_LOCK:
            s = _NAMED.get(job)
            if s is None:
                base = os.environ.get("SHARDPOINT_SHM_DIR") or DEFAULT_DIR
                s = _NAMED[job] = cls(os.path.join(base, job), name=job)
        return s

    def configure(self, *, shm_dir: Optional[str] = None, budget_bytes: Optional[int] = None,
                  host: Optional[str] = None) -> None:
        """Move the store's root to ``shm_dir/<job>`` and set its budget and host name (the
        tier does this when it starts, before any I/O of the job)."""
        with self._lock:
            if shm_dir is not None:
                self.root = os.path.join(os.path.abspath(shm_dir),
                                         os.path.basename(self.root))
                self._used = None
                self._verified.clear()
            if budget_bytes is not None:
                if budget_bytes <= 0:
                    raise InvalidOptionError(f"memory budget_bytes={budget_bytes}: give a "
                                             "positive number of bytes per host")
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

    def path(self, key: str) -> str:
        """The file holding ``key``'s copy on this host."""
        return os.path.join(self.root, *check_key(key).split("/"))

    # -- this host --------------------------------------------------------------------------
    def _open(self, key: str) -> Optional[int]:
        try:
            fd = os.open(self.path(key), os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                return None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        return fd

    def crc_path(self, key: str) -> str:
        """The sidecar of ``key``'s copy here: its crc32c and size (:data:`SIDECAR`), in a
        tree beside the objects' (so a step's directory holds the checkpoint's files only)."""
        return os.path.join(os.path.dirname(self.root), ".crc", os.path.basename(self.root),
                            *check_key(key).split("/"))

    def _sidecar(self, key: str) -> Optional[Tuple[int, int]]:
        """(crc32c, size) the sidecar of ``key`` records; None where there is none."""
        try:
            with open(self.crc_path(key), "rb") as f:
                raw = f.read(SIDECAR.size + 1)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        if len(raw) != SIDECAR.size:
            return None
        crc, size = SIDECAR.unpack(raw)
        return crc, size

    def local_info(self, key: str) -> Optional[ObjectInfo]:
        """This host's copy of ``key`` (unchecked: present, with its sidecar, of the size the
        sidecar records), or None."""
        try:
            st = os.lstat(self.path(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        side = self._sidecar(key)
        if not stat.S_ISREG(st.st_mode) or side is None or side[1] != st.st_size:
            return None
        return ObjectInfo(key, st.st_size, st.st_mtime, version_of(side[0], st.st_size))

    def _checked_fd(self, key: str) -> Optional[Tuple[int, int, int]]:
        """(open fd, size, crc32c) of this host's copy, checked against its sidecar once per
        file version in this process; None where there is none; :class:`_Damaged` where it
        fails (no sidecar, another size, another crc32c)."""
        fd = self._open(key)
        if fd is None:
            return None
        try:
            st = os.fstat(fd)
            side = self._sidecar(key)
            if side is None:
                raise _Damaged("no crc32c sidecar")
            crc, size = side
            if size != st.st_size:
                raise _Damaged(f"{st.st_size} bytes, its sidecar says {size}")
            ident = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
            if ident not in self._verified:
                got = 0
                if size:
                    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
                        got = crc32c.crc32c(m)
                if got != crc:
                    raise _Damaged(f"crc32c {got:08x}, its sidecar says {crc:08x}")
                with self._lock:
                    self._verified.add(ident)
        except BaseException:
            os.close(fd)
            raise
        return fd, size, crc

    def verify_local(self, key: str) -> bool:
        """True where this host holds an intact copy of ``key`` (checked, once per version)."""
        try:
            got = self._checked_fd(key)
        except _Damaged:
            return False
        if got is None:
            return False
        os.close(got[0])
        return True

    def local_get(self, key: str) -> Optional[Tuple[bytes, int]]:
        """(bytes, crc32c) of this host's checked copy; None where absent; :class:`_Damaged`."""
        got = self._checked_fd(key)
        if got is None:
            return None
        fd, size, crc = got
        try:
            data = os.pread(fd, size, 0) if size else b""
        finally:
            os.close(fd)
        if len(data) != size:
            raise _Damaged("shorter than its sidecar says")
        return data, crc

    def usage(self) -> int:
        """The bytes this host's copies hold, as this process counts them (a walk of the
        store's directory on first use, then what it put and deleted)."""
        with self._lock:
            return self._usage()

    def _usage(self) -> int:
        if self._used is None:
            total = 0
            for dirpath, _dirs, files in os.walk(self.root):
                for f in files:
                    try:
                        total += os.lstat(os.path.join(dirpath, f)).st_size
                    except FileNotFoundError:
                        continue
            self._used = total
        return self._used

    def local_put(self, key: str, views: Sequence[memoryview], crc: int, *,
                  if_absent: bool = False) -> None:
        """Write ``views`` (whose crc32c is ``crc``) as this host's copy of ``key``, whole or
        not at all. :class:`MemoryBudgetError` before writing where the budget would be
        exceeded; ``FileExistsError`` for a lost conditional put."""
        def write(fd: int) -> Optional[int]:
            pos = 0
            for v in views:
                while v.nbytes:
                    n = os.pwrite(fd, v, pos)
                    pos, v = pos + n, v[n:]
            return None
        self.install(key, sum(v.nbytes for v in views), write, crc, if_absent=if_absent)

    def install(self, key: str, size: int, write: Callable[[int], Optional[int]], crc: int,
                *, if_absent: bool = False) -> None:
        """Make this host's copy of ``key``: ``write(fd)`` writes its ``size`` bytes into a
        temporary file and returns their crc32c where it computed it (then checked against
        ``crc``: ``OSError`` where they differ, nothing installed; the copy counts as
        checked), else None; the file is then renamed into place with its sidecar.
        :class:`MemoryBudgetError` before writing where the budget would be exceeded;
        ``FileExistsError`` for a lost conditional put."""
        p = self.path(key)
        with self._lock:
            old = self.local_info(key)
            used = self._usage()
            if self.budget_bytes is not None and \
                    used - (old.size if old else 0) + size > self.budget_bytes:
                raise MemoryBudgetError(
                    f"memory tier {self.url} on host {self.host or '(this host)'}: putting "
                    f"{key!r} ({size} bytes) would hold {used + size} bytes, over the budget "
                    f"of {self.budget_bytes}; nothing of it was written. Raise budget_bytes "
                    "or keep fewer memory steps")
            self._used = used + size   # reserved now; given back below on failure
        tmp = os.path.join(self._tmp, f"{os.getpid()}-{threading.get_ident()}-"
                           f"{next(_TMP_IDS)}")
        side, side_tmp = self.crc_path(key), tmp + ".crc"
        done = False
        try:
            os.makedirs(self._tmp, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o600)
            try:
                got = write(fd)
                st = os.fstat(fd)
            finally:
                os.close(fd)
            if st.st_size != size or (got is not None and got != crc):
                raise OSError(errno.EIO, f"copy of {key!r} damaged on its way here: "
                              f"{st.st_size} bytes (of {size}), crc32c "
                              f"{got if got is not None else crc:08x} (of {crc:08x})",
                              f"{self.url}/{key}")
            with open(side_tmp, "xb") as f:
                f.write(SIDECAR.pack(crc, size))
            os.makedirs(os.path.dirname(p), exist_ok=True)
            os.makedirs(os.path.dirname(side), exist_ok=True)
            # The sidecar goes in before the object, except for a conditional put (the object
            # must win its race first). A reader between the two renames sees a copy whose
            # sidecar does not match: damaged, so it reads another host's: never wrong bytes.
            if if_absent:
                try:
                    os.link(tmp, p)
                except FileExistsError:
                    raise FileExistsError(errno.EEXIST, "object exists",
                                          f"{self.url}/{key}") from None
                os.rename(side_tmp, side)
                os.unlink(tmp)
            else:
                os.rename(side_tmp, side)
                os.rename(tmp, p)
            done = True
            if got is not None:           # its bytes were checked on their way in
                with self._lock:
                    self._verified.add((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
        finally:
            for t in ((tmp, side_tmp) if not done else (tmp,)):
                try:
                    os.unlink(t)
                except FileNotFoundError:
                    pass
            with self._lock:
                if self._used is not None:
                    self._used -= size if not done else (old.size if old else 0)

    def local_list(self, prefix: str) -> List[ObjectInfo]:
        """This host's objects below ``prefix``, in key order."""
        check_prefix(prefix)
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = os.path.join(self.root, *base.split("/")) if base else self.root
        found: List[str] = []
        for dirpath, dirs, files in os.walk(top):
            rel = os.path.relpath(dirpath, self.root)
            rel = "" if rel == os.curdir else rel.replace(os.sep, "/") + "/"
            dirs[:] = [d for d in dirs if (rel + d + "/").startswith(prefix)
                       or prefix.startswith(rel + d + "/")]
            found.extend(rel + f for f in files if (rel + f).startswith(prefix))
        out = []
        for k in sorted(found):
            info = self.local_info(k)
            if info is not None:
                out.append(info)
        return out

    def local_delete(self, keys: Iterable[str]) -> None:
        """Remove this host's copies of ``keys`` and their sidecars (absent ones are no
        error), and the directories that leaves empty."""
        crc_root = os.path.join(os.path.dirname(self.root), ".crc", os.path.basename(self.root))
        for k in keys:
            info = self.local_info(k)
            gone = False
            for top, leaf in ((self.root, self.path(k)), (crc_root, self.crc_path(k))):
                try:
                    os.unlink(leaf)
                except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                    continue
                gone = True
                d = os.path.dirname(leaf)
                while d != top and d.startswith(top + os.sep):
                    try:
                        os.rmdir(d)
                    except OSError:
                        break
                    d = os.path.dirname(d)
            if gone and info is not None:
                with self._lock:
                    if self._used is not None:
                        self._used -= info.size

    # -- the side channel's server side -------------------------------------------------------
    def handle(self, req: Header, payload: Payload) -> Tuple[Header, Body]:
        """Answer one request of another host (:class:`~.peers.PeerServer`'s handler)."""
        op = req.get("op")
        if op == "put":
            try:
                self.install(req["key"], payload.n, payload.copy_to, int(req["crc"]),
                             if_absent=bool(req.get("if_absent")))
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
            return {"status": "ok", "size": info.size, "mtime": info.mtime,
                    "version": info.version}, ()
        if op == "list":
            return {"status": "ok", "items": [[i.key, i.size, i.mtime, i.version]
                                              for i in self.local_list(req["prefix"])]}, ()
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
            got = self._fetch(key, keep=False)      # changed meanwhile: once more
        if got is None:
            raise FileNotFoundError(errno.ENOENT, "no intact copy here after a fetch",
                                    f"{self.url}/{key}")
        return got

    def fetch_here(self, key: str) -> None:
        """Copy ``key`` here, checked, from the first other host with an intact copy.
        ``FileNotFoundError`` where no reachable host holds one; :class:`MemoryBudgetError`
        where this host's budget has no room for it."""
        if self._fetch(key, keep=True, must_keep=True) is not None:
            raise AssertionError("unreachable: a kept copy returns None")

    def _fetch(self, key: str, *, keep: bool,
               must_keep: bool = False) -> Optional[Tuple[bytearray, int]]:
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
        raise FileNotFoundError(errno.ENOENT, "no intact copy on this host or any reachable "
                                f"one ({'; '.join(seen) or 'no other hosts'})",
                                f"{self.url}/{key}")

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
            fetched = self._fetch(key, keep=True)        # None: kept here, checked
            if fetched is None:
                try:
                    got = self._checked_fd(key)
                except _Damaged:
                    got = None
        if got is None:
            data = memoryview(fetched[0] if fetched is not None else self.fetch(key)[0])
            piece = data[start:start + length]
            if out is not None:
                out[:len(piece)] = piece
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
        return bytes(whole[:max(0, length)]), ObjectInfo(
            key, len(whole), info.mtime if info is not None else 0.0,
            version_of(crc, len(whole)))

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        out = memoryview(out).cast("B")
        if start < 0:
            raise ValueError(f"bad range start={start}")
        info = self.head(key)
        if info is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", f"{self.url}/{key}")
        if start + len(out) > info.size:
            raise EOFError(f"{self.url}/{key}: {len(out)} bytes from {start} asked, the "
                           f"object holds {info.size}")
        self._ranged(key, start, len(out), out)

    def put(self, key: str, data: PutData, *, if_absent: bool = False) -> None:
        with self._lock:
            targets, k = self._others[:self.k], self.k
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
                    f"{key!r}; the memory checkpoint is not committed")
            resp = got[0]
            if resp.get("status") == "ok":
                self._count("replica_bytes_sent", sum(v.nbytes for v in views))
            if resp.get("status") == "budget":
                raise MemoryBudgetError(str(resp.get("msg")))
            if resp.get("status") != "ok":
                raise OSError(errno.EIO, f"replica of {key!r} refused by host {h.name}: "
                              f"{resp.get('status')} {resp.get('msg', '')}",
                              f"{self.url}/{key}")
        return None

    def _count(self, what: str, n: int) -> None:
        with self._lock:
            self.counters[what] += n

    def _send_put(self, h: PeerHost, key: str, views: Sequence[memoryview],
                  crc: int) -> Optional[Tuple[Header, bytearray]]:
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
        with ThreadPoolExecutor(max(1, min(16, len(others)))) as pool:    # hosts at once
            answers = list(pool.map(lambda h: self._answer(h, {"op": "list",
                                                               "prefix": prefix}), others))
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
