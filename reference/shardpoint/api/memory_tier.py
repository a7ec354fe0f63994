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

import itertools
import math
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import msgpack

from shardpoint.exchange.comm import Comm
from shardpoint.exchange.topology import host_identity
from shardpoint.planning.load_planner import LoadOptions
from shardpoint.tree.flatten import flatten_state
from shardpoint_core.format import errors
from shardpoint_core.format.keys import encode_key
from shardpoint_core.format.manifest import Manifest, decode_manifest
from shardpoint_core.format.spec import MANIFEST_NAME
from shardpoint_core.stores.peers import PeerClient, PeerServer, advertised_host
from shardpoint_core.stores.shm import PeerHost, ShmStore, too_few_hosts

Fallback = Union[str, Callable[[int], Optional[str]], None]
_STEP = "step_"


@dataclass
class Restored:
    """What :meth:`MemoryTier.restore` did: the loaded ``tree``; the ``step``; for every
    tensor key, where it came from (``"memory"`` or ``"storage"``); the bytes of the state
    each source gave (global, from the manifest); the memory checkpoint's URL, the durable
    one's (``""`` where none was read); the memory objects no surviving host held; and
    ``reason``: why anything came from storage, in words (``""`` where nothing did)."""

    tree: Any
    step: Optional[int]
    sources: Dict[str, str] = field(default_factory=dict)
    memory_bytes: int = 0
    storage_bytes: int = 0
    memory_url: str = ""
    storage_url: str = ""
    missing_objects: List[str] = field(default_factory=list)
    reason: str = ""
    timings: Dict[str, float] = field(default_factory=dict)  # seconds: decide, gather, load


def _chunk_keys(base: str, shape: Tuple[int, ...], chunks: Tuple[int, ...]) -> List[str]:
    """Every object key of one saved array: its zarr.json and each chunk (writers store every
    chunk, fill-value ones included)."""
    counts = [math.ceil(s / c) if c else 0 for s, c in zip(shape, chunks)]
    keys = [f"{base}/zarr.json"]
    if any(n == 0 for n in counts):
        return keys
    idx = [0] * len(counts)
    while True:
        keys.append("/".join([base, "c", *map(str, idx)]))
        d = len(idx) - 1
        while d >= 0:
            idx[d] += 1
            if idx[d] < counts[d]:
                break
            idx[d] = 0
            d -= 1
        if d < 0:
            return keys


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


