"""A manager's clean-up of its root under the lock rule: what crashed saves of its steps left.

Both managers call :func:`clean_leftovers` before a save and a load. It applies
[SP-COMMIT-6] to the leftovers of the names the manager owns, through the committer, and
skips whatever a live save holds (its lock), or, where the file system cannot tell, whatever
was modified less than ``min_age_s`` ago: a manager built by an evaluation job beside the
training job never deletes a save in progress.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Optional

from shardpoint_core.commit.posix import PosixCommitter
from shardpoint_core.stores.durable import newest_mtime

log = logging.getLogger("shardpoint")
DEFAULT_MIN_AGE_S = 900.0


def clean_leftovers(
    committer: PosixCommitter,
    root: str,
    owns: Callable[[str], bool],
    min_age_s: float = DEFAULT_MIN_AGE_S,
) -> list[Any]:
    """Remove the leftovers of crashed saves of names ``owns`` accepts in ``root`` and restore
    an ``-old-`` checkpoint whose replacement crashed midway; returns the paths acted on.
    A directory that merely has such a name and no manifest is not the protocol's (a commit
    renames a whole checkpoint into place, retention renames it away first) and is left as
    it is: nothing deletes what it did not create. OS errors (a read-only file
    system) are logged and skipped: the caller's save or load reports its own."""
    done: list[Any] = []
    if not os.path.isdir(root):
        return done
    now = time.time()

    def idle(in_use: Optional[bool], path: str) -> bool:
        if in_use is not None:
            return not in_use
        try:
            return now - newest_mtime(path) >= min_age_s
        except FileNotFoundError:
            return False

    for lo in committer.leftovers(root):
        if not owns(os.path.basename(lo.target)) or not idle(lo.in_use, lo.path):
            continue
        try:
            if lo.kind == "old" and lo.has_manifest and committer.state(lo.target) != "committed":
                if os.path.lexists(lo.target):
                    continue  # not the protocol's (as recover decides): left for a person
                ok = committer.restore(lo.path, lo.target)
            else:
                ok = committer.discard(lo.path)
        except OSError as e:
            log.warning(
                "shardpoint: cannot clean up %r (%s); left as it is",
                lo.path,
                getattr(e, "strerror", None) or e,
            )
            continue
        if ok:
            done.append(lo.path)
    return done
