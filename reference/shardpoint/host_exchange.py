"""A load's exchange between ranks of one host through shared memory instead of the group.

Under the ``dedup`` load strategy each needed region is read by one rank and sent to the
others. Ranks on one host need not ship those bytes over the process group (gloo moves them
at well under 0.1 GB/s here): each reader places the regions it sends in a segment of its own
under ``/dev/shm``, reads and checks them there (the storage backend verifies every chunk's
crc32c before the read completes), and, once every rank has reported its reads intact, the
other ranks of the host map that segment and copy their boxes out at memory speed. Pairs of
ranks on different hosts, and any pair whose segment cannot be created or mapped, use the
group exchange (:func:`.exchange.exchange`) as before.

Order, every step collective over the load's group (each wait bounded by its timeout):

1. :meth:`HostExchange.begin`: every rank creates its segment (``O_CREAT | O_EXCL``, mode
   0600, a random name, all of it allocated up front so a full ``/dev/shm`` fails here with
   ``ENOSPC`` rather than later with ``SIGBUS``) and all ranks gather ``[host, name]``.
2. The caller reads into :meth:`HostExchange.buffer` views, then agrees with every rank that
   all reads succeeded (a corrupt chunk raises everywhere before anyone uses its bytes).
3. :meth:`HostExchange.run`: each rank maps the segments it receives from, all ranks gather
   which mappings failed (those pairs fall back to the group) and, that gather being a
   barrier, every owner unlinks its segment (the mappings keep the memory until the last
   one closes); then the group exchange for what remains, then the copies out.

A segment is unlinked on every path out of :meth:`HostExchange.close` too; only a process
killed between steps 1 and 3 can leave one behind (``/dev/shm/shardpoint-<pid>-<token>``).
Segments carry raw tensor bytes and a msgpack table of where each region sits; no pickle.
"""
from __future__ import annotations

import math
import mmap
import os
import re
import secrets
import sys
import time
from typing import Callable, Optional, Sequence

import msgpack
import torch

from . import errors
from .exchange import Comm, exchange
from .prefault import populate_write
from .views import box_view

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^shardpoint-[0-9]+-[0-9a-f]{32}$")
_ALIGN = 64
_HEADER_MAX = 64 << 20


def shm_supported() -> bool:
    """Whether this machine has a POSIX shared-memory directory to put segments in."""
    return sys.platform.startswith("linux") and os.path.isdir(SHM_DIR)


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class Segment:
    """A shared-memory file of one rank: ``[u64 header length][msgpack header][data]``, the
    header mapping each region (a read index) to its byte offset, global offset and shape."""

    def __init__(self, regions: Sequence[tuple]) -> None:
        """``regions``: ``(read index, global offset, shape, itemsize)`` of each region."""
        table, pos = [], 0
        for i, off, shape, itemsize in regions:
            table.append([i, pos, list(off), list(shape)])
            pos += _align(math.prod(shape) * itemsize)
        header = msgpack.packb(table)
        self.data_start = _align(8 + len(header))
        self.size = self.data_start + pos
        self.offsets = {i: self.data_start + p for i, p, _o, _s in table}
        self.name = f"shardpoint-{os.getpid()}-{secrets.token_hex(16)}"
        self.path = os.path.join(SHM_DIR, self.name)
        self.map: Optional[mmap.mmap] = None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.size)
            self.map = mmap.mmap(fd, self.size)
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)
        self.map[:8] = len(header).to_bytes(8, "little")
        self.map[8:8 + len(header)] = header

    def view(self, i: int, nbytes: int) -> torch.Tensor:
        """The uint8 tensor over region ``i``'s bytes."""
        return torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes,
                                offset=self.offsets[i])

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class PeerSegment:
    """Another rank's segment, mapped copy-on-write (never written: the owner's file stays
    intact whatever happens here), with its region table."""

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            raise errors.LoadFailedError(f"peer shared-memory segment name {name!r} is not "
                                         "one shardpoint creates")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            self.map = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        n = int.from_bytes(self.map[:8], "little")
        if n > min(_HEADER_MAX, size - 8):
            raise errors.LoadFailedError(f"shared-memory segment {name}: header of {n} bytes "
                                         f"in a {size}-byte segment")
        self.table = {i: (p, tuple(o), tuple(s)) for i, p, o, s in
                      msgpack.unpackb(self.map[8:8 + n], strict_map_key=False)}
        self.data_start = _align(8 + n)
        self.size = size

    def box(self, i: int, dtype: torch.dtype, box_off: tuple, box_shape: tuple) -> torch.Tensor:
        """The view of region ``i`` covering the global box."""
        p, off, shape = self.table[i]
        item = torch.empty((), dtype=dtype).element_size()
        n = math.prod(shape) * item
        start = self.data_start + p
        if start + n > self.size:
            raise errors.LoadFailedError(f"shared-memory region {i} ends at {start + n}, past "
                                         f"the segment's {self.size} bytes")
        t = torch.frombuffer(self.map, dtype=torch.uint8, count=n, offset=start)
        return box_view(t.view(dtype).view(shape), off, box_off, box_shape)


