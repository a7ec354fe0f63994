"""POSIX helpers every writer of a durable directory needs (the converters here, the
storage backends, the benchmarks): fsync a path, make directories below a root, and say what
to do about the ``OSError`` a write got. Removing and renaming checkpoint paths is the
committer's alone (:mod:`shardpoint_core.commit`)."""

from __future__ import annotations

import errno
import os
from typing import Optional

_FIXES: dict[Optional[int], str] = {  # errno (None where the error has none) -> fix
    errno.ENOSPC: "the file system is full: free space on it (delete old checkpoints; "
    "`shardpoint recover DIR` removes what crashed saves left) or save elsewhere",
    errno.EDQUOT: "the disk quota is used up: free space under the quota, raise it, or save "
    "elsewhere",
    errno.EROFS: "the file system is mounted read-only: remount it read-write or save elsewhere",
    errno.EACCES: "permission denied: make the directory writable for this user or save elsewhere",
    errno.EPERM: "operation not permitted: make the directory writable for this user or save "
    "elsewhere",
    errno.EFBIG: "a file grew past the file system's or the process's size limit (ulimit -f): "
    "raise the limit or save elsewhere",
    errno.EIO: "the device reported an I/O error: check the disk (dmesg) before saving again",
}


def fsync_dir(path: str) -> None:
    """fsync ``path``: for a directory, the entries created in it survive a crash; a file's
    data too."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_below(root: str, path: str) -> None:
    """``mkdir -p path`` for a ``path`` inside the directory ``root``, never re-creating
    ``root`` itself: a save's writer thread still running after the save was cut short and
    its staging directory removed then fails (FileNotFoundError) instead of bringing the
    directory back as debris. Each level is made relative to its parent's descriptor."""
    rel = os.path.relpath(path, root)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in [] if rel == os.curdir else rel.split(os.sep):
            try:
                os.mkdir(part, dir_fd=fd)
            except FileExistsError:
                pass
            sub = os.open(part, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = sub
    finally:
        os.close(fd)


def os_error_text(e: BaseException) -> str:
    """``e`` for an error message: its cause (strerror and the file it names) and, for an
    ``OSError`` a writer can do something about (a full disk, a quota, a read-only or
    write-protected directory), what to do; other errors as ``Type: message``."""
    if not isinstance(e, OSError) or e.strerror is None:
        return f"{type(e).__name__}: {e}"
    where = f" ({e.filename!r})" if e.filename else ""
    fix = _FIXES.get(e.errno, "fix the cause and try again")
    return f"{type(e).__name__}: {e.strerror}{where}; {fix}"


def keys_below(root: str, prefix: str) -> list[str]:
    """The ``/``-separated keys of the files below directory ``root`` that start with
    ``prefix``, sorted; only the directories that can hold such keys are walked (a byte
    store's listing over a directory tree)."""
    base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
    top = os.path.join(root, *base.split("/")) if base else root
    found: list[str] = []
    for dirpath, dirs, files in os.walk(top):
        rel = os.path.relpath(dirpath, root)
        rel = "" if rel == os.curdir else rel.replace(os.sep, "/") + "/"
        dirs[:] = [
            d
            for d in dirs
            if (rel + d + "/").startswith(prefix) or prefix.startswith(rel + d + "/")
        ]
        found.extend(rel + f for f in files if (rel + f).startswith(prefix))
    return sorted(found)
