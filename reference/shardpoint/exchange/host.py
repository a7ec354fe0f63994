"""A dedup load's exchange between ranks of one host through shared memory, not the group.

Under the ``dedup`` load strategy each needed region is read by one rank and sent to the
others. Ranks on one host need not ship those bytes over the process group (gloo moved them
at 0.03-0.08 GB/s per rank on the 2-core test machine): each reader stages the regions it
sends in a small segment of its own under ``/dev/shm``, where the checkpoint reader reads
and checks them (every chunk's crc32c is verified before its read completes); once every rank
has reported its reads intact, the other ranks of the host copy their boxes straight out of
that segment into their tensors. The segment is two halves used in turn, round by round, so
a load stages at most ``2 x round_bytes`` per rank however big it is, and fresh pages (each
one faulted and zeroed by the kernel, the main cost of a copy on a virtual machine) are paid
for once. Pairs of ranks on different hosts, and any pair that cannot map a segment, use the
group exchange (:func:`.exchange.exchange`) after the rounds.

Collective steps, all over the load's group (each wait bounded by the group's timeout):

1. ``begin``: every rank lays out the regions it sends (round, slot), creates its segment
   (``O_CREAT | O_EXCL``, mode 0600, a random name, allocated up front so a full
   ``/dev/shm`` fails here with ``ENOSPC`` instead of a ``SIGBUS`` later), and all gather
   ``[host, name, rounds]``; each rank maps the same-host segments it receives from, and all
   learn which mappings failed (one flag when none did). After that nobody opens a segment
   again, so every owner unlinks its own: the memory lives on only in the mappings, and a
   killed rank leaves nothing in ``/dev/shm`` (except between creation and that step).
   Before all this each rank has asked the disk to read ahead (:class:`ReadAhead`), and round
   0's reads start before the receiving pages are faulted in.
2. Round ``k`` (the same count on every rank): readers read round ``k``'s regions into half
   ``k % 2``; all agree the reads are intact (a corrupt chunk raises the same error on every
   rank here, before anyone uses its bytes); receivers copy round ``k`` out. Half ``k % 2``
   is written again in round ``k + 2`` only, after the agreement of round ``k + 1``, which
   every rank enters once done copying round ``k``: one collective per round.
3. The group exchange for the pairs that did not share memory.

Segments hold raw tensor bytes and a msgpack table of where each region sits; no pickle.
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
import re
import secrets
import sys
import time
import warnings
from collections import defaultdict
from typing import Any, Callable, Optional, Sequence

import msgpack
import torch

from shardpoint_core.format import errors
from shardpoint.exchange.comm import Comm, agree, exchange
from shardpoint.exchange.prefault import populate_write
from shardpoint.tree.views import box_view, copy_into, to_numpy
from shardpoint_core.transactions.reader import CheckpointReader

SHM_DIR = "/dev/shm"
# 8 MiB rounds (a segment of 2 x 8 MiB per rank): each page of a segment costs its owner
# time to allocate, zero and map and every peer time to map, and on a host with more ranks
# than cores that CPU is the load's limit (perf: the segments' lifecycle took ~19% of all
# samples of 4 ranks loading 512 MiB by columns with 16 MiB rounds, as much as the reads).
# Interleaved on the quiet 2-core machine, 5 cold loads per run, 8 vs 16 MiB: 4 ranks all
# ranks' CPU 0.71/0.68/0.67 vs 0.83/0.74/0.70 s per load, x the same-layout load 1.16x
# (median of 3 runs) vs 1.26x; 3 ranks 0.58 vs 0.65 s (2 runs each). Earlier, 16 MiB beat
# 32 MiB (0.93 vs 1.02 s, 4 ranks).
ROUND_BYTES = 8 << 20
_NAME = re.compile(r"^shardpoint-[0-9]+-[0-9a-f]{32}$")
_ALIGN = 64
_BIG = 2**62  # stands for any slot offset when sizing the header
# Map every page at once (one call) instead of a fault per page at first touch, which
# made the first rounds' copies several times slower than the later ones.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_MADV_POPULATE_READ = 22


def shm_supported() -> bool:
    """Whether this machine has a POSIX shared-memory directory to put segments in."""
    return sys.platform.startswith("linux") and os.path.isdir(SHM_DIR)


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def plan_rounds(sizes: Sequence[int], round_bytes: int) -> tuple:
    """Regions (byte sizes, in read order) packed into rounds of at most ``half`` bytes each,
    ``half = max(largest region, min(round_bytes, total))``: ``(half, [(round, slot)])``."""
    total = sum(_align(n) for n in sizes)
    half = max([_align(n) for n in sizes] + [min(round_bytes, total)])
    out, k, pos = [], 0, 0
    for n in sizes:
        if pos and pos + _align(n) > half:
            k, pos = k + 1, 0
        out.append((k, pos))
        pos += _align(n)
    return half, out


class Segment:
    """This rank's shared-memory file: ``[u64 header length][msgpack header][half 0][half
    1]``; the header maps each region (read index) to ``[round, slot, offset, shape]``."""

    def __init__(self, table: list, half: int) -> None:
        header = msgpack.packb(table)
        self.half = half
        self.data_start = _align(8 + len(header))
        self.size = self.data_start + 2 * half
        self.name = f"shardpoint-{os.getpid()}-{secrets.token_hex(16)}"
        self.path = os.path.join(SHM_DIR, self.name)
        self.map: Optional[mmap.mmap] = None
        fd = os.open(
            self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            os.posix_fallocate(fd, 0, self.size)
            self.map = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)
        self.map[:8] = len(header).to_bytes(8, "little")
        self.map[8 : 8 + len(header)] = header

    def view(self, k: int, slot: int, nbytes: int) -> torch.Tensor:
        """The uint8 tensor over ``nbytes`` at ``slot`` of round ``k``'s half."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(
            self.map,
            dtype=torch.uint8,
            count=nbytes,
            offset=self.data_start + (k % 2) * self.half + slot,
        )

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class PeerSegment:
    """Another rank's segment, mapped read-only (the owner's bytes stay as it verified them
    whatever happens here), and its region table."""

    def __init__(self, name: Any) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            raise errors.LoadFailedError(
                f"peer shared-memory segment name {name!r} is not one shardpoint creates"
            )
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            self.size = os.fstat(fd).st_size
            self.map = mmap.mmap(fd, self.size, access=mmap.ACCESS_READ)
            try:
                self.map.madvise(_MADV_POPULATE_READ)
            except (OSError, ValueError):  # a kernel before 5.14: pages fault in on use
                pass
        finally:
            os.close(fd)
        n = int.from_bytes(self.map[:8], "little")
        if n > self.size - 8:
            raise errors.LoadFailedError(
                f"shared-memory segment {name}: header of {n} bytes in a {self.size}-byte segment"
            )
        self.table = {
            i: (k, s, tuple(o), tuple(sh))
            for i, k, s, o, sh in msgpack.unpackb(self.map[8 : 8 + n], strict_map_key=False)
        }
        self.data_start = _align(8 + n)
        self.half = (self.size - self.data_start) // 2

    def round_of(self, i: int) -> int:
        return self.table[i][0]

    def box(self, i: int, dtype: torch.dtype, box_off: tuple, box_shape: tuple) -> torch.Tensor:
        """The view of region ``i`` (in its round's half) covering the global box."""
        k, slot, off, shape = self.table[i]
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if slot + n > self.half:
            raise errors.LoadFailedError(
                f"shared-memory region {i} ends at {slot + n}, past "
                f"the segment's {self.half}-byte half"
            )
        if n == 0:
            return box_view(torch.empty(shape, dtype=dtype), off, box_off, box_shape)
        with warnings.catch_warnings():  # read-only on purpose: it is only copied from
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(
                self.map,
                dtype=torch.uint8,
                count=n,
                offset=self.data_start + (k % 2) * self.half + slot,
            )
        return box_view(t.view(dtype).view(shape), off, box_off, box_shape)


