"""The only module that talks to ``torch.distributed``: control messages and region exchange.

Control data (plans, statuses) travels as msgpack bytes in uint8 tensors, never as pickled
objects. Regions move with ``all_to_all_single`` over packed uint8 buffers, in rounds bounded
by a per-rank byte budget. Without an initialized process group everything degenerates to a
world of one, so single-process use needs no setup.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, Optional, Sequence

import msgpack
import torch
import torch.distributed as dist

from shardpoint_core.format import errors
from shardpoint.exchange import dedup
from shardpoint.exchange.inflight import release_after_failure, tensors_in as _tensors_in
from shardpoint.planning.columns import gc_paused
from shardpoint.tree.views import copy_with_bytes


class Comm:
    """A process group seen as ranks 0..size-1; rank 0 is the coordinator."""

    def __init__(self, group: Optional[Any] = None) -> None:
        self.group = group
        # What a RankLostError tells the user to do; the caller sets it for what it runs
        # (a save before its commit, the commit, a load), so the advice fits what was lost.
        self.after_failure = AFTER_UNKNOWN
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.size = dist.get_world_size(group)
            backend = dist.get_backend(group)
            self.device = (
                torch.device("cuda", torch.cuda.current_device())
                if "nccl" in str(backend).lower()
                else torch.device("cpu")
            )
        else:
            if group is not None:
                raise errors.ShardpointError(
                    "a process group was given but torch.distributed is not initialized"
                )
            self.rank, self.size, self.device = 0, 1, torch.device("cpu")

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def _run(
        self,
        what: str,
        fn: Callable,
        *args: Any,
        _held: Sequence = (),
        _peer: Optional[int] = None,
        **kwargs: Any,
    ) -> Any:
        """``fn(*args, **kwargs)``, a torch.distributed collective; a failure of the group
        (gloo and NCCL raise a bare RuntimeError naming a socket, or a timeout) becomes
        :class:`~.errors.RankLostError` saying what happened and what to do (``_peer``: the
        rank a point-to-point wait was waiting on, named in the error).

        Before the error is raised, the backend's worker threads let go of the failed
        operation's tensors (those in the arguments and ``_held``): a worker that drops the
        last reference to a tensor after Python dropped its own needs the GIL, and one doing
        so while the interpreter exits aborts the process (``terminate called without an
        active exception``)."""
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            lost = rank_lost(self, what, e, _peer)
            cause = e
            # its frames hold the failed work, and through it the tensors: let them go
            e.__traceback__ = None
        held = _tensors_in((args, tuple(kwargs.values()), tuple(_held)))
        fn = None  # type: ignore[assignment]   # a bound Work.wait holds its work
        release_after_failure(held)
        raise lost from cause

    def _p2p(self, what: str, ops: list, peers: list) -> None:
        """Post point-to-point ``ops`` (``dist.P2POp``, to or from group ranks ``peers``) and
        wait for each; a failure names the rank waited on."""
        works = self._run(what, dist.batch_isend_irecv, ops, _held=ops)
        one_each = len(works) == len(peers)  # a coalesced backend answers with one work
        w = None
        try:
            for i, w in enumerate(works):
                self._run(what, w.wait, _peer=peers[i] if one_each else None)
        except errors.RankLostError:
            works = w = None  # the works not waited for hold the other ops' tensors
            release_after_failure(_tensors_in(ops))
            raise

    def _u8(self, b: bytes, n: int) -> torch.Tensor:
        t = torch.zeros(n, dtype=torch.uint8)
        if b:
            t[: len(b)] = torch.frombuffer(bytearray(b), dtype=torch.uint8)
        return t.to(self.device)

    def _sizes(self, n: int) -> list:
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        out = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.size)]
        self._run("all_gather", dist.all_gather, out, t, group=self.group)
        return [int(x.item()) for x in out]

    def all_true(self, flag: bool) -> bool:
        """Collective AND of one flag per rank."""
        if self.size == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=self.device)
        self._run("all_reduce", dist.all_reduce, t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def all_gather_bytes(self, b: bytes) -> list:
        if self.size == 1:
            return [b]
        sizes = self._sizes(len(b))
        m = max(sizes)
        out = [torch.zeros(m, dtype=torch.uint8, device=self.device) for _ in range(self.size)]
        self._run("all_gather", dist.all_gather, out, self._u8(b, m), group=self.group)
        return [bytes(o[:s].cpu().numpy()) for o, s in zip(out, sizes)]

    def gather_bytes(self, b: bytes) -> Optional[list]:
        """Every rank's bytes on the coordinator (None elsewhere): sizes all-gathered, then
        each rank's bytes alone, point to point, at their own size (``dist.gather`` pads
        every message to the largest: the coordinator would take in world x largest)."""
        if self.size == 1:
            return [b]
        sizes = self._sizes(len(b))
        if not self.is_coordinator:
            if b:
                self._run(
                    "send",
                    dist.send,
                    self._u8(b, len(b)),
                    dst=self._global(0),
                    group=self.group,
                    _peer=0,
                )
            return None
        bufs = {
            r: torch.empty(n, dtype=torch.uint8, device=self.device)
            for r, n in enumerate(sizes)
            if r and n
        }
        ops = [dist.P2POp(dist.irecv, t, self._global(r), self.group) for r, t in bufs.items()]
        if ops:
            self._p2p("recv", ops, list(bufs))
        return [
            b if r == 0 else bytes(bufs[r].cpu().numpy()) if r in bufs else b""
            for r in range(self.size)
        ]

    def gather_parts(self, parts: Sequence[bytes]) -> Optional[list]:
        """Every rank's ``[head, blob, ...]`` on the coordinator (None elsewhere), each
        distinct blob crossing the network once: heads, digests and sizes are gathered, the
        coordinator broadcasts which rank sends which blob, and those blobs alone come point
        to point (:mod:`.dedup`). Data-parallel ranks send the same tree branches, key tables
        and column runs, so what the coordinator receives grows with the job's distinct
        structure rather than with its ranks (65,536 simulated ranks: see
        ``benchmarks/plan_scale.py``). Identical blobs arrive as one bytes object."""
        if self.size == 1:
            return [list(parts)]
        msg, _ = dedup.offer(parts)
        got = self.gather_bytes(msg)
        if got is None:  # not the coordinator: send the blobs it asks this rank for
            idx = dedup.my_requests(self.broadcast_bytes(None), self.rank)
            n = sum(len(parts[1 + i]) for i in idx)
            if n:
                t = self._u8(b"".join(parts[1 + i] for i in idx), n)
                self._run("send", dist.send, t, dst=self._global(0), group=self.group, _peer=0)
            return None
        offers = [dedup.read_offer(g) for g in got]
        want = dedup.requests(offers)
        self.broadcast_bytes(dedup.encode_requests(want))
        sizes = dedup.wanted_bytes(offers, want)
        bufs = {
            r: torch.empty(n, dtype=torch.uint8, device=self.device) for r, n in sizes.items() if n
        }
        ops = [dist.P2POp(dist.irecv, t, self._global(r), self.group) for r, t in bufs.items()]
        if ops:
            self._p2p("recv", ops, list(bufs))
        return dedup.assemble(
            offers,
            list(parts[1:]),
            want,
            {r: bufs[r].cpu().numpy().tobytes() if r in bufs else b"" for r in sizes},
        )

    def broadcast_bytes(self, b: Optional[bytes]) -> bytes:
        """The coordinator's ``b`` on every rank (the other ranks pass None)."""
        if self.size == 1:
            return b or b""
        if not self.is_coordinator:
            b = b""
        elif b is None:
            raise ValueError("the coordinator broadcasts bytes, not None")
        n = torch.tensor([len(b)], dtype=torch.int64, device=self.device)
        self._run("broadcast", dist.broadcast, n, src=self._global(0), group=self.group)
        t = self._u8(b, int(n.item()))
        self._run("broadcast", dist.broadcast, t, src=self._global(0), group=self.group)
        return bytes(t.cpu().numpy())

    def scatter_bytes(self, parts: Optional[Sequence[bytes]]) -> bytes:
        """Part ``i`` of the coordinator's list to rank ``i`` (sizes broadcast, then each
        part alone, point to point); the other ranks pass None."""
        # point to point, each part at its own size: dist.scatter pads every part to the
        # largest (a load plan's parts range from bytes to hundreds of KiB: at 16,384 ranks the
        # padding alone would be gigabytes sent by the coordinator)
        if not self.is_coordinator:
            sizes = torch.zeros(self.size, dtype=torch.int64, device=self.device)
            self._run("broadcast", dist.broadcast, sizes, src=self._global(0), group=self.group)
            n = int(sizes[self.rank].item())
            out = torch.empty(n, dtype=torch.uint8, device=self.device)
            if n:
                self._run("recv", dist.recv, out, src=self._global(0), group=self.group, _peer=0)
            return bytes(out.cpu().numpy())
        if parts is None:
            raise ValueError("the coordinator scatters one part per rank, not None")
        if self.size == 1:
            return parts[0]
        sizes = torch.tensor([len(p) for p in parts], dtype=torch.int64, device=self.device)
        self._run("broadcast", dist.broadcast, sizes, src=self._global(0), group=self.group)
        to = [r for r, p in enumerate(parts) if r and len(p)]
        ops = [
            dist.P2POp(dist.isend, self._u8(parts[r], len(parts[r])), self._global(r), self.group)
            for r in to
        ]
        if ops:
            self._p2p("send", ops, to)
        return parts[0]

    def all_to_all(self, send: list, recv_sizes: list) -> list:
        """Send ``send[d]`` (1-D uint8 tensor) to rank d; receive ``recv_sizes[s]`` bytes from
        each rank s. Returns the received buffers, one per source rank."""
        if self.size == 1:
            return [send[0]]
        ins = [s.to(self.device) for s in send]
        inp = torch.cat(ins) if ins else torch.empty(0, dtype=torch.uint8, device=self.device)
        out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=self.device)
        self._run(
            "all_to_all",
            dist.all_to_all_single,
            out,
            inp,
            output_split_sizes=list(recv_sizes),
            input_split_sizes=[int(s.numel()) for s in send],
            group=self.group,
        )
        return list(torch.split(out, list(recv_sizes)))


