"""One host's copies of the memory tier's objects: files in its shared memory, each with a
crc32c sidecar, written whole or not at all, within a budget. :class:`~.shm.ShmStore` adds the
other hosts (replication, reads from peers) on top.

A copy is the object's bytes, exactly, at ``<root>/<key>``, so a host's copy of a memory step
is a plain checkpoint directory (the fast local load path reads it). Its crc32c and size are
in a sidecar, ``<root>/../.crc/<job>/<key>`` (:data:`SIDECAR`), outside the step's directory;
a copy whose sidecar is missing or disagrees is damaged: never used, read from another host
instead. A copy is written to ``<root>/../.tmp/<job>/`` and renamed into place after its
sidecar (``link``, then the sidecar, for a conditional put).

Example::

    mem = HostMemory("/dev/shm/shardpoint/job", budget_bytes=8 << 30)
    mem.local_put("step_1/a", [memoryview(b"bytes")], crc32c.crc32c(b"bytes"))
    assert mem.verify_local("step_1/a")
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import stat
import struct
import threading
from typing import Callable, Iterable, List, Optional, Sequence, Set, Tuple

import crc32c

from shardpoint_core.format.errors import MemoryBudgetError
from shardpoint_core.stores.base import ObjectInfo
from shardpoint_core.stores.fsutil import keys_below
from shardpoint_core.stores.keys import check_key, check_prefix

SIDECAR = struct.Struct("<IQ")  # crc32c, size: a copy's sidecar (see the module)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_TMP_IDS = itertools.count()


class _Damaged(Exception):
    """This host's copy of an object fails its crc32c or has no trailer."""


def version_of(crc: int, size: int) -> str:
    """An object's version: its crc32c and size, so every host's copy has the same one (a
    load's identity check sees no change when it reads another host's copy)."""
    return f"{crc:08x}.{size}"


class HostMemory:
    """This host's copies below ``root`` (see the module). ``url`` names the store in
    errors; ``host`` names this host in them; ``budget_bytes``: the most this host's copies
    may hold (None: no cap)."""

    def __init__(
        self, root: str, *, url: str = "", budget_bytes: Optional[int] = None, host: str = ""
    ) -> None:
        self.root = os.path.abspath(root)
        self.url = url or "shm://" + self.root
        self.budget_bytes, self.host = budget_bytes, host
        self._lock = threading.Lock()
        self._used: Optional[int] = None
        self._verified: Set[Tuple[int, int, int, int]] = set()

    @property
    def _tmp(self) -> str:
        return os.path.join(os.path.dirname(self.root), ".tmp", os.path.basename(self.root))

    def path(self, key: str) -> str:
        """The file holding ``key``'s copy on this host."""
        return os.path.join(self.root, *check_key(key).split("/"))

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
        return os.path.join(
            os.path.dirname(self.root),
            ".crc",
            os.path.basename(self.root),
            *check_key(key).split("/"),
        )

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

    def clean_tmp(self) -> List[str]:
        """Remove the temporary files that processes of this job on this host left when they
        died mid-write (named by their pid; a pid still running is left alone); returns
        their names. A tier calls this when it starts."""
        gone: List[str] = []
        try:
            names = os.listdir(self._tmp)
        except FileNotFoundError:
            return gone
        for name in names:
            pid = name.split("-", 1)[0]
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                os.kill(int(pid), 0)
                continue  # alive (or another user's): not ours to judge
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            try:
                os.unlink(os.path.join(self._tmp, name))
                gone.append(name)
            except FileNotFoundError:
                pass
        return gone

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

    def local_put(
        self, key: str, views: Sequence[memoryview], crc: int, *, if_absent: bool = False
    ) -> None:
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

    def install(
        self,
        key: str,
        size: int,
        write: Callable[[int], Optional[int]],
        crc: int,
        *,
        if_absent: bool = False,
    ) -> None:
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
            if (
                self.budget_bytes is not None
                and used - (old.size if old else 0) + size > self.budget_bytes
            ):
                raise MemoryBudgetError(
                    f"memory tier {self.url} on host {self.host or '(this host)'}: putting "
                    f"{key!r} ({size} bytes) would hold {used + size} bytes, over the budget "
                    f"of {self.budget_bytes}; nothing of it was written. Raise budget_bytes "
                    "or keep fewer memory steps"
                )
            self._used = used + size  # reserved now; given back below on failure
        tmp = os.path.join(self._tmp, f"{os.getpid()}-{threading.get_ident()}-{next(_TMP_IDS)}")
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
                raise OSError(
                    errno.EIO,
                    f"copy of {key!r} damaged on its way here: "
                    f"{st.st_size} bytes (of {size}), crc32c "
                    f"{got if got is not None else crc:08x} (of {crc:08x})",
                    f"{self.url}/{key}",
                )
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
                    raise FileExistsError(
                        errno.EEXIST, "object exists", f"{self.url}/{key}"
                    ) from None
                os.rename(side_tmp, side)
                os.unlink(tmp)
            else:
                os.rename(side_tmp, side)
                os.rename(tmp, p)
            done = True
            if got is not None:  # its bytes were checked on their way in
                with self._lock:
                    self._verified.add((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
        finally:
            for t in (tmp, side_tmp) if not done else (tmp,):
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
        out = []
        for k in keys_below(self.root, prefix):
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