class HostExchange:
    """Step 1 of the module docstring, and what the rounds need to know afterwards."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.seg: Optional[Segment] = None
        self.slots: dict = {}  # read index -> (round, slot)
        self.rounds = 0
        self.peers: dict = {}  # same-host rank I receive from -> PeerSegment
        self.to_shm: set = set()  # ranks that copy from my segment
        self.notes: list = []  # why shared memory was not used somewhere

    @classmethod
    def begin(
        cls,
        comm: Comm,
        host: str,
        regions: Sequence[tuple],
        recv_from: set,
        use_shm: bool,
        round_bytes: int = ROUND_BYTES,
    ) -> "HostExchange":
        """Collective. ``regions``: ``(read index, global offset, shape, nbytes)`` of each read
        this rank sends, in read order; ``recv_from``: the ranks it receives from."""
        hx = cls(comm)
        try:
            hx._begin(host, regions, recv_from, use_shm and shm_supported(), round_bytes)
        except BaseException:
            hx.close()
            raise
        return hx

    def _begin(
        self, host: str, regions: Sequence[tuple], recv_from: set, use_shm: bool, round_bytes: int
    ) -> None:
        comm = self.comm
        name, my_rounds = None, 0
        if use_shm and regions:
            half, where = plan_rounds([n for *_, n in regions], round_bytes)
            self.slots = {r[0]: w for r, w in zip(regions, where)}
            my_rounds = where[-1][0] + 1
            table = [[i, k, s, list(o), list(sh)] for (i, o, sh, _n), (k, s) in zip(regions, where)]
            try:
                self.seg = Segment(table, half)
                name = self.seg.name
            except OSError as e:
                self.notes.append(f"cannot create a segment: {e}")
                self.slots = {}
                my_rounds = 0
        got = [
            msgpack.unpackb(g)
            for g in comm.all_gather_bytes(msgpack.packb([host, name, my_rounds]))
        ]
        self.rounds = max(r for _h, _n, r in got)
        failed = []
        for src in sorted(recv_from):
            h, n, _r = got[src]
            if src == comm.rank or h != host:
                continue
            if not use_shm or n is None:
                failed.append(src)
                continue
            try:
                self.peers[src] = PeerSegment(n)
            except Exception as e:  # noqa: BLE001 - that pair goes through the group instead
                failed.append(src)
                self.notes.append(f"cannot map rank {src}'s segment: {e}")
        if comm.all_true(not failed):  # the usual case: one flag, not a gather
            fails: list = [[]] * comm.size
        else:
            fails = [msgpack.unpackb(g) for g in comm.all_gather_bytes(msgpack.packb(failed))]
        # Nobody opens a segment after this step: the mappings keep the memory alive.
        if self.seg is not None:
            self.seg.unlink()
        self.to_shm = {
            d
            for d, (h, _n, _r) in enumerate(got)
            if h == host and d != comm.rank and self.seg is not None and comm.rank not in fails[d]
        }

    def close(self) -> None:
        """Unlink this rank's segment if still linked, drop the mappings (idempotent)."""
        if self.seg is not None:
            self.seg.unlink()
        self.peers = {}


