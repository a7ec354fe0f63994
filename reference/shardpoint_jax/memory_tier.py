"""The memory tier for JAX jobs: checkpoints in the hosts' shared memory, replicated to ``k``
other hosts, restored after a host loss from what survived.

The torch front end's tier, on the same core
(:class:`~shardpoint_core.transactions.memory_tier.HostTier`: the ring of hosts, the side
channel, the budget, the listing and removal of steps); what is JAX's own is the process
group (the distributed runtime's key-value store, :mod:`shardpoint_jax.comm`), the save
(:func:`shardpoint_jax.save` to ``shm://<job>/step_<n>``) and the restore. A memory
checkpoint is an ordinary checkpoint (same format, planning, checksums and commit); it is
committed once every process's pieces are on their host and its ``k`` replicas.

:meth:`MemoryTier.restore` takes the newest committed memory step a reachable host holds,
checks that every object of it is on some surviving host, and loads it (any world size and
sharding: a process reads the regions its target needs, from its host's copy or a peer's,
each object checked against its crc32c). Where objects are missing, damaged on every host,
or the load fails, it loads the same step from ``fallback`` (its durable copy) and says why.

Example (every process)::

    tier = spj.MemoryTier("run42", k=1, budget_bytes=8 << 30)
    tier.save(tree, step=100, keep=2)                 # into memory, replicated
    got = tier.restore(target=abstract_tree, fallback="/ckpt/step_{step}")
    got.tree, got.sources                             # {"w": "memory", ...}
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Union

import jax
import numpy as np

from shardpoint_core.stores.peers import host_identity
from shardpoint_core.transactions.memory_tier import HostTier, Restored
from shardpoint_jax import errors as E
from shardpoint_jax.comm import Comm
from shardpoint_jax.loading import load as spj_load
from shardpoint_jax.saving import save as spj_save
from shardpoint_jax.values import pack, unpack

Fallback = Union[str, Callable[[int], Optional[str]], None]


def broadcast(what: str) -> Callable[[Optional[bytes]], bytes]:
    """Process 0's bytes on every process (one call's fresh channel)."""

    def run(data: Optional[bytes]) -> bytes:
        c = Comm(what)
        return c.broadcast("b", data if c.rank == 0 and data is not None else b"")

    return run


def all_gather(what: str) -> Callable[[bytes], List[bytes]]:
    """Every process's bytes on every process, in process order."""

    def run(data: bytes) -> List[bytes]:
        c = Comm(what)
        got = c.gather("g", data)
        out = c.broadcast("all", pack(list(got)) if c.rank == 0 else b"")
        return list(unpack(out))

    return run


def all_true(what: str, ok: bool) -> bool:
    """Whether ``ok`` holds on every process (every process gets the same answer)."""
    return all(b == b"1" for b in all_gather(what)(b"1" if ok else b"0"))


def written_bytes(tree: Any) -> int:
    """The bytes this process writes of ``tree`` (an estimate for the budget): the shards of
    its jax.Arrays it holds the first replica of; numpy arrays on process 0."""
    n = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            n += sum(int(s.data.nbytes) for s in leaf.addressable_shards if s.replica_id == 0)
        elif isinstance(leaf, (np.ndarray, np.generic)) and jax.process_index() == 0:
            n += int(leaf.nbytes)
    return n


