"""The framework-neutral half of the memory tier, shared by the torch front end's
:class:`shardpoint.MemoryTier` and the JAX front end's :class:`shardpoint_jax.MemoryTier`:
the ring of the job's hosts and the side channel between them, the budget check, the
listing and removal of memory steps, and which tensors of a memory step survive a host loss.

A front end gives it two collectives of its process group (``broadcast``: the coordinator's
bytes to every rank; ``all_gather``: every rank's bytes to every rank) and does the saving
and loading itself. Every rank serves its host's shared memory
(:class:`~shardpoint_core.stores.peers.PeerServer`); the job's ``shm://<job>/`` store
(:class:`~shardpoint_core.stores.shm.ShmStore`) replicates every object it puts to the next
``k`` hosts of the ring (distinct hosts, named by
:func:`~shardpoint_core.stores.peers.host_identity`), so a memory step survives the loss of
any ``k`` consecutive hosts of the ring.
"""

from __future__ import annotations

import itertools
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import msgpack
import numpy as np

from shardpoint_core.format import errors
from shardpoint_core.format.manifest import Manifest, decode_manifest
from shardpoint_core.format.spec import MANIFEST_NAME
from shardpoint_core.stores.peers import PeerClient, PeerServer, advertised_host
from shardpoint_core.stores.shm import PeerHost, ShmStore, too_few_hosts
from shardpoint_core.transactions.copy import chunk_keys

STEP = "step_"
Broadcast = Callable[[Optional[bytes]], bytes]
AllGather = Callable[[bytes], List[bytes]]


def _pack(x: Any) -> bytes:
    return bytes(msgpack.packb(x, use_bin_type=True))


def _unpack(b: bytes) -> Any:
    return msgpack.unpackb(b, raw=False)


