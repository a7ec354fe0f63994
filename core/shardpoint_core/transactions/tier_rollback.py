"""A job rolled back to an earlier step (a restart from an older checkpoint, a rollback after
a loss spike) saves its steps again. With incremental memory steps ([SP-PACK-9]) the later
memory steps of the run it left may build on the step saved again, and replacing a base under
its referrers is refused ([SP-PACK-11]); those steps belong to the abandoned run, so both
managers remove them from memory first (their durable copies in storage stay)."""

from __future__ import annotations

from typing import Any, Callable, List

import msgpack

from shardpoint_core.commit.references import bases_closure, name_of, parent_of
from shardpoint_core.transactions.tiers import Exchange, Tiers


def rolled_back(memory: Any, step: int) -> List[int]:
    """The memory steps after ``step`` that build on memory step ``step``, directly or
    through others, newest first (a referrer before its base); empty where ``step`` is not
    in memory."""
    steps = memory.steps()
    if step not in steps:
        return []
    parent, name = parent_of(memory.url(0)), name_of(memory.url(step))
    return [
        s
        for s in steps[::-1]
        if s > step and name in bases_closure(parent, [str(name_of(memory.url(s)))])
    ]


def drop_rolled_back(
    tiers: Tiers, ex: Exchange, step: int, settle: Callable[[], None]
) -> List[str]:
    """Collective, before an incremental memory save of ``step``: the coordinator finds the
    later memory steps that build on ``step`` (:func:`rolled_back`); where there are any,
    ``settle`` (the manager's blocking upkeep: a durable copy in flight, maybe of one of
    them, ends first) runs on every rank, then the coordinator removes them. Returns what
    every rank is to report (nothing where no step was in the way)."""
    mine = msgpack.packb(rolled_back(tiers.memory, step)) if ex.coordinator else None
    stale = [int(s) for s in msgpack.unpackb(ex.broadcast(mine))]
    if not stale:
        return []
    settle()
    said: List[str] = []
    if ex.coordinator:
        left = set(tiers.memory.steps())
        gone = [s for s in stale if s in left]
        for s in gone:
            tiers.memory.remove(s)
        said.append(
            f"step {step} saved again (the run went back to before it): memory steps {gone} "
            f"built on it and were removed from memory; their durable copies, if any, are kept"
        )
    got = ex.broadcast(msgpack.packb(said) if ex.coordinator else None)
    return [str(w) for w in msgpack.unpackb(got)]


__all__ = ["rolled_back", "drop_rolled_back"]