def group_key(comm: Comm) -> tuple:
    """A key naming ``comm``'s group by its global ranks (stable across calls)."""
    if comm.size == 1:
        return ("single",)
    return ("group", comm.size, tuple(dist.get_process_group_ranks(comm.group or dist.group.WORLD)))


def new_side_comm(comm: Comm) -> Comm:
    """A new gloo group over the same ranks as ``comm``, for an async save's background part,
    so its collectives never interleave with the training job's on ``comm``. Collective:
    every rank of ``comm`` calls this at the same point (a checkpointer makes one per group
    and keeps it)."""
    if comm.size == 1:
        return comm
    key = group_key(comm)
    # A strict subgroup synchronizes only its members (the other ranks are not saving);
    # the whole world takes torch's ordinary path, where every rank calls new_group.
    sub = comm.size < dist.get_world_size()
    return Comm(
        comm._run(
            "new_group",
            dist.new_group,
            list(key[2]),
            backend="gloo",
            timeout=_timeout_of(comm.group),
            use_local_synchronization=sub,
        )
    )


def _timeout_of(group: Any) -> Any:
    """The collective timeout of ``group`` (so a dead peer fails the background save as soon
    as it would fail the job's own collectives); None (torch's default) when unknown."""
    try:  # torch keeps it only on the backend's options
        pg = group or dist.group.WORLD
        if pg is None:
            return None
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - an NCCL-only group, another torch: use the default
        return None


