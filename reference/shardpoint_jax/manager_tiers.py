"""The tiered half of :class:`shardpoint_jax.CheckpointManager`: the policy and the durable
copies are the core's, shared with the torch manager
(:mod:`shardpoint_core.transactions.tiers`); here is how the JAX manager's processes agree
on them (through :mod:`shardpoint_jax.comm`).

- save: every process saves into memory when the step is due (synchronously: a copy into
  host memory and to the peers; with ``incremental=True`` building on the newest memory step
  before it, each durable copy on the newest storage step before it); when it is due to
  storage, process 0 starts the durable copy of that memory step in the background (after
  the previous copy finished). Then the finished copy is reported on every process,
  storage retention applied, old memory steps removed. A memory step of the same number is
  replaced (memory is the manager's scratch: a resumed job saves its steps again: with
  ``incremental``, later memory steps built on it are removed first,
  :mod:`shardpoint_core.transactions.tier_rollback`); ``force`` applies to storage.
- load: the newest step across memory and storage (or the one asked for), each checked
  before use; a memory step with missing or damaged pieces gives way to the same step in
  storage, then to the next older step; ``last_load`` says what came from where and what was
  passed over.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import jax

from shardpoint_core.format.errors import ShardpointError as CoreError
from shardpoint_core.transactions.tiers import Exchange, Tiers, load_across_tiers, tier_plan
from shardpoint_jax import errors as E
from shardpoint_jax.loading import load as spj_load
from shardpoint_jax.memory_tier import all_gather, all_true, broadcast

log = logging.getLogger("shardpoint")
METRICS_KEY = "__metrics__"


def save_tiered(mgr: Any, n: int, tree: Any, force: bool) -> None:
    """``mgr.save`` with a memory tier, once every process agreed on step ``n``."""
    tiers: Tiers = mgr._tiers
    to_memory, to_storage = tiers.due(n)
    if to_memory:
        backend = mgr.backend  # the layout of every step, in memory and in storage
        if mgr.incremental:
            from shardpoint_core.transactions.packed import step_backend
            from shardpoint_core.transactions.tier_rollback import drop_rolled_back

            # a rolled-back run: its later memory steps built on ``n`` go first
            _tell(mgr, drop_rolled_back(tiers, _exchange(), n, lambda: report(mgr, True)))
            # then it builds on the newest memory step before n (process 0's choice)
            mine = (tiers.memory_base(n) or "").encode() if jax.process_index() == 0 else None
            base = broadcast("manager-tiers-base")(mine).decode()
            backend = step_backend(mgr.backend, base or None)
        tiers.memory.save(tree, n, overwrite=True, backend=backend)
    report(mgr, block=to_storage, start=(n, mgr.path(n), force) if to_storage else None)


def _exchange() -> Exchange:
    rank = jax.process_index()
    return Exchange(rank, rank == 0, broadcast("manager-tiers"), all_gather("manager-tiers"))


def report(mgr: Any, block: bool, start: Optional[tuple] = None) -> None:
    """Collective: process 0 collects the finished durable copy (waiting for it with
    ``block``), applies storage retention after a committed one, starts the copy ``start``
    where given, and removes old memory steps; every process then hears what failed or was
    retried (``tier_warnings``, logged) and training goes on."""
    tiers: Tiers = mgr._tiers
    base = mgr._storage_base if mgr.incremental else None  # what a durable copy builds on
    got = tiers.report(
        _exchange(), block, start, mgr.backend, mgr._retain, mgr._clean_leftovers, base=base
    )
    if jax.process_index() != 0:
        mgr._metrics.clear()
    _tell(mgr, got)


def _tell(mgr: Any, warnings: list) -> None:
    """What the tiers' upkeep reported, logged and kept in ``tier_warnings``."""
    for w in warnings:
        log.warning("shardpoint: %s", w)
    mgr.tier_warnings.extend(warnings)


def load_tiered(
    mgr: Any, want: Optional[int], err: Optional[BaseException], target: Any, strict: bool
) -> Any:
    """``mgr.load`` with a memory tier (see the module)."""
    tiers: Tiers = mgr._tiers

    def decide(want: Optional[int]) -> list:
        mgr._clean_leftovers()
        plan = tier_plan(want, tiers.memory.steps(), mgr.all_steps())
        if not plan:
            what = f"step {want} is" if want is not None else "no step is"
            raise E.CheckpointNotFoundError(
                f"{what} committed in memory ({tiers.memory.url(0).rsplit('/', 1)[0]}) or in "
                f"storage ({mgr.root!r}): nothing to resume from"
            )
        return plan

    plan = mgr._agreed("manager-load", want, err, decide)
    tree, mgr.last_load = load_across_tiers(
        plan,
        lambda s, in_sto: tiers.memory.restore(
            target, step=s, strict=strict, fallback=mgr.path(s) if in_sto else None
        ),
        lambda s: spj_load(mgr.path(s), target, strict=strict),
        mgr.path,
        lambda ok: all_true("manager-load-ok", ok),
        (CoreError, OSError),
        f"memory ({tiers.memory.url(0).rsplit('/', 1)[0]}) or from storage ({mgr.root!r})",
        want,
    )
    if target is None and isinstance(tree, dict):
        tree.pop(METRICS_KEY, None)
    return tree
