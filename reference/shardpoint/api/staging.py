"""Host staging for saves: a reusable pool of host buffers (async save) and a bounded stream
of device-to-host copies feeding writes (CUDA tensors in a sync save). No I/O of its own and
no process group; callers pass the write function.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable, Optional

import torch

from shardpoint.tree.views import copy_into

_ALIGN = 64


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def cuda_staging() -> bool:
    """Whether host buffers should be pinned (CUDA present): pinned memory is what lets a
    device-to-host copy run asynchronously and at full rate."""
    return torch.cuda.is_available()


class StagingPool:
    """One host arena, carved into the buffers one save needs, kept across saves.

    ``take`` reuses the arena when the save's buffers fit in it (a save of the same structure
    always does), so from the second save on staging is a plain copy into memory that is
    already faulted in (pinned when CUDA is present). A bigger structure replaces the arena.
    """

    def __init__(self) -> None:
        self.arena: Optional[torch.Tensor] = None
        self.pinned = False

    @property
    def nbytes(self) -> int:
        return 0 if self.arena is None else self.arena.numel()

    def take(self, requests: list) -> tuple:
        """Buffers for ``requests`` = [(shape, torch dtype)], in order, and the seconds spent
        allocating (and touching) a new arena; 0.0 when the old one was reused."""
        sizes = [
            _aligned(math.prod(s) * torch.empty((), dtype=d).element_size()) for s, d in requests
        ]
        total, pinned, alloc = sum(sizes), cuda_staging(), 0.0
        if self.arena is None or self.arena.numel() < total or self.pinned != pinned:
            t = time.perf_counter()
            self.arena = None  # free the old arena before the new one is allocated
            self.arena = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pinned)
            if not pinned:
                self.arena.fill_(0)  # fault the pages in now: allocation is reported apart
            self.pinned, alloc = pinned, time.perf_counter() - t
        out, pos = [], 0
        for (shape, dt), n in zip(requests, sizes):
            nb = math.prod(shape) * torch.empty((), dtype=dt).element_size()
            out.append(self.arena[pos : pos + nb].view(dt).view(shape))
            pos += n
        return out, alloc


def side_stream() -> Optional[torch.cuda.Stream]:
    """A CUDA stream for device-to-host copies, ordered after the caller's current stream
    (so copies see every kernel queued before the save); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    return s


def copy_pairs(pairs: list) -> None:
    """``dst.copy_(src)`` for each pair (between CPU tensors one numpy copy each, see
    :func:`.views.copy_into`: 3.5x faster than torch's threaded copy for a 1.2 GB state on 2
    cores); device sources are copied on a side stream, non-blocking, and this returns once
    every copy has landed."""
    stream = side_stream() if any(s.is_cuda for _, s in pairs) else None
    if stream is None:
        for dst, src in pairs:
            copy_into(dst, src)
        return
    with torch.cuda.stream(stream):
        for dst, src in pairs:
            dst.copy_(src, non_blocking=src.is_cuda)
    stream.synchronize()


def stream_device_writes(items: list, write: Callable, wait: Callable, budget_bytes: int) -> list:
    """Write device tensors through pinned host buffers, at most ``budget_bytes`` of them in
    flight (or one item, if bigger): the copy of item k+1 runs while item k is written.

    ``items`` = [(tensor, context)]; ``write(host_tensor, context)`` starts a write and returns
    an op; ``wait(op)`` finishes it. Returns the ops still pending (the caller waits on them;
    their host buffers stay referenced by the ops' closures until then).
    """
    stream = side_stream()
    staged: deque = deque()  # (op, nbytes, host buffer) in flight, oldest first
    in_flight = 0
    for src, ctx in items:
        n = src.numel() * src.element_size()
        while staged and in_flight + n > budget_bytes:
            op, m, _buf = staged.popleft()
            wait(op)
            in_flight -= m
        host = torch.empty(src.shape, dtype=src.dtype, pin_memory=stream is not None)
        if stream is not None:
            with torch.cuda.stream(stream):
                host.copy_(src, non_blocking=True)
            stream.synchronize()
        else:
            host.copy_(src)
        staged.append((write(host, ctx), n, host))
        in_flight += n
    return [(op, host) for op, _n, host in staged]
