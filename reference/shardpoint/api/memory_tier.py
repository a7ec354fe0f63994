"""The memory tier: checkpoints in the hosts' shared memory, replicated to ``k`` other hosts,
and the recovery of a restarted job from what survived a host loss.

A :class:`MemoryTier` is started collectively by every rank of a job. Each rank serves its
host's shared memory over a side channel (:mod:`shardpoint_core.stores.peers`), and the job's
``shm://<job>/`` store (:class:`~shardpoint_core.stores.shm.ShmStore`) replicates every object
it puts to the next ``k`` hosts of a ring of the job's hosts (hosts named by
:func:`~shardpoint.exchange.topology.host_identity`; distinct hosts, so a checkpoint survives
the loss of any ``k`` consecutive hosts of the ring, any one host with the default ``k=1``).
A memory checkpoint is an ordinary checkpoint (same format, planning, checksums and commit
protocol: the object-store marker, written by the coordinator once every rank's puts, and so
every replica, are in place).

:meth:`MemoryTier.restore` is the recovery: it finds the newest committed memory step that a
reachable host holds, checks which tensors have every object on some surviving host, loads
those from memory (any world size: the load planner reshards) and the others from the
durable checkpoint given as ``fallback``, and says which came from where. Every object is
checked (crc32c) before use; a damaged copy falls back to the next host's, then to storage.

Example (every rank)::

    tier = MemoryTier("run42", k=1, budget_bytes=8 << 30)
    tier.save(state, step=100, keep=2)               # into memory, replicated
    restored = tier.restore(like=state, fallback="/ckpt/step_{step}")
    restored.sources                                  # {"model/w": "memory", ...}
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import msgpack

from shardpoint.exchange.comm import Comm
from shardpoint.planning.load_planner import LoadOptions
from shardpoint.tree.flatten import flatten_state
from shardpoint_core.format import errors
from shardpoint_core.format.keys import encode_key
from shardpoint_core.stores.peers import host_identity
from shardpoint_core.transactions.memory_tier import STEP as _STEP
from shardpoint_core.transactions.memory_tier import (
    HostTier,
    Restored,
    chunk_objects,
    every_chunk,
)

Fallback = Union[str, Callable[[int], Optional[str]], None]


def _leaf_keys(tree: Any, path: Tuple[Any, ...] = ()) -> List[str]:
    if isinstance(tree, dict):
        return [k for name, v in tree.items() for k in _leaf_keys(v, path + (name,))]
    if isinstance(tree, (list, tuple)):
        return [k for i, v in enumerate(tree) for k in _leaf_keys(v, path + (i,))]
    return [encode_key(path)] if path else []


def _split(tree: Any, storage: Set[str], path: Tuple[Any, ...] = ()) -> Tuple[Any, Any]:
    """(the part of ``tree`` to load from memory, the part from storage); None for an empty
    part. Dicts split by entry; a list or tuple goes whole to storage where any of its leaves
    must (a load cannot skip items of a sequence)."""
    if isinstance(tree, dict):
        mem: Dict[Any, Any] = {}
        sto: Dict[Any, Any] = {}
        for name, v in tree.items():
            m, s = _split(v, storage, path + (name,))
            if m is not None:
                mem[name] = m
            if s is not None:
                sto[name] = s
        return (mem or None), (sto or None)
    if isinstance(tree, (list, tuple)) or not path:
        keys = _leaf_keys(tree, path)
        return (None, tree) if any(k in storage for k in keys) else (tree, None)
    return (None, tree) if encode_key(path) in storage else (tree, None)


def _merge(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for k, v in b.items():
            out[k] = _merge(out.get(k), v)
        return out
    return a


class MemoryTier(HostTier):
    """Checkpoints of job ``job`` in host memory, replicated to ``k`` other hosts (see the
    module; the host ring, budget, listing and removal are the core's
    :class:`~shardpoint_core.transactions.memory_tier.HostTier`). Collective: every rank of
    ``group`` constructs it, saves and restores.

    ``budget_bytes``: the shared memory a host may hold for this job (None: no cap).
    ``shm_dir``: where host memory is (default ``$SHARDPOINT_SHM_DIR`` or
    ``/dev/shm/shardpoint``). ``host_id``: this rank's host (default: as the launcher says,
    :func:`host_identity`). ``advertise``: the address other hosts reach this one at.
    ``timeout_s``: how long a peer may take to answer one request."""

    def __init__(
        self,
        job: str,
        *,
        k: int = 1,
        budget_bytes: Optional[int] = None,
        shm_dir: Optional[str] = None,
        host_id: Optional[str] = None,
        group: Any = None,
        advertise: Optional[str] = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.group = group
        self.comm = Comm(group)
        super().__init__(
            job,
            k=k,
            budget_bytes=budget_bytes,
            shm_dir=shm_dir,
            host=host_identity(host_id),
            rank=self.comm.rank,
            coordinator=self.comm.is_coordinator,
            broadcast=self.comm.broadcast_bytes,
            all_gather=self.comm.all_gather_bytes,
            advertise=advertise,
            timeout_s=timeout_s,
        )
        self._hgroup: Any = None

    # -- saving ---------------------------------------------------------------------------
    def _check_budget(self, state: Any) -> None:
        """Refuse (:class:`MemoryBudgetError`, every rank) a save whose estimated bytes would
        take a host past the budget, before anything is written
        (:meth:`~shardpoint_core.transactions.memory_tier.HostTier.check_budget`)."""
        flat = flatten_state(state, replica=(self.comm.rank,))
        self.check_budget(sum(t.holding.nbytes for t in flat.tensors if not any(t.holding.replica)))

    def save(
        self,
        state: Any,
        step: int,
        *,
        keep: Optional[int] = None,
        overwrite: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Save ``state`` as memory step ``step`` (collective; ``kwargs`` go to
        :func:`shardpoint.save`), committed once every object has its ``k`` replicas. Then,
        with ``keep``, delete all but the newest ``keep`` committed memory steps (the only
        eviction there is). Returns the :class:`~shardpoint.SaveResult`."""
        from shardpoint.api.checkpointer import save

        self.check_saveable()
        self._check_budget(state)
        res = save(state, self.url(step), group=self.group, overwrite=overwrite, **kwargs)
        if keep is not None:
            if keep < 1:
                raise errors.InvalidOptionError(
                    f"keep={keep}: keep at least the step just saved (keep >= 1)"
                )
            if self.comm.is_coordinator:
                for old in self.steps()[:-keep]:
                    self.remove(old)
            self.comm.all_true(True)  # no rank leaves (and stops serving) before that
        return res

    # -- recovery -------------------------------------------------------------------------
    def _needed(self, like: Any, arrays: Dict[str, Any]) -> Dict[str, str]:
        """object key -> tensor key: the objects this rank's part of ``like`` meets (its
        chunks per-array, the data objects holding them packed; the whole tensors without
        ``like``)."""
        out: Dict[str, str] = {}
        if like is None:
            return out
        for t in flatten_state(like, replica=(self.comm.rank,)).tensors:
            h = t.holding
            if h.key not in arrays:
                continue
            for k in chunk_objects(arrays[h.key], h.offset, h.shape):
                out[k] = h.key
        return out

    def _host_group(self) -> Any:
        """A gloo group of this host's ranks (made by them alone, on first use)."""
        if self._hgroup is None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                return None
            mine = [self.comm._global(r) for r, h in enumerate(self.rank_hosts) if h == self.host]
            self._hgroup = dist.new_group(mine, backend="gloo", use_local_synchronization=True)
        return self._hgroup

    def restore(
        self,
        like: Any = None,
        *,
        step: Optional[int] = None,
        fallback: Fallback = None,
        strict: bool = True,
    ) -> Restored:
        """Load the newest committed memory step (or ``step``) from the surviving hosts'
        memory, reading from ``fallback`` (the durable checkpoint of the same step: a path,
        a path with ``{step}``, or a function of the step) only the tensors no survivor holds
        whole. Collective; any world size. Raises
        :class:`~shardpoint.errors.IncompleteCheckpointError` where memory lacks pieces and no
        fallback was given, naming them.

        Each host first gathers here, checked, the objects its ranks' parts of ``like`` meet
        (from the peers that hold them), then each rank loads its part from this host's copy
        of the step (a plain checkpoint directory in shared memory: the fast local path)."""
        from shardpoint.api.checkpointer import load

        t0 = time.perf_counter()
        d: Dict[str, Any] = msgpack.unpackb(
            self.comm.broadcast_bytes(
                msgpack.packb(self.decide(step), use_bin_type=True)
                if self.comm.is_coordinator
                else None
            ),
            raw=False,
        )
        s = d["step"]
        fb: Optional[str] = None
        if callable(fallback):
            fb = fallback(s) if s is not None else None
        elif isinstance(fallback, str) and not (s is None and "{step}" in fallback):
            fb = fallback.format(step=s) if "{step}" in fallback else fallback
        out = Restored(
            None,
            s,
            memory_url=self.url(s) if d["storage"] is not None else "",
            missing_objects=list(d["missing"]),
            reason=d["reason"],
        )
        nbytes = {k: v[2] for k, v in d["arrays"].items()}
        out.timings["decide"] = time.perf_counter() - t0

        def from_storage(why: str) -> Restored:
            if not fb:
                raise errors.IncompleteCheckpointError(
                    f"memory tier shm://{self.job}: {why}; no durable fallback was given "
                    "(restore(..., fallback=PATH))"
                )
            out.tree = load(fb, like, group=self.group, strict=strict)
            out.storage_url, out.reason = fb, why
            out.sources = {
                k: "storage" for k in (_leaf_keys(like) if like is not None else sorted(nbytes))
            }
            out.memory_bytes, out.storage_bytes = 0, sum(nbytes.values())
            return out

        if d["storage"] is None:
            return from_storage(d["reason"])
        storage = set(d["storage"])
        why = (
            (
                f"{len(d['missing'])} object(s) of {len(storage)} tensor(s) are on no "
                f"surviving host (first: {d['missing'][0]})"
            )
            if storage
            else ""
        )
        if storage and (like is None or not fb):
            return from_storage(why)
        mem_like, sto_like = _split(like, storage) if storage else (like, None)
        # gather this host's part here, checked; a piece no host gives intact goes to storage
        need = self._needed(mem_like, {k: v for k, v in d["arrays"].items() if k not in storage})
        if like is None:  # the whole of every tensor
            need = every_chunk(d["arrays"])
        t0 = time.perf_counter()
        failed = self.materialize(list(d["meta"]) + sorted(need))
        out.timings["gather"] = time.perf_counter() - t0
        lost = sorted({need.get(k, "") for k in failed})
        lost_all = sorted(
            {
                t
                for b in self.comm.all_gather_bytes(msgpack.packb(lost, use_bin_type=True))
                for t in msgpack.unpackb(b, raw=False)
            }
        )
        if lost_all:
            if "" in lost_all or like is None or not fb:
                return from_storage(
                    f"{len(failed)} object(s) of step {s} could not be had "
                    f"intact from any host (first: {failed[0] if failed else '?'}"
                    " on some rank)"
                )
            storage |= set(lost_all)
            why = (why + "; " if why else "") + (
                f"{len(lost_all)} tensor(s) had no intact copy on any host"
            )
            mem_like, sto_like = _split(like, storage)
        if mem_like is None:
            return from_storage(why)
        here = os.path.join(self.store.root, f"{_STEP}{s}")
        t0 = time.perf_counter()
        err: Optional[errors.ShardpointError] = None
        tree = None
        try:  # each host from its own copy: the ranks of a host load together
            tree = load(
                here,
                mem_like,
                group=self._host_group(),
                strict=strict,
                options=LoadOptions(strategy="direct", host_id=self.host),
            )
        except errors.ShardpointError as e:  # agreed within this host's group only
            err = e
        # agreed by every rank: a load failing on one host alone sends every rank to
        # storage (or every rank raises), never one rank into a collective the others skip
        if not self.comm.all_true(err is None):
            why_failed = f"({err})" if err is not None else "on another host"
            if not fb:
                if err is not None:
                    raise err
                raise errors.IncompleteCheckpointError(
                    f"memory tier shm://{self.job}: the memory copy of step {s} failed to "
                    "load on another host; no durable fallback was given"
                )
            return from_storage(f"the memory copy of step {s} failed to load {why_failed}")
        out.timings["load"] = time.perf_counter() - t0
        if sto_like is not None:
            tree = _merge(tree, load(str(fb), sto_like, group=self.group, strict=strict))
            out.storage_url = str(fb)
        out.tree, out.reason = tree, why
        all_keys = _leaf_keys(like) if like is not None else sorted(nbytes)
        out.sources = {k: ("storage" if k in storage else "memory") for k in all_keys}
        out.storage_bytes = sum(n for k, n in nbytes.items() if k in storage)
        out.memory_bytes = sum(nbytes.values()) - out.storage_bytes
        return out