AFTER_UNKNOWN = (
    "restart every rank; a save cut short before its commit commits nothing and "
    "committed checkpoints are left as they were"
)
AFTER_SAVE = (
    "the save was cut short before its commit, so it commits nothing: restart every "
    "rank and resume from the last committed checkpoint"
)
AFTER_LOAD = (
    "the load returned nothing and changed nothing on storage: restart every rank and load again"
)


def after_commit(path: str) -> str:
    """The advice for a failure while the ranks agree on a save's commit: the coordinator
    may already have renamed it into place."""
    return (
        f"it failed while the ranks agreed on the commit, so the checkpoint {path!r} may "
        f"or may not be committed (`shardpoint verify {path}` tells; a previous "
        "checkpoint there is intact if it was not): restart every rank and resume from "
        "the newest committed checkpoint"
    )


def rank_lost(
    comm: Comm, op: str, e: BaseException, peer: Optional[int] = None
) -> errors.RankLostError:
    """The error for a collective that failed under ``comm``: the backend's own words without
    its source path and boilerplate, the rank waited on (``peer``, for point-to-point), the
    group's timeout, and what to do."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". This is typically")[0].rstrip(".")
    timeout = _timeout_of(comm.group)
    who = (
        "another rank of the group"
        if peer is None
        else f"another rank (rank {peer}, which this rank "
        f"{'sent to' if op == 'send' else 'waited on'})"
    )
    return errors.RankLostError(
        f"rank {comm.rank} of {comm.size}: the {op} collective failed ({text}): {who} died, "
        "was killed or hung"
        + (f" past the group's timeout ({timeout.total_seconds():g} s)" if timeout else "")
        + f"; its own log says why. {comm.after_failure[0].upper()}{comm.after_failure[1:]}"
    )


# ---------------------------------------------------------------------- errors across ranks
def error_record(e: BaseException, rank: int) -> list:
    """A failure as msgpack-ready data; ``agreed`` marks one every rank already raised."""
    cls = type(e).__name__ if isinstance(e, errors.ShardpointError) else "ShardpointError"
    msg = str(e) if isinstance(e, errors.ShardpointError) else f"{type(e).__name__}: {e}"
    return [cls, rank, msg, getattr(e, "spec_id", None), bool(getattr(e, "_sp_agreed", False))]


def raise_records(records: list, fallback: type = errors.ShardpointError) -> None:
    """Raise one error for the failures of some ranks, of the first failure's class."""
    if not records:
        return
    fresh = [r for r in records if not r[4]]
    cls_name, rank, msg, sid, _ = (fresh or records)[0]
    cls = getattr(errors, cls_name, fallback)
    if not (isinstance(cls, type) and issubclass(cls, errors.ShardpointError)):
        cls = fallback
    text = msg.split("] ", 1)[1] if sid and msg.startswith(f"[{sid}]") else msg
    if fresh:
        more = f" (and {len(fresh) - 1} other rank(s) failed)" if len(fresh) > 1 else ""
        text = (f"rank {rank}: " if len(fresh) > 1 or rank != 0 else "") + text + more
    e = cls(text, spec_id=sid)
    e._sp_agreed = True  # every rank raises this one; later agreement steps pass it through
    raise e