def execute_dedup_load(
    comm: Comm,
    reader: CheckpointReader,
    work: Any,
    budget: int,
    timings: dict,
    dst_view: Callable,
    handle: Callable,
    dtype_of: Callable,
    host: str,
    use_shm: bool,
    round_bytes: int = ROUND_BYTES,
) -> tuple:
    """Collective: read this rank's share of a dedup load plan (``RankLoadWork``), copy its
    own parts, and exchange the rest (module docstring). Returns ``(bytes read, bytes
    sent)``; ``timings`` gains the phases and the bytes moved through shared memory. Every
    read goes through ``reader``, the load's checkpoint transaction."""
    t0 = time.perf_counter()
    reads = work.reads
    size = [
        math.prod(op.shape) * torch.empty((), dtype=dtype_of(op.key)).element_size() for op in reads
    ]
    # The disk starts now, while the ranks set up the exchange: nothing below needs it.
    ahead = ReadAhead(reader, handle, reads, size, 2 * round_bytes)
    ahead.upto(-1)
    timings["prefetch_s"] = time.perf_counter() - t0
    sent_to: dict = defaultdict(set)
    for t in work.sends:
        sent_to[t.src_ref[0]].add(t.dst)
    hx = HostExchange.begin(
        comm,
        host,
        [(i, reads[i].offset, reads[i].shape, size[i]) for i in sorted(sent_to)],
        {t.src for t in work.recvs},
        use_shm,
        round_bytes,
    )
    try:
        return _run(
            comm,
            reader,
            work,
            budget,
            timings,
            dst_view,
            handle,
            dtype_of,
            hx,
            size,
            sent_to,
            t0,
            ahead,
        )
    finally:
        hx.close()


