"""File-system primitives of a durable commit: fsync of files and directories (one by one,
in parallel, or one ``syncfs``), atomic renames (``renameat2`` NOREPLACE / EXCHANGE) and the
directory locks of the lock rule (:mod:`.posix`). Leftover names live in :mod:`.leftovers`.
No TensorStore here: only ``os`` and, for the Linux-only calls, libc through ctypes.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence


RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2


def newest_mtime(root: str) -> float:
    """The newest modification time of ``root`` and anything below it."""
    newest = os.lstat(root).st_mtime
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            try:
                newest = max(newest, os.lstat(os.path.join(d, n)).st_mtime)
            except FileNotFoundError:  # removed while we looked
                pass
    return newest


_LIBC: Optional[Any] = None
_FUNCTIONS: dict[str, Any] = {}


def libc_function(name: str, argtypes: list[Any], restype: Any = ctypes.c_int) -> Optional[Any]:
    """The Linux libc function ``name`` (errno kept for ``ctypes.get_errno``), or None on
    another OS or a libc without it. Looked up once per name: the library is opened once
    per process, not per call (renameat2 and syncfs run on every commit)."""
    global _LIBC
    if sys.platform != "linux":
        return None
    if name in _FUNCTIONS:
        return _FUNCTIONS[name]
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL(None, use_errno=True)
        fn = _LIBC[name]  # a fresh function object: its argtypes are this caller's
    except (OSError, AttributeError):
        fn = None
    if fn is not None:
        fn.argtypes, fn.restype = argtypes, restype
    _FUNCTIONS[name] = fn
    return fn


def renameat2(a: str, b: str, flags: int) -> Optional[int]:
    """Linux ``renameat2(a, b, flags)``: 0 on success, the errno on failure, None where the
    call does not exist (another OS, an old libc) or the file system does not support it."""
    fn = libc_function(
        "renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    )
    if fn is None:
        return None
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), flags) == 0:
        return 0
    err = ctypes.get_errno()
    return None if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP) else err


def exchange_dirs(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    return renameat2(a, b, RENAME_EXCHANGE) == 0


def syncfs(path: str) -> bool:
    """``syncfs(2)`` on the file system holding ``path``; False where it does not exist."""
    fn = libc_function("syncfs", [ctypes.c_int])
    if fn is None:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        if fn(fd) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"syncfs failed: {os.strerror(e)}", path)
    finally:
        os.close(fd)
    return True


def fsync_path(path: str) -> None:
    """fsync one file or directory; one that vanished meanwhile is skipped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # a peer's lock file renamed away meanwhile: not ours
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_trees(roots: Sequence[str], stop: str, threads: int = 16) -> int:
    """fsync every file and directory under each of ``roots`` and every directory from them
    up to ``stop``, from a thread pool (fsyncs of different files proceed in parallel).
    Returns how many paths were synced."""
    paths: set[Any] = set()
    for root in roots:
        for dirpath, _dirs, files in os.walk(root):
            paths.add(dirpath)
            paths.update(os.path.join(dirpath, f) for f in files)
        d = root
        while len(d) > len(stop) and d.startswith(stop):
            d = os.path.dirname(d)
            paths.add(d)
    ordered = sorted(paths, key=lambda p: -p.count(os.sep))  # files before their parents
    with ThreadPoolExecutor(max(1, min(threads, len(ordered)))) as pool:
        list(pool.map(fsync_path, ordered))
    return len(ordered)


def will_need(files: Sequence[str]) -> None:
    """Ask the kernel to read ``files`` ahead (``POSIX_FADV_WILLNEED``); best effort."""
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue  # the read reports it
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


# ------------------------------------------ a running save's mark ([SP-COMMIT-6] note)
def lock_dir(path: str) -> Optional[int]:
    """Take an exclusive ``flock`` on the directory ``path`` and return its descriptor (the
    lock lives until it is closed or the process dies), or None where the file system has no
    ``flock``. A save holds it on its staging directory, so recovery can tell a running save
    from a crashed one on the same host, however long the save has been quiet."""
    return _flock_dir(path, exclusive=True)[0]


