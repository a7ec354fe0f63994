"""The POSIX committer: a staging directory renamed into place ([SP-COMMIT-2], [SP-COMMIT-4..6]).

One implementation of :class:`shardpoint_core.commit.base.Committer` for local and shared file
systems, used by every writer (both front ends, sync and async saves, converters), by
``recover`` and by both managers' retention and clean-up.

**The lock rule.** Whoever creates, replaces or deletes a directory holds an exclusive
``flock`` on it while it does: a save on its staging directory from creation until it commits
or aborts (the lock moves with the directory when it is renamed), a replacement on the
checkpoint it moves aside, retention on the step it deletes. Anything that deletes or moves a
leftover (``discard``, ``restore``, a manager's clean-up, ``recover``) first takes that lock
without waiting, and leaves the directory alone when it cannot: a live save is never touched,
however an observer process was started. Where the file system has no ``flock`` the age of
the files is the only hint, and the callers skip young leftovers (``min_age_s``).

Example::

    c = PosixCommitter()
    c.check_target("/ckpt/step_10", overwrite=False)
    staging = c.begin("/ckpt/step_10", token="a1b2c3")
    ...                                   # every rank writes below staging, durably
    c.write_manifest(staging, manifest_bytes)
    c.publish(staging, "/ckpt/step_10", overwrite=False)
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

from shardpoint_core.commit.references import refuse_if_referenced
from shardpoint_core.commit.base import check_overwrite, Overwrite
from shardpoint_core.stores.durable import (
    RENAME_NOREPLACE,
    DirLocks,
    dir_locked,
    exchange_dirs,
    newest_mtime,
    renameat2,
)
from shardpoint_core.commit.leftovers import Leftover, leftover_name, parse_leftover
from shardpoint_core.format.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    InvalidOptionError,
    SaveFailedError,
)
from shardpoint_core.stores.fsutil import fsync_dir
from shardpoint_core.format.hints import path_hint
from shardpoint_core.format.manifest import Manifest, encode_manifest

MANIFEST_NAME = "manifest.msgpack"


def _within(inner: str, outer: str) -> bool:
    """True when path ``inner`` is ``outer`` or lies below it (links resolved)."""
    inner, outer = os.path.realpath(inner), os.path.realpath(outer)
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def check_not_containing(target: str, protect: Sequence[str]) -> None:
    """Raise CheckpointExistsError when ``target`` is or holds one of ``protect`` (the input
    of a conversion): replacing it would delete that input."""
    for p in protect:
        if _within(p, target):
            raise CheckpointExistsError(
                f"{target!r} holds {p!r}, the input of this command; writing there would "
                "delete it. Choose a destination outside the input",
                spec_id="SP-COMMIT-5",
            )


def _ignore(*_: object) -> None:
    pass


def _raise_unless_gone(_fn: object, _path: str, info: tuple[Any, ...]) -> None:
    """rmtree's error handler: what vanished meanwhile (another remover) is fine."""
    if not isinstance(info[1], FileNotFoundError):
        raise info[1]