class ReadAhead:
    """Keeps the disk a window of bytes ahead of this rank's reads, in read order (a hint,
    :meth:`~CheckpointReader.prefetch`): reads in rounds then find their bytes in the page cache
    instead of leaving the disk idle while the ranks agree and copy. A window, not
    everything at once: a disk that serves every rank's whole share interleaved would make
    the first round wait for nearly all of it, with the copies left for the end."""

    def __init__(
        self,
        reader: CheckpointReader,
        handle: Callable,
        reads: Sequence,
        size: Sequence[int],
        window: int,
    ) -> None:
        self.prefetch: Optional[Callable] = reader.prefetch if reader.can_prefetch else None
        self.handle, self.reads, self.window = handle, reads, window
        self.end = list(itertools.accumulate(size))  # bytes up to and including read i
        self.next = 0
        if self.prefetch is not None:
            try:  # array metadata first: it would wait behind the data otherwise
                for op in reads:
                    handle(op.key)
            except Exception:  # noqa: BLE001 - raised again where that array is read
                self.prefetch = None

    def upto(self, i: int) -> None:
        """Reads ``0..i`` are under way: start those within the window after them."""
        if self.prefetch is None or not self.reads:
            return
        limit = (self.end[min(i, len(self.end) - 1)] if i >= 0 else 0) + self.window
        try:
            while self.next < len(self.reads) and self.end[self.next] <= limit:
                op = self.reads[self.next]
                self.prefetch(self.handle(op.key), op.offset, op.shape)
                self.next += 1
        except Exception:  # noqa: BLE001 - a hint; the reads themselves report any problem
            self.prefetch = None