def agree(comm: Comm, err: Optional[BaseException], fallback: type) -> None:
    """Collective: every rank learns of every rank's failure and raises the same error.
    One small all-reduce when every rank succeeded (a dedup load agrees once per round);
    the records are gathered only when some rank failed."""
    if comm.all_true(err is None):
        return
    rec = [] if err is None else [error_record(err, comm.rank)]
    recs = [r for b in comm.all_gather_bytes(msgpack.packb(rec)) for r in msgpack.unpackb(b)]
    if recs:
        raise_records(recs, fallback)
    if err is not None:  # pragma: no cover - recs contains it
        raise err


def run_collectively(
    comm: Comm,
    local: Callable[[], Any],
    decide: Callable[[list], list],
    fallback: type,
    same: Any = None,
) -> bytes:
    """Gather each rank's ``local()`` to the coordinator, let it ``decide`` one answer per
    rank, scatter the answers. ``local()`` returns bytes, or ``[head, blob, ...]`` (a list of
    bytes, which ``decide`` then gets as such): either way identical blobs cross the network
    once (:meth:`Comm.gather_parts`). Any failure, local or in ``decide``, is raised on every
    rank as the same error, so no rank is left waiting in a collective. ``same``: ``(what,
    value)``, or a list of them, that every rank must pass alike (the checkpoint path, the
    ``overwrite`` flag, the options): a rank passing another value fails every rank with
    :class:`~.errors.InvalidOptionError` naming the argument and the ranks, before
    ``decide``. Values are compared as msgpack data (str, numbers, bools, lists)."""
    pairs = [] if same is None else [same] if isinstance(same, tuple) else list(same)
    mine_same = [v for _w, v in pairs]
    try:
        out = local()
        # bytes: one blob; a list: [head, blob, ...], the head kept apart from the blobs
        mine = (
            [msgpack.packb([0, None, mine_same]), out]
            if isinstance(out, bytes)
            else [msgpack.packb([0, out[0], mine_same]), *out[1:]]
        )
    except Exception as e:  # noqa: BLE001 - forwarded to every rank
        mine = [msgpack.packb([1, error_record(e, comm.rank), mine_same])]
    # the coordinator decodes one message per rank and plans: ~10^5 small objects per
    # 16,384 ranks, and the cyclic collector's passes over them (which grow with what is
    # already decoded) cost 2-3x the decoding itself; nothing made here forms a cycle
    with gc_paused() if comm.is_coordinator else contextlib.nullcontext():
        return _gather_decide_scatter(comm, mine, pairs, mine_same, decide, fallback)