class MemoryTier(HostTier):
    """Checkpoints of job ``job`` in host memory, replicated to ``k`` other hosts (see the
    module). Collective: every process of the job constructs it, saves and restores, in the
    same order.

    ``budget_bytes``: the shared memory a host may hold for this job (None: no cap).
    ``shm_dir``: where host memory is (default ``$SHARDPOINT_SHM_DIR`` or
    ``/dev/shm/shardpoint``). ``host_id``: this process's host (default: as the launcher
    says, :func:`~shardpoint_core.stores.peers.host_identity`). ``advertise``: the address
    other hosts reach this one at. ``timeout_s``: how long a peer may take to answer one
    request."""

    def __init__(
        self,
        job: str,
        *,
        k: int = 1,
        budget_bytes: Optional[int] = None,
        shm_dir: Optional[str] = None,
        host_id: Optional[str] = None,
        advertise: Optional[str] = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.rank = jax.process_index()
        super().__init__(
            job,
            k=k,
            budget_bytes=budget_bytes,
            shm_dir=shm_dir,
            host=host_identity(host_id),
            rank=self.rank,
            coordinator=self.rank == 0,
            broadcast=broadcast("memory-tier-token"),
            all_gather=all_gather("memory-tier"),
            advertise=advertise,
            timeout_s=timeout_s,
        )

    def save(
        self,
        tree: Any,
        step: int,
        *,
        keep: Optional[int] = None,
        overwrite: bool = False,
        backend: Any = None,
    ) -> None:
        """Save ``tree`` as memory step ``step`` (collective), committed once every object has
        its ``k`` replicas. Then, with ``keep``, delete all but the newest ``keep`` committed
        memory steps. ``backend``: as :func:`shardpoint_jax.save`'s (None: the default, the
        packed layout)."""
        if keep is not None and keep < 1:
            raise E.InvalidOptionError(
                f"keep={keep}: keep at least the step just saved (keep >= 1)"
            )
        self.check_saveable()
        self.check_budget(written_bytes(tree))
        spj_save(self.url(step), tree, overwrite=overwrite, backend=backend)
        if keep is not None:
            if self.rank == 0:
                for old in self.steps()[:-keep]:
                    self.remove(old)
            all_true("memory-tier-kept", True)  # no process stops serving before that

    def restore(
        self,
        target: Any = None,
        *,
        step: Optional[int] = None,
        fallback: Fallback = None,
        strict: bool = True,
    ) -> Restored:
        """Load the newest committed memory step (or ``step``) from the surviving hosts'
        memory into ``target`` (as :func:`shardpoint_jax.load`); where it cannot be had whole
        and intact, the same step from ``fallback`` (a path, a path with ``{step}``, or a
        function of the step). Collective; any world size. Raises
        :class:`~shardpoint_jax.IncompleteCheckpointError` where memory cannot give it and no
        fallback was given, saying why."""
        d = unpack(
            broadcast("memory-tier-decide")(pack(self.decide(step)) if self.rank == 0 else None)
        )
        s = d["step"]
        fb: Optional[str] = None
        if callable(fallback):
            fb = fallback(s) if s is not None else None
        elif isinstance(fallback, str) and not (s is None and "{step}" in fallback):
            fb = fallback.format(step=s) if "{step}" in fallback else fallback
        nbytes = {k: v[2] for k, v in d["arrays"].items()}
        out = Restored(None, s, missing_objects=list(d["missing"]), reason=d["reason"])

        def from_storage(why: str) -> Restored:
            if not fb:
                raise E.IncompleteCheckpointError(
                    f"memory tier shm://{self.job}: {why}; no durable fallback was given "
                    "(restore(..., fallback=PATH))"
                )
            out.tree = spj_load(fb, target, strict=strict)
            out.storage_url, out.reason = fb, why
            out.sources = {k: "storage" for k in sorted(nbytes)}
            out.storage_bytes = sum(nbytes.values())
            return out

        if d["storage"] is None:
            return from_storage(d["reason"])
        if d["storage"]:
            return from_storage(
                f"{len(d['missing'])} object(s) of {len(d['storage'])} tensor(s) of step {s} "
                f"are on no surviving host (first: {d['missing'][0]})"
            )
        tree, err = None, None
        try:  # every object read is checked (crc32c), a damaged copy replaced by a peer's
            tree = spj_load(self.url(s), target, strict=strict)
        except (E.ShardpointError, OSError) as e:
            err = e
        if not all_true("memory-tier-loaded", err is None):
            return from_storage(
                f"the memory copy of step {s} failed to load"
                + (f" ({type(err).__name__}: {err})" if err else " on another process")
            )
        out.tree, out.memory_url = tree, self.url(s)
        out.sources = {k: "memory" for k in sorted(nbytes)}
        out.memory_bytes = sum(nbytes.values())
        return out


__all__ = ["MemoryTier", "Restored"]