def _run(
    comm: Comm,
    reader: CheckpointReader,
    work: Any,
    budget: int,
    timings: dict,
    dst_view: Callable,
    handle: Callable,
    dtype_of: Callable,
    hx: HostExchange,
    size: list,
    sent_to: dict,
    t0: float,
    ahead: ReadAhead,
) -> tuple:
    reads = work.reads
    t_begin = time.perf_counter()
    staged: dict = defaultdict(list)  # round -> read indexes read into the segment
    mixed: dict = defaultdict(list)  # round -> read indexes copied into it from private
    bufs: list = [None] * len(reads)
    err: Optional[BaseException] = None
    nread = 0

    def local_copies(i: int) -> None:
        for q, pi, bo, bs in reads[i].local:
            v, off = dst_view(q, pi)
            copy_into(box_view(v, off, bo, bs), box_view(bufs[i], reads[i].offset, bo, bs))

    def issue(k: int) -> list:
        seg = hx.seg
        assert seg is not None, "a round is issued only where this rank has a segment"
        ops = []
        for i in staged.get(k, ()):
            r, s = hx.slots[i]
            bufs[i] = seg.view(r, s, size[i]).view(dtype_of(reads[i].key)).view(reads[i].shape)
            ops.append(reader.read_into(handle(reads[i].key), reads[i].offset, to_numpy(bufs[i])))
        reader.start_reads()  # they run while this rank copies the round before
        ahead.upto(max(staged.get(k, [-1])))
        return ops

    # Every read this rank can start now is started (private ones and round 0's), then the
    # receiving side's pages are faulted in while the reads run.
    ops, post, pending, private = [], [], [], []
    try:
        for i, op in enumerate(reads):
            dt = dtype_of(op.key)
            if op.direct is not None:
                v, off = dst_view(*op.direct)
                v = box_view(v, off, op.offset, op.shape)
                if v.device.type != "cpu":
                    buf = torch.empty(op.shape, dtype=dt, pin_memory=torch.cuda.is_available())
                    post.append((v, buf))
                    v = buf
                ops.append(reader.read_into(handle(op.key), op.offset, to_numpy(v)))
                nread += size[i]
                continue
            shm_dsts = sent_to.get(i, set()) & hx.to_shm
            if i in hx.slots and shm_dsts and shm_dsts == sent_to[i]:
                staged[hx.slots[i][0]].append(i)
                continue
            bufs[i] = torch.empty(op.shape, dtype=dt)
            private.append(i)
            if i in hx.slots and shm_dsts:
                mixed[hx.slots[i][0]].append(i)
            ops.append(reader.read_into(handle(op.key), op.offset, to_numpy(bufs[i])))
            nread += size[i]
        if hx.seg is not None:
            pending = issue(0)
        reader.start_reads()  # the private reads run while the pages are faulted in
    except Exception as e:  # noqa: BLE001 - shared with every rank at the next agreement
        err = e

    t_pop = time.perf_counter()
    shm_recv: dict = defaultdict(list)  # round -> [(Transfer, destination view)]
    group_recv: list = []
    try:
        for t in work.recvs:
            v, off = dst_view(*t.dst_ref)
            dst = box_view(v, off, t.box_offset, t.box_shape)
            if t.src in hx.peers:
                shm_recv[hx.peers[t.src].round_of(t.src_ref[0])].append((t, dst))
                populate_write(dst)
            else:
                group_recv.append((t.src, dst))
    except Exception as e:  # noqa: BLE001
        err = err or e
    timings["populate_s"] = time.perf_counter() - t_pop

    t = time.perf_counter()
    try:
        reader.wait(ops)
        for v, buf in post:
            v.copy_(buf, non_blocking=True)
        for i in private:
            local_copies(i)
    except Exception as e:  # noqa: BLE001 - shared with every rank at the next agreement
        err = err or e
    timings["storage"] = time.perf_counter() - t

    moved = t_read = t_copy = t_wait = 0.0
    for k in range(max(hx.rounds, 1)):
        t = time.perf_counter()
        try:  # waited for even after an error: no read may still be filling the segment
            reader.wait(pending)
        except Exception as e:  # noqa: BLE001
            err = err or e
        if err is None and hx.seg is not None:
            try:
                nread += sum(size[i] for i in staged.get(k, ()))
                for i in mixed.get(k, ()):
                    r, s = hx.slots[i]
                    copy_into(hx.seg.view(r, s, size[i]), bufs[i].reshape(-1).view(torch.uint8))
                for i in staged.get(k, ()):
                    local_copies(i)
            except Exception as e:  # noqa: BLE001
                err = e
        pending = []
        t_read += time.perf_counter() - t
        t = time.perf_counter()
        agree(comm, err, errors.LoadFailedError)  # every rank's round k is intact
        t_wait += time.perf_counter() - t
        # Every peer finished copying round k - 1 before this agreement: its half is free.
        if k + 1 < hx.rounds and hx.seg is not None:
            try:
                pending = issue(k + 1)
            except Exception as e:  # noqa: BLE001 - raised at the next agreement
                err = e
        t = time.perf_counter()
        try:
            for tr, dst in shm_recv.get(k, ()):
                copy_into(
                    dst,
                    hx.peers[tr.src].box(
                        tr.src_ref[0], dtype_of(tr.key), tr.box_offset, tr.box_shape
                    ),
                )
                moved += dst.numel() * dst.element_size()
        except Exception as e:  # noqa: BLE001 - raised at the next agreement, or below
            err = e
        t_copy += time.perf_counter() - t
    t = time.perf_counter()
    # An error here can only come from the last round's copies (earlier ones were raised at
    # an agreement): the buffers are intact, so this rank still does its part of the exchange.
    sends = [
        (
            t_.dst,
            box_view(bufs[t_.src_ref[0]], reads[t_.src_ref[0]].offset, t_.box_offset, t_.box_shape),
        )
        for t_ in work.sends
        if t_.dst not in hx.to_shm
    ]
    exchange(comm, sends, group_recv, budget)
    timings.update(
        {
            "shm_rounds": hx.rounds,
            "shm_bytes": moved,
            "shm_read_s": t_read,
            "shm_wait_s": t_wait,
            "shm_copy_s": t_copy,
            "group_bytes": sum(v.numel() * v.element_size() for _, v in group_recv),
            "group_s": time.perf_counter() - t,
            "setup_s": t_begin - t0,
        }
    )
    timings["exchange"] = t_copy + timings["group_s"]  # moving bytes, not waiting
    if hx.notes:
        timings["shm_notes"] = "; ".join(hx.notes)
    if err is not None:
        raise err
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return nread, sum(
        math.prod(t_.box_shape) * torch.empty((), dtype=dtype_of(t_.key)).element_size()
        for t_ in work.sends
    )
