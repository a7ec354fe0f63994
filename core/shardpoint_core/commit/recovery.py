"""Clean up after crashed saves: the recovery procedure of [SP-COMMIT-6].

A save that dies leaves hidden ``.<name>.shardpoint-tmp-<token>`` (staging) or
``.<name>.shardpoint-old-<token>`` (previous checkpoint moved aside) directories beside its
target ``<name>``. Recovery removes every ``-tmp-`` one, and for an ``-old-`` one restores it
to ``<name>`` when ``<name>`` is missing, or removes it when ``<name>`` holds a manifest.
It never touches ``<name>`` itself when it exists.

The format gives no marker telling a crashed save's leftovers from those of a save still
running (the spec says only "never while a save to that path may be running"). Two
safeguards: a save holds an advisory lock (``flock``) on its staging directory until it
commits or aborts, and the lock dies with its process, so a leftover whose lock is held is a
running save on this host and is always skipped; and, since a lock taken on another host may
be invisible here, any leftover modified less than ``min_age_s`` ago is skipped too (pass
``min_age_s=0`` when no save can be running).

Example::

    for a in shardpoint.recover("/ckpt", dry_run=True):
        print(a.action, a.path, a.reason)
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Optional

from shardpoint_core.format.errors import (
    CheckpointNotFoundError,
    InvalidOptionError,
    ShardpointError,
)
from shardpoint_core.stores.fsutil import os_error_text
from shardpoint_core.commit.base import Committer
from shardpoint_core.commit.leftovers import Leftover
from shardpoint_core.commit.routing import default_committer
from shardpoint_core.stores.registry import check_path, local_path

DEFAULT_MIN_AGE_S = 900.0


@dataclass(frozen=True)
class RecoveryAction:
    """What recovery did (or, under ``dry_run``, would do) with one leftover directory:
    ``action`` is 'remove', 'restore' (renamed back to ``target``) or 'skip'; ``done`` is
    False for a 'remove' or 'restore' that failed (``reason`` then says why and what to do)."""

    path: str
    target: str
    kind: str
    action: str
    reason: str
    done: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def committer_of(backend: Any = None) -> Committer:
    """The committer that publishes and removes checkpoints of ``backend`` (the default
    backend's when None): its own where it has one, else a POSIX one."""
    c: Optional[Committer] = getattr(backend, "committer", None)  # optional attribute
    return c if c is not None else default_committer()


def _leftovers(be: Committer, path: str) -> list[Leftover]:
    """Leftovers inside ``path`` (a parent directory) and those of target ``path`` itself."""
    found: dict[str, Leftover] = {}
    if os.path.isdir(path):
        for lo in be.leftovers(path):
            found[lo.path] = lo
    parent = os.path.dirname(path.rstrip(os.sep)) or "."
    if os.path.isdir(parent):
        for lo in be.leftovers(parent):
            if lo.target == path.rstrip(os.sep):
                found[lo.path] = lo
    return sorted(found.values(), key=lambda lo: (lo.target, lo.kind != "tmp", lo.path))


def _decide(
    be: Committer, lo: Leftover, olds: Counter[str], now: float, min_age_s: float
) -> tuple[str, str]:
    if lo.in_use and "://" in lo.path:
        return "skip", (
            "its save's lease is live (renewed within its duration): a save is "
            "running [SP-COMMIT-16]"
        )
    if lo.in_use:
        return "skip", (
            "a save running on this host holds its lock: it is being written, not left over"
        )
    age = now - lo.newest_mtime
    if age < min_age_s:
        return "skip", (
            f"modified {age:.0f}s ago (under {min_age_s:.0f}s): a save may still "
            "be writing it; rerun with a smaller min age once no save is running"
        )
    if lo.kind == "tmp" and "://" in lo.path:
        return (
            "remove",
            "a save prefix that no manifest names: a save that crashed, failed "
            "or lost, or a replaced checkpoint's data [SP-COMMIT-15]",
        )
    if lo.kind == "tmp":
        what = "a replaced checkpoint" if lo.has_manifest else "a save that never committed"
        return "remove", f"staging directory of {what} [SP-COMMIT-6 a]"
    state = be.state(lo.target)
    if state == "committed":
        return (
            "remove",
            "the replacement committed: this previous checkpoint is superseded [SP-COMMIT-6 b]",
        )
    if state == "incomplete":
        return "skip", (
            f"{lo.target!r} exists without a manifest: not covered by "
            "[SP-COMMIT-6]; left for a person to decide"
        )
    if olds[lo.target] > 1:
        return "skip", (
            f"{olds[lo.target]} '-old-' directories for the missing {lo.target!r}:"
            " which one is newest is ambiguous; restore one by hand"
        )
    return "restore", (
        "the crash fell between the two renames of a replacement: restoring "
        "the previous checkpoint [SP-COMMIT-6 b]"
    )


def recover(
    path_or_parent: str,
    *,
    dry_run: bool = False,
    min_age_s: float = DEFAULT_MIN_AGE_S,
    backend: Any = None,
) -> list[Any]:
    """Apply [SP-COMMIT-6] to leftovers beside checkpoint ``path_or_parent`` (or in it, when it
    is the directory holding checkpoints); returns one :class:`RecoveryAction` per leftover.
    Never run it while a save to one of those paths may be running."""
    if not 0 <= min_age_s < float("inf"):
        raise InvalidOptionError(
            f"min_age_s={min_age_s!r}: an age is a finite number of "
            "seconds >= 0 (0 when no save can be running)"
        )
    from shardpoint_core.stores.registry import is_local

    if not is_local(path_or_parent):  # s3://...: leftovers are unnamed save prefixes
        check_path(path_or_parent, "recover")
        be = committer_of(backend)
        return _apply(be, be.leftovers(str(path_or_parent)), dry_run, min_age_s)
    be = committer_of(backend)
    path = os.path.abspath(local_path(path_or_parent, "recover"))
    if not os.path.lexists(path) and not os.path.isdir(os.path.dirname(path)):
        raise CheckpointNotFoundError(
            f"no such path {path_or_parent!r} (nor its parent directory): nothing to recover"
        )
    return _apply(be, _leftovers(be, path), dry_run, min_age_s)


def _apply(be: Committer, los: list[Any], dry_run: bool, min_age_s: float) -> list[Any]:
    """Decide and (unless ``dry_run``) act on each leftover."""
    olds = Counter(lo.target for lo in los if lo.kind == "old")
    now, out = time.time(), []
    for lo in los:
        action, reason = _decide(be, lo, olds, now, min_age_s)
        done = not dry_run and action != "skip"
        try:
            if done and action == "remove":
                done = be.discard(lo.path)
            elif done and action == "restore":
                done = be.restore(lo.path, lo.target)
            if not dry_run and action != "skip" and not done:
                action, reason = (
                    "skip",
                    ("a save took its lock meanwhile: it is being written, not left over"),
                )
        except OSError as e:  # a read-only file system, no permission: say so, go on
            if isinstance(e, ShardpointError):
                raise
            done, reason = False, f"{reason}; FAILED: {os_error_text(e)}"
        out.append(RecoveryAction(lo.path, lo.target, lo.kind, action, reason, done=done))
    return out
