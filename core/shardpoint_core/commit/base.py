"""The committer seam: the one place that publishes, replaces and removes checkpoints.

Everything that makes a checkpoint visible, replaces one or deletes one goes through a
committer: saves (both front ends, sync and async), converters, ``recover``, and both
managers' retention and cleanup. Nothing else renames or deletes checkpoint paths. There is
one committer per kind of store: rename on POSIX file systems (a staging directory renamed
into place, [SP-COMMIT-4..6]), and a manifest-written-last protocol for object stores, which
have no rename.

Call order of a save (C = coordinator only): C ``check_target`` -> C ``begin`` -> every rank
writes below the staging location and makes it durable -> C ``write_manifest`` -> C
``publish`` (or C ``abort`` when any rank failed). Retention: C ``remove``. Recovery: C
``leftovers`` -> ``restore`` / ``discard``.

One situation, one behaviour and one error class on every store (the shipped contract,
:class:`shardpoint_core.commit.testing.CommitterTests`, checks it): ``overwrite`` is one of
False, True, ``"any"`` (else ``InvalidOptionError``); a committed checkpoint that may not be
replaced, or a leftover that cannot be restored without replacing something, is a
``CheckpointExistsError``; removing a location that holds something but no committed
checkpoint is a ``CheckpointNotFoundError`` and deletes nothing; ``discard`` of anything that
is not a leftover is an ``InvalidOptionError``.

The lock rule: whoever creates, replaces or deletes a location holds its lock meanwhile, and
``remove``/``restore``/``discard`` leave alone what another process holds. Implementations:
:class:`shardpoint_core.commit.posix.PosixCommitter` (``flock`` on the directory) and
:class:`shardpoint_core.commit.object_store.ObjectStoreCommitter` (a lease the save renews).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Union, runtime_checkable

from shardpoint_core.format.errors import InvalidOptionError
from shardpoint_core.format.manifest import Manifest

# False (refuse anything at the target), True (replace a committed checkpoint) or "any"
# (also a directory that is not a checkpoint, where the committer has such a thing)
Overwrite = Union[bool, str]
OVERWRITE_VALUES = (False, True, "any")


def check_overwrite(overwrite: object) -> Overwrite:
    """``overwrite`` if it is one of False, True or ``"any"``, else InvalidOptionError: every
    committer and front end takes this one type, never a value read as a truth value
    (``bool("no")`` is True)."""
    if overwrite is False or overwrite is True or overwrite == "any":
        return overwrite
    raise InvalidOptionError(
        f"overwrite={overwrite!r}: pass False (refuse anything at the path), True (replace a "
        "committed checkpoint or an empty directory) or 'any' (also a directory that is not a "
        "checkpoint, deleting what it holds)"
    )


@runtime_checkable
class Committer(Protocol):
    """Publishes checkpoints in one store. Methods raise :mod:`shardpoint_core.format.errors` types."""

    def state(self, target: str) -> str:
        """'missing', 'incomplete' (something there, no committed manifest) or 'committed'."""

    def check_target(self, target: str, overwrite: Overwrite) -> None:
        """Raise ``CheckpointExistsError`` where publishing to ``target`` would be refused
        ([SP-COMMIT-5]): a checkpoint there without ``overwrite``; a non-checkpoint without
        ``overwrite="any"``; a file or a directory of checkpoints whatever ``overwrite``."""

    def begin(self, target: str, token: str) -> str:
        """Create and lock the staging location of a save of ``target``; returns it."""

    def write_manifest(self, staging: str, data: Union[bytes, Manifest]) -> None:
        """The save's manifest (array paths relative to the staging location), after every
        rank's data is durable ([SP-COMMIT-1]): written durably into the staging directory
        where a rename publishes it, kept by the committer until ``publish`` where the
        manifest itself is the commit marker. A :class:`Manifest` is encoded here, once, in
        the form the committer publishes; bytes are an encoded manifest."""

    def publish(self, staging: str, target: str, *, overwrite: Overwrite) -> None:
        """Make the durable staged checkpoint visible at ``target`` in one atomic step: a
        crash leaves the previous checkpoint or the new one, never a mix."""

    def abort(self, staging: str) -> None:
        """Remove what a failed save staged; never touches its target."""

    def remove(self, target: str) -> bool:
        """Delete the committed checkpoint ``target`` (retention); False, touching nothing,
        where no checkpoint is there (gone, or only a save's own staging) or a live save
        holds it; ``CheckpointNotFoundError``, touching nothing, where ``target`` holds
        something that is not a committed checkpoint."""

    def leftovers(self, directory: str, *, now: Optional[float] = None) -> list[Any]:
        """What crashed saves and replacements left in ``directory`` ([SP-COMMIT-6]), and
        saves still running (``in_use``). ``now``: the time at which liveness is judged
        where a lease's age decides it (tests: a time past its expiry); default the clock."""

    def restore(self, leftover: str, target: str) -> bool:
        """Move a leftover checkpoint back to ``target``; never replaces anything; False,
        touching nothing, where a live save holds it."""

    def discard(self, leftover: str, *, now: Optional[float] = None) -> bool:
        """Delete a leftover that no live save holds; False, touching nothing, where one
        does; ``InvalidOptionError`` for anything that is not a leftover. ``now`` as in
        :meth:`leftovers`."""
