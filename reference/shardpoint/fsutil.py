"""Two POSIX helpers every writer of a durable directory needs (the converters here, the
storage backends, the benchmarks): fsync a path, and remove a tree or a file."""
from __future__ import annotations

import os
import shutil


def fsync_dir(path: str) -> None:
    """fsync ``path``: for a directory, the entries created in it survive a crash; a file's
    data too."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_path(p: str) -> None:
    """Remove ``p`` whatever it is: a directory tree (not followed through a symlink), a file
    or a link; nothing if it is gone."""
    if os.path.isdir(p) and not os.path.islink(p):
        shutil.rmtree(p, ignore_errors=True)
    elif os.path.lexists(p):
        os.remove(p)