class MemoryTier:
    """Checkpoints of job ``job`` in host memory, replicated to ``k`` other hosts (see the
    module). Collective: every rank of ``group`` constructs it, saves and restores.

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
        self.job, self.k, self.group = job, k, group
        self.comm = Comm(group)
        self.host = host_identity(host_id)
        self.store = ShmStore.named(job)
        self.store.configure(shm_dir=shm_dir, budget_bytes=budget_bytes, host=self.host)
        self.store.clean_tmp()  # what this job's dead processes left half-written
        token = self.comm.broadcast_bytes(
            secrets.token_hex(16).encode() if self.comm.is_coordinator else None
        ).decode()
        self.server = PeerServer(self.store.handle, token, advertise=advertise or advertised_host())
        rows = [
            msgpack.unpackb(b, raw=False)
            for b in self.comm.all_gather_bytes(
                msgpack.packb([self.host, self.server.address], use_bin_type=True)
            )
        ]
        self.rank_hosts = [h for h, _a in rows]
        hosts: List[str] = []
        for h in self.rank_hosts:
            if h not in hosts:
                hosts.append(h)
        self.hosts = hosts
        mine = hosts.index(self.host)
        local_index = [r for r, (h, _a) in enumerate(rows) if h == self.host].index(self.comm.rank)
        others = []
        for h in hosts[mine + 1 :] + hosts[:mine]:
            addrs = [a for hh, a in rows if hh == h]
            addrs = addrs[local_index % len(addrs) :] + addrs[: local_index % len(addrs)]
            others.append(PeerHost(h, [PeerClient(a, token, timeout_s=timeout_s) for a in addrs]))
        self.store.set_peers(others, k)
        self._hgroup: Any = None

    def url(self, step: int) -> str:
        """The memory checkpoint of ``step``: ``shm://<job>/step_<step>``."""
        return f"shm://{self.job}/{_STEP}{int(step)}"

    # -- saving ---------------------------------------------------------------------------
    def _check_budget(self, state: Any) -> None:
        """Refuse (:class:`MemoryBudgetError`, every rank) a save whose estimated bytes would
        take a host past the budget, before anything is written. The estimate: the main
        replica of every piece a rank holds, on its host and on the ``k`` hosts after it."""
        budget = self.store.budget_bytes
        flat = flatten_state(state, replica=(self.comm.rank,))
        mine = sum(t.holding.nbytes for t in flat.tensors if not any(t.holding.replica))
        rows = [
            msgpack.unpackb(b, raw=False)
            for b in self.comm.all_gather_bytes(
                msgpack.packb([mine, self.store.usage()], use_bin_type=True)
            )
        ]
        if budget is None:
            return
        adds = {h: 0 for h in self.hosts}
        used = {h: 0 for h in self.hosts}
        for r, (b, u) in enumerate(rows):
            h = self.rank_hosts[r]
            used[h] = max(used[h], u)
            i = self.hosts.index(h)
            for j in range(self.k + 1):
                adds[self.hosts[(i + j) % len(self.hosts)]] += b
        over = [h for h in self.hosts if used[h] + adds[h] > budget]
        if over:
            h = over[0]
            raise errors.MemoryBudgetError(
                f"memory tier shm://{self.job}: this save would put about {adds[h]} bytes on "
                f"host {h}, which holds {used[h]}: over its budget of {budget} bytes "
                f"({len(over)} host(s) over); nothing was written. Raise budget_bytes or keep "
                "fewer memory steps"
            )

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

        if self.k > len(self.hosts) - 1:
            raise errors.InvalidOptionError(too_few_hosts(self.k, len(self.hosts) - 1))
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

    def steps(self) -> List[int]:
        """The committed memory steps any reachable host holds, oldest first (local: no
        collective)."""
        found = set()
        for info in self.store.list(""):
            head, _sep, rest = info.key.partition("/")
            if rest == MANIFEST_NAME and head.startswith(_STEP) and head[len(_STEP) :].isdigit():
                found.add(int(head[len(_STEP) :]))
        return sorted(found)

    def remove(self, step: int) -> bool:
        """Delete memory step ``step`` on every reachable host through the committer (the
        marker first, so no reader takes it for committed meanwhile). Coordinator only."""
        from shardpoint_core.commit.routing import default_committer

        return default_committer().remove(self.url(step))

    # -- recovery -------------------------------------------------------------------------
    def _decide(self, step: Optional[int]) -> Dict[str, Any]:
        """(rank 0) which step to restore, which tensors memory holds whole, and what every
        rank needs to know of them (array paths, grids, sizes, the metadata objects)."""
        candidates = [step] if step is not None else self.steps()[::-1]
        reasons = []
        for s in candidates:
            prefix = f"{_STEP}{s}"
            try:
                m: Manifest = decode_manifest(self.store.get(f"{prefix}/{MANIFEST_NAME}"))
            except (FileNotFoundError, errors.ShardpointError) as e:
                reasons.append(f"step {s}: no intact manifest in memory ({e})")
                continue
            present = {i.key for i in self.store.list(prefix + "/")}
            storage, missing = [], []
            for key, entry in m.tensors.items():
                gone = [
                    k
                    for k in _chunk_keys(
                        f"{prefix}/{entry.array}", tuple(entry.shape), tuple(entry.chunk_shape)
                    )
                    if k not in present
                ]
                if gone:
                    storage.append(key)
                    missing.extend(gone)
            return {
                "step": s,
                "storage": storage,
                "missing": missing,
                "reason": "; ".join(reasons),
                "arrays": {
                    k: [f"{prefix}/{e.array}", list(e.chunk_shape), e.nbytes, list(e.shape)]
                    for k, e in m.tensors.items()
                },
                "meta": sorted(
                    [f"{prefix}/{MANIFEST_NAME}"] + [k for k in present if k.endswith("/zarr.json")]
                ),
            }
        return {
            "step": step,
            "storage": None,
            "missing": [],
            "arrays": {},
            "meta": [],
            "reason": "; ".join(reasons) or "no committed memory checkpoint on any reachable host",
        }

    def _needed(self, like: Any, arrays: Dict[str, Any]) -> Dict[str, str]:
        """object key -> tensor key: the chunks this rank's part of ``like`` meets (the whole
        tensors without ``like``)."""
        out: Dict[str, str] = {}
        if like is None:
            return out
        for t in flatten_state(like, replica=(self.comm.rank,)).tensors:
            h = t.holding
            if h.key not in arrays or (h.shape and 0 in h.shape):
                continue
            base, chunk, _n, _shape = arrays[h.key]
            if not chunk:
                out[f"{base}/c"] = h.key
                continue
            ranges = [
                range(lo // c, (lo + n - 1) // c + 1) for lo, n, c in zip(h.offset, h.shape, chunk)
            ]
            for idx in itertools.product(*ranges):
                out["/".join([base, "c", *map(str, idx)])] = h.key
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

    def _materialize(self, keys: List[str]) -> List[str]:
        """Make sure this host holds an intact copy of each of ``keys`` (fetched from a peer
        where not, and checked); the keys that could not be had."""

        def one(key: str) -> bool:
            if self.store.verify_local(key):
                return True
            try:
                self.store.fetch_here(key)
            except (FileNotFoundError, errors.ShardpointError, OSError):
                return False
            return self.store.verify_local(key)

        with ThreadPoolExecutor(8) as pool:
            return [k for k, ok in zip(keys, pool.map(one, keys)) if not ok]

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
                msgpack.packb(self._decide(step), use_bin_type=True)
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
            need = {
                k: t
                for t, (base, chunk, _n, shape) in d["arrays"].items()
                for k in _chunk_keys(base, tuple(shape), tuple(chunk))[1:]
            }
        t0 = time.perf_counter()
        failed = self._materialize(list(d["meta"]) + sorted(need))
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
        try:  # each host from its own copy: the ranks of a host load together
            tree = load(
                here,
                mem_like,
                group=self._host_group(),
                strict=strict,
                options=LoadOptions(strategy="direct", host_id=self.host),
            )
        except errors.ShardpointError as e:  # agreed: every rank takes this branch
            if not fb:
                raise
            return from_storage(f"the memory copy of step {s} failed to load ({e})")
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

    def close(self) -> None:
        """Stop serving this host's memory and forget the peers (local). The objects stay in
        shared memory for the next incarnation of the job."""
        self.server.close()
        self.store.clear_peers()

    def __enter__(self) -> "MemoryTier":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