class HostExchange:
    """One load's exchange; see the module docstring for the order of the collective steps."""

    def __init__(self, comm: Comm, host: str, use_shm: bool) -> None:
        self.comm, self.host, self.use_shm = comm, host, use_shm and shm_supported()
        self.seg: Optional[Segment] = None
        self.peers: list = []            # per rank: [host, segment name or None]
        self.shm_error: Optional[str] = None
        self.stats: dict = {}

    @classmethod
    def begin(cls, comm: Comm, host: str, regions: Sequence[tuple],
              use_shm: bool = True) -> "HostExchange":
        """Step 1, collective: create this rank's segment for ``regions`` (``(read index,
        global offset, shape, itemsize)`` of each read that is sent to another rank) and
        learn every rank's host and segment. A segment that cannot be created is reported,
        not raised: that rank's regions then go through the group."""
        hx = cls(comm, host, use_shm)
        name = None
        if hx.use_shm and regions:
            try:
                hx.seg = Segment(regions)
                name = hx.seg.name
            except OSError as e:
                hx.shm_error = f"{type(e).__name__}: {e}"
        try:
            got = comm.all_gather_bytes(msgpack.packb([host, name]))
            hx.peers = [msgpack.unpackb(g) for g in got]
        except BaseException:
            hx.close()
            raise
        return hx

    def buffer(self, i: int, shape: tuple, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """A tensor in this rank's segment for read ``i``, or None when it has no place
        there (a read only used locally, or no segment)."""
        if self.seg is None or i not in self.seg.offsets:
            return None
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.seg.view(i, n).view(dtype).view(shape)

    def _same_host(self, r: int) -> bool:
        return r != self.comm.rank and self.peers[r][0] == self.host

    def run(self, sends: Sequence[tuple], recvs: Sequence[tuple], budget: int,
            dtype_of: Callable[[str], torch.dtype]) -> None:
        """Step 3, collective, after every rank's reads were agreed intact. ``sends``:
        ``[(Transfer, source view)]``, ``recvs``: ``[(Transfer, destination view)]``, each in
        plan order. Same-host pairs copy from the sender's segment; the rest use the group."""
        comm = self.comm
        t0 = time.perf_counter()
        mapped: dict = {}
        failed: list = []
        err: Optional[BaseException] = None
        if self.use_shm:
            for src in sorted({t.src for t, _ in recvs if self._same_host(t.src)}):
                name = self.peers[src][1]
                if name is None:
                    failed.append(src)
                    continue
                try:
                    mapped[src] = PeerSegment(name)
                except Exception as e:  # noqa: BLE001
                    # Not mappable (another machine after all, a damaged table): the pair
                    # goes through the group, which both sides learn from the gather below.
                    failed.append(src)
                    self.shm_error = f"{type(e).__name__}: {e}"
        else:
            failed = sorted({t.src for t, _ in recvs if self._same_host(t.src)})
        shm_recv = [(t, v) for t, v in recvs if t.src in mapped]
        gloo_recv = [(t.src, v) for t, v in recvs if t.src not in mapped]
        # The gather is the barrier after which no one opens a segment: owners unlink now.
        got = comm.all_gather_bytes(msgpack.packb([failed, bool(gloo_recv)]))
        if self.seg is not None:
            self.seg.unlink()
        fails = [msgpack.unpackb(g) for g in got]
        to_peer_fails = {d for d, (f, _) in enumerate(fails) if comm.rank in f}
        gloo_send = [(t.dst, v) for t, v in sends
                     if not (self._peer_has_shm(t.dst) and t.dst not in to_peer_fails)]
        if any(g for _, g in fails):
            exchange(comm, gloo_send, gloo_recv, budget)
        t1 = time.perf_counter()
        moved = 0
        if err is None:
            try:
                for _t, dst in shm_recv:
                    populate_write(dst)
                self.stats["populate_s"] = time.perf_counter() - t1
                c0 = time.thread_time()
                for t, dst in shm_recv:
                    src = mapped[t.src].box(t.src_ref[0], dtype_of(t.key), t.box_offset,
                                            t.box_shape)
                    dst.copy_(src)
                    moved += dst.numel() * dst.element_size()
            except Exception as e:  # noqa: BLE001 - raised below, after the maps are closed
                err = e
        mapped.clear()
        self.stats["copy_cpu_s"] = time.thread_time() - c0 if err is None else 0.0
        self.stats.update({"shm_bytes": moved, "group_bytes": sum(v.numel() * v.element_size()
                                                             for _, v in gloo_recv),
                      "group_s": t1 - t0, "copy_s": time.perf_counter() - t1})
        if err is not None:
            raise err

    def _peer_has_shm(self, r: int) -> bool:
        """Whether rank ``r`` reads from this rank's segment rather than the group."""
        return self._same_host(r) and self.seg is not None

    def close(self) -> None:
        """Unlink this rank's segment (idempotent); its memory goes with the last mapping."""
        if self.seg is not None:
            self.seg.unlink()
            self.seg = None
