"""Local (POSIX) files as a byte store: a key is a file below the store's root directory.

The fast path of today's saves and loads stays the fast path: a vectored ``put`` is one
``pwritev`` of the caller's buffers (no joined copy), followed by the early-writeback hint
(``sync_file_range(WRITE)``) so the disk works while later files are written; ``read_into``
is one ``preadv`` into the caller's memory; ``make_durable`` is one ``syncfs(2)`` of the file
system where Linux has it (``sync_method='auto'``), else an fsync of every file and directory
this store wrote, from a thread pool.

Files are written in place (``O_TRUNC``), not through a temporary name: a checkpoint's files
are written below a staging directory that the committer publishes in one rename, so no
reader sees them half-written. Directories are made below the root, never the root itself: a
writer thread outliving an aborted save fails instead of re-creating its staging directory.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

from shardpoint_core.stores.durable import fsync_path, fsync_trees, libc_function, syncfs
from shardpoint_core.stores.fsutil import keys_below, makedirs_below
from shardpoint_core.stores.base import Buffer, ObjectInfo, PutData, StoreCapabilities
from shardpoint_core.stores.keys import check_key, check_prefix

IOV_MAX = 1024
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # a link at a key could lead out of the root
_SYNC_FILE_RANGE_WRITE = 2
_SFR: Optional[Callable[..., Any]] = libc_function(
    "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
)


def start_writeback(fd: int, pos: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[pos, pos + nbytes)`` of ``fd`` to disk now, without
    waiting (Linux ``sync_file_range``); elsewhere, and on failure, nothing: the sync at the
    end of a save still makes every byte durable. This only moves work earlier."""
    if _SFR is not None:
        _SFR(fd, pos, nbytes, _SYNC_FILE_RANGE_WRITE)


def _vectored(call: Callable[..., Any], fd: int, bufs: Sequence[Buffer], pos: int) -> int:
    """``call`` (``os.pwritev`` or ``os.preadv``) over all of ``bufs`` from ``pos``, resumed
    after short transfers and in parts of at most IOV_MAX buffers; returns the bytes moved,
    fewer only where the file ends (reads) or the call moves nothing."""
    views = [memoryview(b).cast("B") for b in bufs]
    views = [v for v in views if v.nbytes]
    total = 0
    while views:
        part = views[:IOV_MAX]
        n = call(fd, part, pos + total)
        if n <= 0:
            break
        total += n
        while part and n >= part[0].nbytes:
            n -= part[0].nbytes
            part.pop(0)
            views.pop(0)
        if n:
            views[0] = views[0][n:]
    return total


def pwritev_all(fd: int, bufs: Sequence[Buffer], pos: int) -> int:
    """Write all of ``bufs`` at ``pos``; returns the bytes written."""
    return _vectored(os.pwritev, fd, bufs, pos)


def preadv_all(fd: int, bufs: Sequence[Buffer], pos: int) -> int:
    """Fill ``bufs`` from ``pos``; returns the bytes read, fewer only where the file ends."""
    return _vectored(os.preadv, fd, bufs, pos)


def _as_bufs(data: PutData) -> List[Buffer]:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return [data]
    return list(data)


