"""The benchmark's pieces: states, cache dropping, peak-memory sampling, and one save/load
step per tool (raw file I/O, shardpoint, DCP, torch.save, safetensors). Each step returns its
seconds (and, for async saves, the blocking part); ``bench.py`` interleaves and tabulates."""

from __future__ import annotations

import inspect
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

import shardpoint as sp
from shardpoint_core.stores.fsutil import fsync_dir

HAS_ASYNC = "async_save" in inspect.signature(sp.save).parameters


from bench_states import mixed_state, uniform_state  # noqa: E402,F401 - re-exported


def flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def empty_like_tree(tree):
    if isinstance(tree, dict):
        return {k: empty_like_tree(v) for k, v in tree.items()}
    return torch.empty_like(tree)


def nbytes(tree: dict) -> int:
    return sum(t.numel() * t.element_size() for t in flat(tree).values())


# ------------------------------------------------------------------------ cache and memory
def drop_caches() -> bool:
    """Write back and drop the page cache (root only); False when that is not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak resident memory above the level at entry, sampled every 2 ms."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())
        self.extra = self.peak - self.base


def count_files(path: str) -> str:
    """'files / directories' a checkpoint at ``path`` holds (its own directory included)."""
    if os.path.isfile(path):
        return "1 / 0"
    if not os.path.isdir(path):
        return ""
    walk = list(os.walk(path))
    return f"{sum(len(fs) for _, _, fs in walk)} / {len(walk)}"


def rm(p: str) -> None:
    """Remove the benchmark's own scratch output ``p`` (a tree, a file or nothing)."""
    if os.path.isdir(p) and not os.path.islink(p):
        shutil.rmtree(p, ignore_errors=True)
    elif os.path.lexists(p):
        os.remove(p)


fsync_path = fsync_dir


# ------------------------------------------------------------------------------- the tools
def _pieces(bufs: list, piece: int) -> list:
    """(uint8 view, file offset) pieces of at most ``piece`` bytes, the tensors back to back."""
    jobs, off = [], 0
    for b in bufs:
        mv = b.contiguous().reshape(-1).view(torch.uint8).numpy()
        for s in range(0, mv.size, piece):
            jobs.append((mv[s : s + piece], off + s))
        off += mv.size
    return jobs


def raw_write(
    state: dict, path: str, threads: int = 1, early: bool = False, piece: int = 16 << 20
) -> None:
    """The write limit: every tensor's bytes into one file, then one fsync. One thread of
    plain writes, or ``threads`` threads of ``pwrite`` in ``piece``-byte pieces; ``early``
    starts each piece's writeback right after it (``sync_file_range``), as shardpoint's
    writer does, so the disk works while memory is still being copied."""
    if threads == 1 and not early:
        with open(path, "wb") as f:
            for t in flat(state).values():
                f.write(t.contiguous().view(torch.uint8).reshape(-1).numpy().data)
            f.flush()
            os.fsync(f.fileno())
        return
    from shardpoint_core.arrays.direct_write import start_writeback

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:

        def one(job):
            mv, off = job
            os.pwrite(fd, mv, off)
            if early:
                start_writeback(fd, off, mv.size)

        jobs = _pieces(list(flat(state).values()), piece)
        if threads == 1:
            for j in jobs:
                one(j)
        else:
            with ThreadPoolExecutor(threads) as ex:
                list(ex.map(one, jobs))
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(bufs: list, path: str, threads: int = 4, piece: int = 16 << 20) -> None:
    """The read limit: ``threads`` threads of preadv into preallocated buffers."""
    fd = os.open(path, os.O_RDONLY)
    jobs = _pieces(bufs, piece)
    try:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(lambda j: os.preadv(fd, [j[0]], j[1]), jobs))
    finally:
        os.close(fd)


# ------------------------------------------------- the floor of a file-per-chunk layout
def file_layout(root: str) -> list:
    """``[(relative path, size)]`` of every regular file under ``root``, sorted."""
    out = []
    for d, _, fs in os.walk(root):
        for f in fs:
            p = os.path.join(d, f)
            out.append((os.path.relpath(p, root), os.path.getsize(p)))
    return sorted(out)