def _gather_decide_scatter(
    comm: Comm,
    mine: list,
    pairs: list,
    mine_same: list,
    decide: Callable[[list], list],
    fallback: type,
) -> bytes:
    got = comm.gather_parts(mine)
    parts = None
    if got is not None:  # the coordinator
        items = []
        for g in got:
            status, head, vs = msgpack.unpackb(g[0])
            items.append((status, head if status else g[1] if head is None else [head, *g[1:]], vs))
        failed = [rec for status, rec, _ in items if status]
        mine_same = msgpack.unpackb(msgpack.packb(mine_same))  # compared as the others are
        for i, (what, _v) in enumerate(pairs):
            differ = [(r, v[i]) for r, (_, _, v) in enumerate(items) if v[i] != mine_same[i]]
            if differ:  # a mismatch is the cause of whatever else failed: report it alone
                shown = ", ".join(f"rank {r}: {v!r}" for r, v in differ[:3])
                failed = [
                    error_record(
                        errors.InvalidOptionError(
                            f"the ranks were given different {what}s: rank {comm.rank}: "
                            f"{mine_same[i]!r}, {shown}"
                            + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
                            + f"; every rank of the group must pass the same {what} (a collective "
                            "call's arguments are agreed before anything is written)"
                        ),
                        comm.rank,
                    )
                ]
                break
        if failed:
            parts = [msgpack.packb([1, failed])] * comm.size
        else:
            try:
                parts = [msgpack.packb([0, p]) for p in decide([b for _, b, _ in items])]
            except Exception as e:  # noqa: BLE001
                parts = [msgpack.packb([1, [error_record(e, 0)]])] * comm.size
    status, payload = msgpack.unpackb(comm.scatter_bytes(parts))
    if status:
        raise_records(payload, fallback)
    return payload


def pack_views(views: list) -> torch.Tensor:
    """Concatenate tensors' bytes (row-major) into one uint8 tensor (CPU views: one copy
    each, on this thread)."""
    if not views:
        return torch.empty(0, dtype=torch.uint8)
    if all(v.device.type == "cpu" for v in views):
        out = torch.empty(sum(v.numel() * v.element_size() for v in views), dtype=torch.uint8)
        pos = 0
        for v in views:
            n = v.numel() * v.element_size()
            if not copy_with_bytes(v, out[pos : pos + n], True):
                out[pos : pos + n] = v.contiguous().reshape(-1).view(torch.uint8)
            pos += n
        return out
    return torch.cat([v.contiguous().reshape(-1).view(torch.uint8) for v in views])


def unpack_into(buf: torch.Tensor, dsts: list) -> None:
    """Fill each destination view, in order, from consecutive bytes of ``buf``."""
    pos = 0
    for d in dsts:
        n = d.numel() * d.element_size()
        raw = buf[pos : pos + n]
        if copy_with_bytes(d, raw, False):
            pass
        elif (raw.storage_offset() * raw.element_size()) % d.element_size():
            # Pieces are packed back to back, so a piece after an odd-sized one starts
            # misaligned for its dtype: go through an aligned temporary.
            tmp = torch.empty(d.shape, dtype=d.dtype, device=buf.device)
            tmp.reshape(-1).view(torch.uint8).copy_(raw)
            d.copy_(tmp)
        else:
            d.copy_(raw.to(d.device).view(d.dtype).view(d.shape))
        pos += n


def exchange(comm: Comm, sends: list, recvs: list, budget: int) -> None:
    """Move regions: ``sends`` = [(dst, tensor view)], ``recvs`` = [(src, destination view)],
    both in the plan's global transfer order. Rounds keep each rank's traffic near ``budget``
    bytes; the round count is agreed collectively so every rank calls the collective as often.
    """
    if comm.size == 1:
        return

    def rounds(items: list) -> list:
        out: list[list] = []
        cur: list = []
        size = 0
        for it in items:
            n = it[1].numel() * it[1].element_size()
            if cur and size + n > budget:
                out.append(cur)
                cur, size = [], 0
            cur.append(it)
            size += n
        if cur:
            out.append(cur)
        return out

    # Rounds are cut per (src, dst) pair on both sides identically: both sides see the same
    # sequence of transfers for that pair, in the same order.
    def by_peer(items: list) -> dict:
        d: dict = {}
        for peer, v in items:
            d.setdefault(peer, []).append((peer, v))
        return {p: rounds(v) for p, v in d.items()}

    sp, rp = by_peer(sends), by_peer(recvs)
    mine = max([len(v) for v in sp.values()] + [len(v) for v in rp.values()] + [0])
    total = torch.tensor([mine], dtype=torch.int64, device=comm.device)
    comm._run("all_reduce", dist.all_reduce, total, op=dist.ReduceOp.MAX, group=comm.group)
    for k in range(int(total.item())):
        send_bufs, recv_sizes, recv_views = [], [], []
        for peer in range(comm.size):
            s = sp.get(peer, [])
            send_bufs.append(
                pack_views([v for _, v in s[k]])
                if k < len(s)
                else torch.empty(0, dtype=torch.uint8)
            )
            r = rp.get(peer, [])
            views = [v for _, v in r[k]] if k < len(r) else []
            recv_views.append(views)
            recv_sizes.append(sum(v.numel() * v.element_size() for v in views))
        got = comm.all_to_all(send_bufs, recv_sizes)
        for buf, views in zip(got, recv_views):
            unpack_into(buf, views)