class FileStore:
    """A :class:`~shardpoint_core.stores.base.ByteStore` over the directory ``root``.

    ``fsync=False`` makes ``make_durable`` a no-op (tests, scratch data; not crash-safe).
    ``sync_method``: 'auto' (``syncfs`` where it exists, else per-file fsync), 'syncfs' or
    'fsync' (on a busy shared file system, where ``syncfs`` would also flush others' data).
    ``early_writeback``: start each file's writeback right after its ``put``.
    ``create``: make ``root`` (and its parents) now; otherwise it must exist when written.
    """

    capabilities = StoreCapabilities(
        atomic_rename=True, conditional_put=True, ranged_get=True, local_path=True
    )

    def __init__(
        self,
        root: str,
        *,
        fsync: bool = True,
        sync_method: str = "auto",
        early_writeback: bool = True,
        create: bool = False,
    ) -> None:
        if sync_method not in ("auto", "syncfs", "fsync"):
            raise ValueError(
                f"sync_method must be 'auto', 'syncfs' or 'fsync', not {sync_method!r}"
            )
        self.root = os.path.abspath(os.fspath(root))
        self.url = "file://" + self.root
        self.fsync, self.sync_method, self.early = fsync, sync_method, early_writeback
        if create:
            os.makedirs(self.root, exist_ok=True)
        self._lock = threading.Lock()
        self._written: set[Any] = set()  # files put since the last make_durable
        self._dirs: set[Any] = set()  # directories known to exist below root

    def __repr__(self) -> str:
        return f"FileStore({self.root!r})"

    def path(self, key: str) -> str:
        """The file holding ``key`` (for fast paths that need the file itself)."""
        return os.path.join(self.root, *check_key(key).split("/"))

    # -- reads ------------------------------------------------------------------------
    def _open_read(self, key: str) -> int:
        p = self.path(key)
        try:
            fd = os.open(p, os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW)
        except (IsADirectoryError, NotADirectoryError) as e:
            raise FileNotFoundError(errno.ENOENT, "no such object", p) from e
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise FileNotFoundError(errno.ENOENT, "a symbolic link, not an object", p) from e
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise FileNotFoundError(errno.ENOENT, "not a regular file", p)
        return fd

    def get(self, key: str) -> bytes:
        fd = self._open_read(key)
        try:
            size = os.fstat(fd).st_size
            buf = bytearray(size)
            n = preadv_all(fd, [buf], 0)
            return bytes(buf[:n])
        finally:
            os.close(fd)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise ValueError(f"bad range start={start} length={length}")
        fd = self._open_read(key)
        try:
            size = os.fstat(fd).st_size
            buf = bytearray(max(0, min(length, size - start)))
            n = preadv_all(fd, [buf], start)
            return bytes(buf[:n])
        finally:
            os.close(fd)

    def get_suffix(self, key: str, length: int) -> Tuple[bytes, int]:
        """(the last ``length`` bytes of ``key``, or all of it where shorter; its size)."""
        fd = self._open_read(key)
        try:
            size = os.fstat(fd).st_size
            start = max(0, size - length)
            buf = bytearray(size - start)
            n = preadv_all(fd, [buf], start)
            return bytes(buf[:n]), size
        finally:
            os.close(fd)

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        out = memoryview(out).cast("B")
        if start < 0:
            raise ValueError(f"bad range start={start}")
        fd = self._open_read(key)
        try:
            n = preadv_all(fd, [out], start)
        finally:
            os.close(fd)
        if n != len(out):
            raise EOFError(f"{self.path(key)}: {len(out)} bytes from {start} asked, {n} there")

    def head(self, key: str) -> Optional[ObjectInfo]:
        try:
            st = os.lstat(self.path(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        return ObjectInfo(
            key, st.st_size, st.st_mtime, f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"
        )

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        check_prefix(prefix)
        for k in keys_below(self.root, prefix):
            info = self.head(k)
            if info is not None:
                yield info

    # -- writes -------------------------------------------------------------------------
    def _parent(self, p: str) -> None:
        parent = os.path.dirname(p)
        if parent == self.root or parent in self._dirs:
            return
        makedirs_below(self.root, parent)
        with self._lock:
            self._dirs.add(parent)

    def put(self, key: str, data: PutData, *, if_absent: bool = False) -> None:
        p = self.path(key)
        bufs = _as_bufs(data)
        flags = os.O_WRONLY | os.O_CREAT | _O_CLOEXEC | (os.O_EXCL if if_absent else os.O_TRUNC)
        self._parent(p)
        try:
            fd = os.open(p, flags, 0o666)
        except FileNotFoundError:  # a delete pruned the parent meanwhile: once more
            with self._lock:
                self._dirs.discard(os.path.dirname(p))
            self._parent(p)
            fd = os.open(p, flags, 0o666)
        try:
            want = sum(memoryview(b).nbytes for b in bufs)
            got = pwritev_all(fd, bufs, 0)
            if got != want:
                raise OSError(errno.EIO, f"short write: {got} of {want} bytes", p)
            if self.early and want:
                start_writeback(fd, 0, want)
        except OSError as e:  # pwritev names no file: a full disk's error then names none
            if e.filename is None and e.strerror is not None:
                raise OSError(e.errno, e.strerror, p) from e
            raise
        finally:
            os.close(fd)
        if self.fsync:
            with self._lock:
                self._written.add(p)

    def delete(self, keys: Iterable[str]) -> None:
        for k in keys:
            p = self.path(k)
            try:
                if stat.S_ISREG(os.lstat(p).st_mode):
                    os.unlink(p)
            except (FileNotFoundError, NotADirectoryError):
                continue
            with self._lock:  # prune directories the delete left empty
                d = os.path.dirname(p)
                while d != self.root and d.startswith(self.root):
                    try:
                        os.rmdir(d)
                    except OSError:
                        break
                    self._dirs.discard(d)
                    d = os.path.dirname(d)

    def make_durable_below(self, prefixes: Iterable[str]) -> int:
        """Every file and directory below these keys (directories a fast path wrote into
        itself, such as an array's chunk files), and the directories up to the root, survive
        a crash: one ``syncfs`` of the file system where allowed (``sync_method``), else an
        fsync of each of them from 16 threads. Nothing when ``fsync`` is off. Returns how
        many paths were fsync'd (0 after a ``syncfs``)."""
        dirs = sorted(self.path(k) for k in prefixes)
        if not self.fsync or not dirs:
            return 0
        if self.sync_method in ("auto", "syncfs") and syncfs(self.root):
            return 0
        return fsync_trees(dirs, self.root)

    def make_durable(self, keys: Optional[Iterable[str]] = None) -> None:
        """What this store put (or the files of ``keys``) and the directories holding them
        survive a crash: one ``syncfs`` where available and allowed, else fsyncs in
        parallel of those files and every directory up to the root."""
        with self._lock:
            if keys is None:
                paths, self._written = sorted(self._written), set()
            else:
                paths = [self.path(k) for k in keys]
                self._written.difference_update(paths)
        if not self.fsync or not paths:
            return
        if self.sync_method in ("auto", "syncfs") and syncfs(self.root):
            return
        todo = set(paths)
        for p in paths:
            d = os.path.dirname(p)
            while d.startswith(self.root) and d not in todo:
                todo.add(d)
                d = os.path.dirname(d)
        ordered = sorted(todo, key=lambda q: -q.count(os.sep))  # files before parents
        with ThreadPoolExecutor(max(1, min(16, len(ordered)))) as pool:
            list(pool.map(fsync_path, ordered))


if TYPE_CHECKING:
    # static checks that the class satisfies the protocol it claims (runtime_checkable
    # compares method names only); mypy fails here on a regression
    from shardpoint_core.stores.base import ByteStore

    def _is_bytestore_filestore(x: FileStore) -> ByteStore:
        return x
