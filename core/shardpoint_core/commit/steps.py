"""A manager's root of numbered steps, on any store: what both managers do to it, in one place.

``shardpoint.CheckpointManager`` and ``shardpoint_jax.CheckpointManager`` keep one checkpoint
per step below a root (``<root>/step_00000042``, :mod:`shardpoint_core.format.policy` names them).
A root is a local directory (plain path or ``file://``) or a prefix on an object store
(``s3://bucket/run``, ``gs://bucket/run``). :class:`StepRoot` gives a manager, whatever the
root: the path of a step, the committed steps (those with a manifest, [SP-COMMIT-3], under
the name a manager writes), the committed checkpoints under other names (``strays``: reported,
never counted or removed), the removal of one (retention: through the committer,
[SP-COMMIT-14] on object stores) and the clean-up of what crashed saves left, under the rule
that a manager built by an observer never deletes what a live save holds:

- on local files, the committer's lock rule ([SP-COMMIT-6],
  :func:`shardpoint_core.commit.cleanup.clean_leftovers`);
- on object stores, a save prefix that no marker names is removed only once its save's
  lease expired ([SP-COMMIT-16]: a live save renews it) and its newest object is older than
  ``min_age_s`` ([SP-COMMIT-15]; 15 minutes by default, as ``recover``); a prefix without a
  lease is not the protocol's and is never touched. A save prefix a marker names is never a
  leftover, and retention deletes only what a marker names, so neither touches a save in
  progress.

Example::

    steps = StepRoot("s3://bucket/run")          # or "/ckpt/run"
    steps.path(5)                                # 's3://bucket/run/step_00000005'
    for s in steps.all_steps()[:-3]:
        steps.remove(s)
    steps.clean_leftovers()
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, List, Optional

from shardpoint_core.commit.cleanup import DEFAULT_MIN_AGE_S, clean_leftovers
from shardpoint_core.commit.recovery import committer_of
from shardpoint_core.commit.routing import default_committer
from shardpoint_core.format.policy import parse_step, step_name
from shardpoint_core.format.spec import MANIFEST_NAME
from shardpoint_core.stores.location import locate
from shardpoint_core.stores.registry import check_path, is_local, local_path

log = logging.getLogger("shardpoint")


class StepRoot:
    """The steps below ``root`` (a local directory or an object-store URL). ``backend``: the
    storage backend saves and loads use (its committer removes steps); None picks the
    default one for the root's kind. ``local_committer``: the committer of a local root
    when not the backend's (the JAX front end passes its own ``PosixCommitter``); an
    object-store root always uses its backend's.

    The JAX manager on an object store: ``StepRoot(root, local_committer=PosixCommitter())``
    serves both kinds of root; ``path``/``all_steps``/``remove``/``clean_leftovers`` are all a
    manager needs of its root besides saving and loading."""

    def __init__(
        self,
        root: Any,
        *,
        backend: Any = None,
        local_committer: Any = None,
        call: str = "CheckpointManager",
    ) -> None:
        self.local = is_local(root)
        if self.local:
            self.root = os.path.abspath(local_path(os.fspath(root), call))
            committer = local_committer
            if committer is None:
                committer = committer_of(backend)
            self._locate = None
        else:
            check_path(root, call)  # a scheme nobody registered: refused here
            self.root = os.fspath(root).rstrip("/")
            if backend is None:
                committer, self._locate = default_committer(), lambda p: locate(p, call).pair()
            elif not callable(getattr(backend, "locate", None)):
                from shardpoint_core.format.errors import InvalidOptionError

                raise InvalidOptionError(
                    f"{call}: {self.root!r} is on an object store, and backend="
                    f"{type(backend).__name__} works on local paths; drop backend= (the "
                    "object-store backend is used) or pass an ZarrBackend"
                )
            else:
                committer, self._locate = backend.committer, backend.locate
        self.committer = committer
        if committer.state(self.root) == "committed":
            from shardpoint_core.format.errors import InvalidOptionError

            raise InvalidOptionError(
                f"{call}: {self.root!r} is a checkpoint itself (it has a manifest); a manager's "
                "root is a directory of steps. Use a new directory (for example its parent "
                "or a sibling); saving steps inside a checkpoint would let a replacement of "
                "that checkpoint take them along"
            )

    # -- reading (any process) ------------------------------------------------------------
    def path(self, step: int) -> str:
        """The path (or URL) of ``step``; it may not exist."""
        return (
            os.path.join(self.root, step_name(step))
            if self.local
            else f"{self.root}/{step_name(step)}"
        )

    def all_steps(self) -> List[int]:
        """Committed steps, oldest first: a step counts once its manifest is there, and only
        under the name a manager writes (``step_00000042``; ``step_42`` is someone else's)."""
        return sorted(
            n
            for n in map(parse_step, self._committed(lambda name: parse_step(name) is not None))
            if n is not None
        )

    def strays(self) -> List[str]:
        """The committed checkpoints directly below the root under names no manager writes
        (``step_7`` saved by hand, ``final``), sorted: a manager reports them and never
        counts, keeps or removes them."""
        return sorted(self._committed(lambda name: parse_step(name) is None))

    def report_strays(self, known: List[str]) -> List[str]:
        """:meth:`strays` now, each one not in ``known`` (what the manager reported before)
        logged once as a warning; a failure to list is logged too and ``known`` returned: a
        report only, never a failure of the save whose retention asked."""
        try:
            found = self.strays()
        except OSError as e:  # ShardpointError included: a report only
            log.warning(
                "shardpoint: cannot list %s for checkpoints it did not write (%s)", self.root, e
            )
            return known
        for name in sorted(set(found) - set(known)):
            log.warning(
                "shardpoint: %s/%s is a committed checkpoint this manager did not "
                "write (its steps are named like %s): not a step, never counted, "
                "kept or removed by retention",
                self.root,
                name,
                step_name(42),
            )
        return found

    def _committed(self, wanted: Any) -> List[str]:
        """The names directly below the root that ``wanted(name)`` accepts and that hold a
        committed checkpoint (one listing, then a manifest check per accepted name)."""
        if self.local:
            try:
                names = os.listdir(self.root)
            except (FileNotFoundError, NotADirectoryError):
                return []
            return [
                n
                for n in names
                if not n.startswith(".")
                and wanted(n)
                and os.path.isfile(os.path.join(self.root, n, MANIFEST_NAME))
            ]
        assert self._locate is not None
        store, key = self._locate(self.root)
        prefix = f"{key}/" if key else ""
        return [
            n
            for n in dict.fromkeys(_children(store, prefix))
            if wanted(n) and store.head(f"{prefix}{n}/{MANIFEST_NAME}") is not None
        ]

    # -- changing it (the coordinator of the job that owns the root) -----------------------
    def remove(self, step: int) -> bool:
        """Delete committed ``step`` through the committer (retention): on files locked,
        hidden by one rename, then deleted; on object stores the marker first, then the
        objects it named. False where it is gone (or, on files, a live save holds it)."""
        removed: bool = self.committer.remove(self.path(step))
        return removed

    def retain(self, policy: Any, metrics_of: Any) -> List[str]:
        """Apply retention ``policy`` (:mod:`shardpoint_core.format.policy`) to the committed steps:
        remove the ones it does not keep, through the committer. Never raises for what it
        finds: a step whose metrics cannot be read (a damaged manifest) is kept, and a removal
        that fails is left for later; each is returned as a warning, so that a save that
        committed is never reported failed because of an older step."""
        from shardpoint_core.format.errors import ShardpointError
        from shardpoint_core.format.policy import retained

        warnings: List[str] = []
        unreadable: set[Any] = set()

        def metrics(step: int) -> Any:
            try:
                return metrics_of(step)
            except (ShardpointError, OSError) as e:
                if step not in unreadable:
                    unreadable.add(step)
                    warnings.append(
                        f"step {step}: its metrics cannot be read ({e}); kept by retention"
                    )
                return {}

        steps = self.all_steps()
        keep = retained(policy, steps, metrics) | unreadable
        keep |= self._bases_of(keep, steps)
        for s in steps:
            if s in keep:
                continue
            try:
                self.remove(s)
            except (ShardpointError, OSError) as e:
                warnings.append(f"step {s}: retention could not remove it ({e}); left as it is")
        return warnings

    def _bases_of(self, keep: Any, steps: List[int]) -> set[Any]:
        """The steps that the kept steps build on ([SP-PACK-9]), directly or through their
        bases: kept too, whatever the policy says, until nothing kept refers to them
        ([SP-PACK-11])."""
        from shardpoint_core.commit.references import bases_closure, name_of

        names = {name_of(self.path(s)): s for s in steps}
        kept = [name_of(self.path(s)) for s in keep if s in names.values()]
        return {names[n] for n in bases_closure(self.root, [k for k in kept if k]) if n in names}

    def clean_leftovers(
        self, min_age_s: float = DEFAULT_MIN_AGE_S, now: Optional[float] = None
    ) -> list[Any]:
        """Remove what crashed saves of steps left below the root, never what a live save
        holds (module docstring); returns the paths (URLs) acted on."""
        owns = _owns_step
        if self.local:
            return clean_leftovers(self.committer, self.root, owns, min_age_s)
        now = time.time() if now is None else now
        done = []
        for lo in self.committer.leftovers(self.root, now=now):
            if (
                not owns(lo.target.rpartition("/")[2])
                or lo.in_use
                or now - lo.newest_mtime < min_age_s
            ):
                continue
            if self.committer.discard(lo.path, now=now):
                done.append(lo.path)
        return done


def _owns_step(name: str) -> bool:
    return parse_step(name) is not None


def _children(store: Any, prefix: str) -> List[str]:
    """The names one level below ``prefix`` (``step_00000005`` for ``run/step_00000005/..``):
    one delimited listing where the store offers it (``list_children``), else from the full
    listing."""
    fast = getattr(store, "list_children", None)
    if fast is not None:
        return list(fast(prefix))
    names: dict[str, Any] = {}
    for info in store.list(prefix):
        head, sep, _ = info.key[len(prefix) :].partition("/")
        if sep:
            names[head] = None
    return list(names)
