"""The tier policy of :class:`~shardpoint.api.manager.CheckpointManager`: the core's, shared
with the JAX manager (:mod:`shardpoint_core.transactions.tiers`: every ``memory_every`` steps
to the memory tier, every ``storage_every`` steps a durable copy of that memory step written
in the background by the coordinator, tried again after a failure that may pass, reported at
the next ``save`` or ``wait``, never stopping training)."""

from __future__ import annotations

from shardpoint_core.transactions.tiers import (
    CopyOutcome,
    Exchange,
    LoadInfo,
    Tiers,
    load_across_tiers,
    tier_plan,
)

__all__ = ["CopyOutcome", "Exchange", "LoadInfo", "Tiers", "load_across_tiers", "tier_plan"]