class DirLocks:
    """The :func:`lock_dir` locks one process holds, by directory. A process forked while a
    save runs (a DataLoader worker started beside an async save) shares each lock's open
    file, and a ``flock`` lasts until every descriptor of it is closed, so the staging
    directory, and later the checkpoint it became, would stay locked while that child lives.
    The child therefore closes its copies at once (never ``LOCK_UN``, which would release the
    parent's lock too): the lock stays the parent's alone."""

    def __init__(self) -> None:
        self._fds: dict[str, Any] = {}
        self._mutex = threading.Lock()
        _EVERY.add(self)

    def take(self, path: str) -> bool:
        """Lock ``path`` for this process; False where the file system has no ``flock``."""
        fd = lock_dir(path)
        if fd is None:
            return False
        with self._mutex:
            self._fds[os.path.abspath(path)] = fd
        return True

    def release(self, path: str) -> None:
        """Drop the lock on ``path`` if this process holds it (idempotent)."""
        with self._mutex:
            fd = self._fds.pop(os.path.abspath(path), None)
        if fd is not None:
            os.close(fd)

    def holds(self, path: str) -> bool:
        """True when this process holds the lock on the directory now at ``path`` (the same
        inode: a directory deleted and made again under that name is another one)."""
        with self._mutex:
            fd = self._fds.get(os.path.abspath(path))
        if fd is None:
            return False
        try:
            return os.path.samestat(os.fstat(fd), os.stat(path))
        except OSError:
            return False

    def __len__(self) -> int:
        return len(self._fds)

    def _forget_after_fork(self) -> None:
        self._mutex = threading.Lock()  # another thread may have held it at the fork
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = {}


_EVERY: "weakref.WeakSet[DirLocks]" = weakref.WeakSet()
if hasattr(os, "register_at_fork"):

    def _forget_all_after_fork() -> None:
        for d in list(_EVERY):
            d._forget_after_fork()

    os.register_at_fork(after_in_child=_forget_all_after_fork)


def dir_locked(path: str) -> Optional[bool]:
    """True when a live process holds :func:`lock_dir` on ``path`` (a save is running), False
    when no one does, None when the file system cannot tell (no ``flock``, or the lock may
    be local to another host: then only the age of the files hints)."""
    fd, held = _flock_dir(path, exclusive=False)
    if fd is not None:
        os.close(fd)  # closing drops our probe lock
        return False
    return True if held else None


def _flock_dir(path: str, exclusive: bool) -> tuple[Optional[int], bool]:
    """``(descriptor holding a non-blocking flock on directory path, or None; whether
    another open file holds a conflicting lock)``."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None, False
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        return None, isinstance(e, BlockingIOError)
    return fd, False


#: CPU priorities a thread can take (:func:`lower_thread_priority`): "low" is nice 19 (a small
#: share of a core others want, never none), "idle" SCHED_IDLE (only cores nothing else
#: wants), "normal" the process's own.
PRIORITIES = ("low", "idle", "normal")


def lower_thread_priority(priority: str) -> bool:
    """Lower the calling thread's CPU priority to ``priority``; True if it did. Linux only
    (elsewhere ``setpriority`` of a thread id would renice some process); never raises: work
    must not fail for want of a lower priority. Not undone: an unprivileged thread cannot raise
    its priority again, so such threads are kept for work of that priority."""
    if priority not in ("low", "idle") or not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        if priority == "idle":
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        elif os.getpriority(os.PRIO_PROCESS, tid) < 19:
            os.setpriority(os.PRIO_PROCESS, tid, 19)
        return True
    except (AttributeError, OSError):  # a sandbox refusing it: normal priority
        return False
