"""A tiered ``load`` of either manager: which steps to try, in which tier and order
(:func:`tier_plan`), and the walk that takes the first one every rank loaded whole, passing
over the others with the reason (:func:`load_across_tiers`, :class:`LoadInfo`). Split from
:mod:`.tiers`, which holds the save side (the policy and the durable copies)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from shardpoint_core.format import errors

log = logging.getLogger("shardpoint")


@dataclass
class LoadInfo:
    """Where a manager's ``load`` took the state from: the ``step``; the ``tier``
    (``"memory"``, ``"storage"``, or ``"memory+storage"`` where memory lacked some tensors);
    the checkpoint's ``url`` (the memory one where any tensor came from memory); for every
    tensor key its source; ``reason``: why anything came from storage; ``skipped``: the newer
    steps passed over, each with why (missing or damaged pieces, a failed load)."""

    step: int
    tier: str
    url: str
    sources: Dict[str, str] = field(default_factory=dict)
    reason: str = ""
    skipped: List[str] = field(default_factory=list)


def tier_plan(step: Optional[int], memory: List[int], storage: List[int]) -> List[List[Any]]:
    """What a tiered ``load`` tries, in order: ``[step, in memory, in storage]`` for ``step``
    where given, else for every step either tier holds, newest first."""
    mem, sto = set(memory), set(storage)
    cands = [step] if step is not None else sorted(mem | sto, reverse=True)
    return [[s, s in mem, s in sto] for s in cands if s in mem or s in sto]


def load_across_tiers(
    plan: List[List[Any]],
    restore: Callable[[int, bool], Any],
    load_storage: Callable[[int], Any],
    path: Callable[[int], str],
    all_ok: Callable[[bool], bool],
    catch: Tuple[type[BaseException], ...],
    where: str,
    step: Optional[int],
) -> Tuple[Any, LoadInfo]:
    """A tiered ``load``'s walk over ``plan`` (:func:`tier_plan`), the same on every rank or
    process: each step from memory (``restore(step, in storage)``: a :class:`Restored`,
    pieces no survivor holds taken from storage) or from storage (``load_storage(step)``);
    the first that every rank loaded (``all_ok``, collective) is returned with its
    :class:`LoadInfo`, and one that failed anywhere (an error of ``catch`` here, or on
    another rank) gives way to the next older one, logged and listed in ``skipped``.
    CheckpointNotFoundError naming ``where`` (the tiers' locations) when none loads."""
    skipped: List[str] = []
    for s, in_mem, in_sto in plan:
        err: Optional[BaseException] = None
        tree, info = None, None
        try:
            if in_mem:
                r = restore(s, in_sto)
                kinds = set(r.sources.values()) or {"memory"}
                tree = r.tree
                info = LoadInfo(
                    s,
                    "+".join(k for k in ("memory", "storage") if k in kinds),
                    r.memory_url or r.storage_url,
                    dict(r.sources),
                    r.reason,
                )
            else:
                tree = load_storage(s)
                info = LoadInfo(s, "storage", path(s))
        except catch as e:
            err = e
        if all_ok(err is None):
            assert info is not None
            info.skipped = skipped
            return tree, info
        skipped.append(
            f"step {s} ({'memory' if in_mem else 'storage'}): "
            + (f"{type(err).__name__}: {err}" if err else "failed on another rank")
        )
        log.warning("shardpoint: passing over %s", skipped[-1])
    what = f"step {step}" if step is not None else "no step"
    raise errors.CheckpointNotFoundError(
        f"{what} could be loaded from {where}"
        + (": " + "; ".join(skipped) if skipped else ": nothing committed in either")
    )


__all__ = ["LoadInfo", "load_across_tiers", "tier_plan"]