class PosixCommitter:
    """Commit by rename on a POSIX file system (see the module docstring for the lock rule).

    ``fsync=False`` skips every fsync (tests and scratch data only: not crash-safe).
    """

    name = "posix-rename"

    def __init__(self, *, fsync: bool = True) -> None:
        self.fsync = fsync
        self._locks = DirLocks()  # the directories this process is saving into or removing

    def __repr__(self) -> str:
        return f"PosixCommitter(fsync={self.fsync})"

    def _sync_dir(self, path: str) -> None:
        if self.fsync:
            fsync_dir(path)

    # ------------------------------------------------------------------ what is there
    def state(self, target: str) -> str:
        """'missing', 'incomplete' (something there, no manifest) or 'committed'."""
        if os.path.lexists(os.path.join(target, MANIFEST_NAME)):
            return "committed"
        return "incomplete" if os.path.lexists(target) else "missing"

    def holds_checkpoints(self, directory: str) -> list[Any]:
        """The committed checkpoints directly inside ``directory`` (a manager's root, or any
        directory of checkpoints), sorted by name; empty for anything else."""
        try:
            names = os.listdir(directory)
        except OSError:
            return []
        return sorted(
            n
            for n in names
            if not n.startswith(".") and os.path.isfile(os.path.join(directory, n, MANIFEST_NAME))
        )

    def check_target(
        self,
        target: str,
        overwrite: Overwrite,
        protect: Sequence[str] = (),
        is_output: Optional[Callable[[str], bool]] = None,
    ) -> None:
        """Raise CheckpointExistsError where publishing to ``target`` is refused
        ([SP-COMMIT-5]). ``overwrite=False`` refuses anything but an empty directory;
        ``True`` also replaces a committed checkpoint; ``"any"`` also a directory that is not
        a checkpoint. Always refused: a file or link, a directory holding checkpoints (a
        manager's root), and a path holding any of ``protect`` (a converter's source).
        ``is_output(path)`` says what counts as a finished output that ``overwrite=True``
        may replace (converters writing other formats); default: a committed checkpoint."""
        overwrite = check_overwrite(overwrite)
        check_not_containing(target, protect)
        if not os.path.lexists(target):
            return
        finished = (
            is_output(target)
            if is_output is not None
            else os.path.isdir(target) and self.state(target) == "committed"
        )
        if finished:
            if overwrite is False:
                what = "a checkpoint" if is_output is None else "an output of this kind"
                raise CheckpointExistsError(
                    f"{what} already exists at {target!r}; pass overwrite=True to replace it",
                    spec_id="SP-COMMIT-5",
                )
            if is_output is None:  # [SP-PACK-11]: never replace a checkpoint others build on
                refuse_if_referenced(target, "replacing the checkpoint")
            self._refuse_nested(target)
            return
        if os.path.islink(target) or not os.path.isdir(target):
            raise CheckpointExistsError(
                f"{target!r} is a {'link' if os.path.islink(target) else 'file'}, not a "
                "checkpoint; a save never replaces one. Choose another path, or delete it "
                "yourself if it may go" + path_hint(target),
                spec_id="SP-COMMIT-5",
            )
        if not os.listdir(target):
            return  # an empty directory: nothing is lost
        self._refuse_nested(target)
        if overwrite != "any":
            raise CheckpointExistsError(
                f"{target!r} exists and is not a checkpoint (no {MANIFEST_NAME}); refusing to "
                "delete what it holds. Choose another path, or pass overwrite='any' if "
                "everything in it may be deleted" + path_hint(target),
                spec_id="SP-COMMIT-5",
            )

    def _refuse_nested(self, target: str) -> None:
        """A directory holding committed checkpoints (a manager's root, even one that is a
        checkpoint itself) is never replaced ([SP-COMMIT-5])."""
        inside = self.holds_checkpoints(target)
        if inside:
            raise CheckpointExistsError(
                f"{target!r} is a directory of checkpoints ({len(inside)}, newest by name "
                f"{inside[-1]!r}), such as a CheckpointManager's root; a save never replaces "
                "it. Save to a path inside it, or choose another path",
                spec_id="SP-COMMIT-5",
            )

    # ------------------------------------------------------------------ a save
    def staging_for(self, target: str, token: str) -> str:
        """The staging directory of the save ``token`` of ``target`` (beside it, hidden)."""
        parent, name = os.path.split(os.path.abspath(target).rstrip(os.sep))
        return os.path.join(parent, leftover_name(name, "tmp", token))

    def begin(self, target: str, token: str) -> str:
        """Create the staging directory of a save of ``target``, locked; returns it."""
        staging = self.staging_for(target, token)
        self.create_staging(staging)
        return staging

    def create_staging(self, staging: str) -> None:
        """Create ``staging`` (and its parents) and take its lock. A clean-up that got in
        between (it saw an unlocked directory) makes us create it again: we hold the lock on
        the directory at that path before returning, or raise SaveFailedError."""
        try:
            os.makedirs(os.path.dirname(staging), exist_ok=True)
        except OSError as e:
            raise self._cannot_create(staging, e) from e
        for attempt in range(200):
            try:
                os.mkdir(staging)
            except FileExistsError:
                if attempt == 0:
                    raise SaveFailedError(
                        f"the staging directory {staging!r} exists already: pass another token"
                    ) from None
            except OSError as e:  # a parent that is a file, no permission, a full disk
                raise self._cannot_create(staging, e) from e
            if self._locks.take(staging):
                if self._locks.holds(staging):
                    return
                self._locks.release(staging)  # deleted under us before we locked it
            elif os.path.isdir(staging) and dir_locked(staging) is None:
                return  # no flock on this file system: age guards it
            time.sleep(0.005)  # a clean-up is deleting it: let it finish, then again
        raise SaveFailedError(
            f"cannot hold the staging directory {staging!r}: another process kept deleting it"
        )

    @staticmethod
    def _cannot_create(staging: str, e: OSError) -> SaveFailedError:
        return SaveFailedError(
            f"cannot create the save's directory {staging!r}: {e.strerror} ({e.filename!r}); "
            "every parent of the checkpoint path must be a writable directory"
        )

    def write_manifest(self, staging: str, data: Union[bytes, Manifest]) -> None:
        """Write the manifest (bytes, or a :class:`Manifest` encoded here) into ``staging``
        durably (under a temporary name, renamed): the last file of a save, after every
        rank's files are durable ([SP-COMMIT-1])."""
        if isinstance(data, Manifest):
            data = encode_manifest(data)
        tmp = os.path.join(staging, MANIFEST_NAME + ".partial")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
        except OSError as e:
            if e.filename is not None or e.errno is None:
                raise
            # write(2) and fsync(2) name no file: a full disk said only "No space left".
            raise OSError(e.errno, e.strerror, tmp) from e
        os.replace(tmp, os.path.join(staging, MANIFEST_NAME))
        self._sync_dir(staging)

    def publish(
        self,
        staging: str,
        target: str,
        *,
        overwrite: Overwrite,
        protect: Sequence[str] = (),
        is_output: Optional[Callable[[str], bool]] = None,
    ) -> None:
        """Rename the durable ``staging`` to ``target`` in one atomic step: NOREPLACE for a
        fresh path, EXCHANGE to replace, else the old one moved aside first to ``-old-``
        ([SP-COMMIT-4]). Releases the save's lock; a bad ``overwrite`` is refused first,
        touching nothing (the save still holds its lock and aborts)."""
        overwrite = check_overwrite(overwrite)
        try:
            self._publish(staging, os.path.abspath(target), overwrite, protect, is_output)
        finally:
            self._locks.release(staging)

    def _publish(
        self,
        staging: str,
        target: str,
        overwrite: Overwrite,
        protect: Sequence[str],
        is_output: Optional[Callable[[str], bool]],
    ) -> None:
        parent = os.path.dirname(target)
        if os.path.lexists(target):
            self.check_target(target, overwrite, protect, is_output)  # again: a race
            # Lock the checkpoint being replaced, so no clean-up deletes or restores it from
            # under us while it sits under a hidden name (the lock moves with its inode).
            self._locks.take(target)
            try:
                if exchange_dirs(staging, target):
                    # One atomic step: the new checkpoint at target, the old one under the
                    # staging name, locked by us: delete it [SP-COMMIT-6].
                    self._sync_dir(parent)
                    self._delete_tree(staging)
                    return
                parsed = parse_leftover(os.path.basename(staging))
                assert parsed is not None, staging  # begin() named it
                token = parsed[2]
                old = os.path.join(parent, leftover_name(os.path.basename(target), "old", token))
                os.rename(target, old)  # never deleted before the new one is in
                os.rename(staging, target)
                self._sync_dir(parent)
                self._delete_tree(old)
            finally:
                self._locks.release(target)
            return
        rc = renameat2(staging, target, RENAME_NOREPLACE)
        if rc is None:
            os.rename(staging, target)
        elif rc in (errno.EEXIST, errno.ENOTEMPTY):
            raise CheckpointExistsError(
                f"another save committed {target!r} while this one was "
                "writing; this save was discarded (save to another "
                "path, or pass overwrite=True to replace it)",
                spec_id="SP-COMMIT-5",
            )
        elif rc != 0:
            raise OSError(rc, os.strerror(rc), target)
        self._sync_dir(parent)

    def abort(self, staging: str) -> None:
        """Remove what a failed save staged, then drop its lock; never touches the target.
        A writer thread still finishing a file may re-create a directory inside while the
        tree is removed, so look again (nothing re-creates the staging directory itself)."""
        try:
            if os.path.islink(staging) or os.path.isfile(staging):
                os.remove(staging)  # a converter's staged single file
            for _ in range(3):
                shutil.rmtree(staging, ignore_errors=True)
                if not os.path.lexists(staging):
                    break
                time.sleep(0.05)
        finally:
            self._locks.release(staging)

    # ------------------------------------------------------------------ retention
    def remove(self, target: str) -> bool:
        """Delete the committed checkpoint ``target``: locked, renamed to a hidden name (one
        atomic step: a reader then fails with 'no checkpoint', never reads half a tree),
        then deleted. Refuses anything but a committed checkpoint; returns False, touching
        nothing, when it is gone or another process holds its lock (a save replacing it)."""
        target = os.path.abspath(target)
        if self.state(target) != "committed":
            if os.path.lexists(target):
                raise CheckpointNotFoundError(
                    f"{target!r} is not a committed checkpoint (no "
                    f"{MANIFEST_NAME}); retention removes "
                    "checkpoints only: nothing removed",
                    spec_id="SP-COMMIT-3",
                )
            return False
        refuse_if_referenced(target, "removing the checkpoint")  # [SP-PACK-11]
        if not self._try_lock(target):
            return False
        hidden = self.staging_for(target, os.urandom(6).hex())
        try:
            try:
                os.rename(target, hidden)
            except FileNotFoundError:
                return False
            self._sync_dir(os.path.dirname(target))
            self._delete_tree(hidden)
        finally:
            self._locks.release(target)
            self._locks.release(hidden)
        return True

    # ------------------------------------------------------------------ leftovers
    def leftovers(self, directory: str, *, now: Optional[float] = None) -> list[Any]:
        """The :class:`Leftover` directories of saves directly in ``directory``. ``now`` is
        not used: a lock, not an age, tells a live save here."""
        out = []
        directory = os.path.abspath(directory)
        try:
            names = sorted(os.listdir(directory))
        except FileNotFoundError:
            return []
        for n in names:
            parsed = parse_leftover(n)
            p = os.path.join(directory, n)
            if parsed is None or os.path.islink(p) or not os.path.isdir(p):
                continue
            try:
                lo = Leftover(
                    p,
                    os.path.join(directory, parsed[0]),
                    parsed[1],
                    parsed[2],
                    os.path.isfile(os.path.join(p, MANIFEST_NAME)),
                    newest_mtime(p),
                    dir_locked(p),
                )
            except FileNotFoundError:  # removed while we looked: by its own save
                continue
            out.append(lo)
        return out

    def restore(self, leftover: str, target: str) -> bool:
        """Rename the leftover back to ``target`` (never replacing anything); False, touching
        nothing, when a live save holds its lock."""
        if not self._try_lock(leftover):
            return False
        try:
            rc = renameat2(leftover, target, RENAME_NOREPLACE)
            if rc is None:
                if os.path.lexists(target):
                    rc = errno.EEXIST
                else:
                    os.rename(leftover, target)
                    rc = 0
            if rc in (errno.EEXIST, errno.ENOTEMPTY):
                raise CheckpointExistsError(
                    f"cannot restore {leftover!r}: {target!r} appeared meanwhile; nothing was moved"
                )
            if rc != 0:
                raise OSError(rc, os.strerror(rc), target)
            self._sync_dir(os.path.dirname(os.path.abspath(target)))
        finally:
            self._locks.release(leftover)
        return True

    def discard(self, leftover: str, *, now: Optional[float] = None) -> bool:
        """Delete a leftover no live save holds; False, touching nothing, when one does;
        InvalidOptionError, touching nothing, for a path whose name is not a leftover's
        (a checkpoint, a user's directory). ``now`` is not used (see :meth:`leftovers`)."""
        if parse_leftover(os.path.basename(os.path.abspath(leftover).rstrip(os.sep))) is None:
            raise InvalidOptionError(
                f"{leftover!r} is not a leftover of a save (its name is "
                "not .<name>.shardpoint-tmp-<token> or -old-<token>); "
                "nothing removed"
            )
        if not self._try_lock(leftover):
            return False
        try:
            self._delete_tree(leftover, strict=True)
        finally:
            self._locks.release(leftover)
        return True

    # ------------------------------------------------------------------ helpers
    def _try_lock(self, path: str) -> bool:
        """Take ``path``'s lock for this process without waiting: True when we hold it now
        (or the file system has no locks), False when someone else does or it is gone."""
        if self._locks.take(path):
            return True
        return dir_locked(path) is None and os.path.lexists(path)

    def _delete_tree(self, path: str, strict: bool = False) -> None:
        """Delete the directory tree ``path`` (ours: locked or just renamed by us). Errors
        (a read-only file system) raise with ``strict``; else what stays is a leftover that a
        later clean-up removes."""
        if os.path.islink(path) or not os.path.isdir(path):
            if os.path.lexists(path):
                os.remove(path)
        else:
            shutil.rmtree(path, onerror=_raise_unless_gone if strict else _ignore)
        self._sync_dir(os.path.dirname(os.path.abspath(path)))


if TYPE_CHECKING:
    # static checks that the class satisfies the protocol it claims (runtime_checkable
    # compares method names only); mypy fails here on a regression
    from shardpoint_core.commit.base import Committer

    def _is_committer_posixcommitter(x: PosixCommitter) -> Committer:
        return x