@dataclass
class Restored:
    """What a memory tier's ``restore`` did: the loaded ``tree``; the ``step``; for every
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


class HostTier:
    """A job's memory tier on this host (see the module). Collective: every rank of the job
    constructs it with the same ``job`` and ``k``. ``host``: this rank's host name; ``rank``:
    its index in the group; ``coordinator``: whether it is the group's first rank."""

    def __init__(
        self,
        job: str,
        *,
        k: int,
        budget_bytes: Optional[int],
        shm_dir: Optional[str],
        host: str,
        rank: int,
        coordinator: bool,
        broadcast: Broadcast,
        all_gather: AllGather,
        advertise: Optional[str] = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.job, self.k, self.host = job, k, host
        self._all_gather = all_gather
        self.store = ShmStore.named(job)
        self.store.configure(shm_dir=shm_dir, budget_bytes=budget_bytes, host=host)
        self.store.clean_tmp()  # what this job's dead processes left half-written
        token = broadcast(secrets.token_hex(16).encode() if coordinator else None).decode()
        self.server = PeerServer(self.store.handle, token, advertise=advertise or advertised_host())
        rows = [_unpack(b) for b in all_gather(_pack([host, self.server.address]))]
        #: the host of every rank, in rank order; the job's hosts, in ring order
        self.rank_hosts: List[str] = [h for h, _a in rows]
        self.hosts: List[str] = list(dict.fromkeys(self.rank_hosts))
        mine = self.hosts.index(host)
        local = [r for r, (h, _a) in enumerate(rows) if h == host].index(rank)
        others = []
        for h in self.hosts[mine + 1 :] + self.hosts[:mine]:
            addrs = [a for hh, a in rows if hh == h]
            addrs = addrs[local % len(addrs) :] + addrs[: local % len(addrs)]
            others.append(PeerHost(h, [PeerClient(a, token, timeout_s=timeout_s) for a in addrs]))
        self.store.set_peers(others, k)

    def url(self, step: int) -> str:
        """The memory checkpoint of ``step``: ``shm://<job>/step_<step>``."""
        return f"shm://{self.job}/{STEP}{int(step)}"

    def check_saveable(self) -> None:
        """Refuse (every rank alike) a save asking for more replicas than there are other
        hosts: replicas on one host do not survive its loss."""
        if self.k > len(self.hosts) - 1:
            raise errors.InvalidOptionError(too_few_hosts(self.k, len(self.hosts) - 1))

    def check_budget(self, mine: int) -> None:
        """Collective: refuse (:class:`MemoryBudgetError`, every rank) a save whose estimated
        bytes would take a host past the budget, before anything is written. ``mine``: the
        bytes this rank writes (the main replica of every piece it holds); each goes to its
        host and to the ``k`` hosts after it."""
        budget = self.store.budget_bytes
        rows = [_unpack(b) for b in self._all_gather(_pack([mine, self.store.usage()]))]
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

    def steps(self) -> List[int]:
        """The committed memory steps any reachable host holds, oldest first (local: no
        collective)."""
        found = set()
        for info in self.store.list(""):
            head, _sep, rest = info.key.partition("/")
            if rest == MANIFEST_NAME and head.startswith(STEP) and head[len(STEP) :].isdigit():
                found.add(int(head[len(STEP) :]))
        return sorted(found)

    def local_objects(self, step: int) -> List[List[Any]]:
        """[key, bytes] of every object of memory step ``step`` this host holds (keys from
        the job's store root; local: no collective, no peer asked)."""
        return [[i.key, int(i.size)] for i in self.store.local_list(f"{STEP}{int(step)}/")]

    def remove(self, step: int) -> bool:
        """Delete memory step ``step`` on every reachable host through the committer (the
        marker first, so no reader takes it for committed meanwhile). Coordinator only."""
        from shardpoint_core.commit.routing import default_committer

        return default_committer().remove(self.url(step))

    def decide(self, step: Optional[int]) -> Dict[str, Any]:
        """(coordinator) which memory step to restore (``step``, or the newest one with an
        intact manifest), which tensors it has on no surviving host (``storage``, their
        object keys in ``missing``; None where no step is there), and what every rank needs to
        know of them (``arrays``: tensor key -> :func:`array_objects`; ``meta``: the manifest,
        its bases' manifests and the zarr.json objects)."""
        candidates = [step] if step is not None else self.steps()[::-1]
        reasons = []
        for s in candidates:
            prefix = f"{STEP}{s}"
            try:
                m: Manifest = decode_manifest(self.store.get(f"{prefix}/{MANIFEST_NAME}"))
            except (FileNotFoundError, errors.ShardpointError) as e:
                reasons.append(f"step {s}: no intact manifest in memory ({e})")
                continue
            present = {i.key for i in self.store.list(prefix + "/")}
            bases = m.packed.bases if m.packed is not None else []
            for name, _ident in bases:  # (incremental) the base steps beside it
                present |= {i.key for i in self.store.list(name + "/")}
            arrays = {k: array_objects(prefix, e, m) for k, e in m.tensors.items()}
            storage: List[str] = []
            missing: Dict[str, None] = {}  # in order, each once (objects shared by tensors)
            for key, entry in m.tensors.items():
                a = arrays[key]
                keys = a[4] if len(a) > 4 else chunk_keys(a[0], entry.shape, entry.chunk_shape)
                gone = [k for k in keys if k not in present]
                if gone:
                    storage.append(key)
                    missing.update(dict.fromkeys(gone))
            return {
                "step": s,
                "storage": storage,
                "missing": list(missing),
                "reason": "; ".join(reasons),
                "arrays": arrays,
                "meta": sorted(
                    [f"{prefix}/{MANIFEST_NAME}"]
                    + [f"{name}/{MANIFEST_NAME}" for name, _i in bases]  # identities checked
                    + [k for k in present if k.endswith("/zarr.json")]
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

    def materialize(self, keys: List[str]) -> List[str]:
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

    def close(self) -> None:
        """Stop serving this host's memory and forget the peers (local). The objects stay in
        shared memory for the next incarnation of the job."""
        self.server.close()
        self.store.clear_peers()

    def __enter__(self) -> "HostTier":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def array_objects(prefix: str, entry: Any, m: Manifest) -> List[Any]:
    """What a rank needs to know of one tensor of the memory step at ``prefix`` (keys from
    the job's store root) to find the objects its chunks lie in: ``[array path, chunk
    shape, bytes, shape]``, and in the packed layout ([SP-PACK-4]) also the keys of the
    data objects its chunks lie in (an object of a base, [SP-PACK-9]: the key of that base
    step's object, and the base's manifest, whose identity a reader checks first)."""
    out: List[Any] = [
        f"{prefix}/{entry.array}",
        list(entry.chunk_shape),
        entry.nbytes,
        list(entry.shape),
    ]
    part = entry.packed
    if part is None or m.packed is None:
        return out
    used = np.unique(part.records["object"])
    keys, bases = [], set()
    for o in used.tolist():
        b = m.packed.base_of(o)
        path = m.packed.objects[o][0]
        keys.append(f"{prefix}/{path}" if b is None else f"{m.packed.bases[b][0]}/{path}")
        if b is not None:
            bases.add(f"{m.packed.bases[b][0]}/{MANIFEST_NAME}")
    return out + [keys + sorted(bases)]


def chunk_objects(info: List[Any], offset: Sequence[int], shape: Sequence[int]) -> List[str]:
    """The object keys that a load of a region (``offset``, ``shape``) of one tensor of
    :meth:`HostTier.decide`'s ``arrays`` (``info``: :func:`array_objects`) needs: the chunk
    files it meets in the per-array layout; in the packed one every data object holding a
    chunk of the tensor, since a reader confirms them all before it reads ([SP-PACK-7])."""
    base, chunk, _n, full = info[0], tuple(info[1]), info[2], tuple(info[3])
    if any(n == 0 for n in shape) or any(n == 0 for n in full):
        return []
    if len(info) > 4:  # packed: every object of the tensor, as a reader checks them all
        return list(info[4])  # before it reads any ([SP-PACK-7])
    if not chunk:
        return [f"{base}/c"]
    idxs = itertools.product(
        *(range(lo // c, (lo + n - 1) // c + 1) for lo, n, c in zip(offset, shape, chunk))
    )
    return ["/".join([base, "c", *map(str, i)]) for i in idxs]


def every_chunk(arrays: Dict[str, Any]) -> Dict[str, str]:
    """object key -> tensor key for every chunk (per-array) or data object (packed) of
    every array of :meth:`HostTier.decide`'s ``arrays``."""
    out: Dict[str, str] = {}
    for t, info in arrays.items():
        if len(info) > 4:
            out.update({k: t for k in info[4]})
        else:
            base, chunk, _n, shape = info[:4]
            out.update({k: t for k in chunk_keys(base, tuple(shape), tuple(chunk))[1:]})
    return out


__all__ = ["HostTier", "Restored", "STEP", "array_objects", "chunk_objects", "every_chunk"]