def _file_pieces(bufs: list, layout: list) -> list:
    """Per file of ``layout``, its bytes as views into ``bufs`` taken back to back (a file
    may span tensors; the bytes wrap around when the files hold more than the tensors)."""
    views = [b.contiguous().reshape(-1).view(torch.uint8).numpy() for b in bufs]
    views = [v for v in views if v.size]
    out, i, pos = [], 0, 0
    for _, size in layout:
        pieces = []
        while size:
            n = min(size, views[i].size - pos)
            pieces.append(views[i][pos : pos + n])
            size, pos = size - n, pos + n
            if pos == views[i].size:
                i, pos = (i + 1) % len(views), 0
        out.append(pieces)
    return out


def raw_write_files(state: dict, layout: list, root: str, threads: int = 16) -> None:
    """The floor of shardpoint's layout: the same files (paths and sizes, the state's bytes)
    written from ``threads`` threads with early writeback, then one ``syncfs``. No
    checksums, planning or metadata encoding: what is left is the file system's cost."""
    from shardpoint_core.arrays.direct_write import start_writeback
    from shardpoint_core.stores.durable import syncfs

    def one(job):
        rel, pieces = job
        p = os.path.join(root, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            n = os.pwritev(fd, pieces, 0) if pieces else 0
            start_writeback(fd, 0, n)
        finally:
            os.close(fd)

    os.makedirs(root, exist_ok=True)
    with ThreadPoolExecutor(threads) as ex:
        list(
            ex.map(
                one, zip([r for r, _ in layout], _file_pieces(list(flat(state).values()), layout))
            )
        )
    if not syncfs(root):
        os.sync()


def raw_read_files(bufs: list, layout: list, root: str, threads: int = 8) -> None:
    """The read floor of shardpoint's layout: every file of the checkpoint read whole with
    ``preadv`` into preallocated buffers from ``threads`` threads; no checksums, no plan."""

    def one(job):
        rel, pieces = job
        fd = os.open(os.path.join(root, rel), os.O_RDONLY)
        try:
            os.preadv(fd, pieces, 0)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, zip([r for r, _ in layout], _file_pieces(bufs, layout))))


def copy_state(bufs: list, flat_state: dict) -> None:
    """A plain copy of the state into buffers already touched (what an async save's
    blocking part cannot do without): ``numpy.copyto`` of the bytes, the fastest copy here
    (torch's threaded ``copy_`` measured 3.5x slower for this state on 2 cores)."""
    for b, t in zip(bufs, flat_state.values()):
        np.copyto(b.reshape(-1).view(torch.uint8).numpy(), t.reshape(-1).view(torch.uint8).numpy())


def sp_save(state: dict, path: str, backend=None) -> None:
    sp.save(state, path, overwrite=True, backend=backend)


def sp_async_save(state: dict, path: str) -> tuple:
    """(blocking seconds, total seconds) of ``sp.save(..., async_save=True)``."""
    t = time.perf_counter()
    h = sp.save(state, path, overwrite=True, async_save=True)
    blocking = time.perf_counter() - t
    h.result()
    return blocking, time.perf_counter() - t


def sp_load(like: dict, path: str) -> None:
    sp.load(path, like=like)


def _dcp_writer(path: str, threads: int):
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(path, thread_count=threads, sync_files=True)


def dcp_save(state: dict, path: str, threads: int) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=_dcp_writer(path, threads))


def dcp_async_save(state: dict, path: str, threads: int) -> tuple:
    import torch.distributed.checkpoint as dcp

    t = time.perf_counter()
    fut = dcp.async_save(state, storage_writer=_dcp_writer(path, threads))
    blocking = time.perf_counter() - t
    fut.result()
    return blocking, time.perf_counter() - t


def dcp_load(like: dict, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    dcp.load(like, storage_reader=FileSystemReader(path))


def torch_save(state: dict, path: str) -> None:
    torch.save(state, path)
    fsync_path(path)


def torch_load(path: str) -> None:
    torch.load(path, weights_only=True)


def st_save(flat_state: dict, path: str) -> None:
    from safetensors.torch import save_file

    save_file(flat_state, path)
    fsync_path(path)


def st_load(path: str) -> None:
    from safetensors.torch import load_file

    load_file(path)
