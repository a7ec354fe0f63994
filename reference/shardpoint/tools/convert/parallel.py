"""Conversion with several worker processes: the tensors (and bands of rows of the big ones)
are shared out by bytes, each worker opens the source itself and reads only its share, and
one coordinator commits the result once.

The coordinator does everything that is decided once: it opens the source for its listing,
lays out the target (a shardpoint checkpoint's arrays and tree, or the safetensors files'
headers and offsets) exactly as the one-process writer does, creates it in a staging location,
starts the workers, and only when every worker has reported its part written and durable
writes the manifest (or the index) and renames the result into place. A worker that fails,
dies or goes silent for ``timeout`` seconds stops the others, the staging is removed, and the
error names the key it was converting. The output is byte for byte what one process writes:
the same chunk grid, the same files, each chunk (or byte range) written by exactly one worker.

Workers are forked from a fork server (no inherited threads or locks; see
:func:`worker_context`) and talk to the coordinator over a multiprocessing queue with small
tuples (work descriptions, byte counts and, once, the crc32c of the chunks a worker wrote for
the chunk tables; never checkpoint data). As with any
multiprocessing start method but ``fork``, a script that converts with ``procs`` > 1 must
guard its top level with ``if __name__ == "__main__":`` (workers import the main module).
"""

from __future__ import annotations

import importlib.util
import math
import multiprocessing as mp
import os
import queue
import time
import traceback
from dataclasses import dataclass
from typing import Any, Optional

from shardpoint_core.format import errors
from shardpoint_core.format.errors import ConversionError
from shardpoint_core.stores.fsutil import os_error_text
from shardpoint_core.commit.base import Overwrite
from shardpoint_core.transactions.writer import CheckpointWriter
from shardpoint.tools.convert.base import (
    Progress,
    Source,
    TensorInfo,
    die_with_parent,
    key_of,
    limit_heap_growth,
    staged_output,
)
from shardpoint.tools.convert.hf_safetensors import (
    file_layout,
    is_safetensors_output,
    plan_files,
    write_index,
    write_rows_at,
)
from shardpoint.tools.convert.native import (
    begin_writer,
    commit_shardpoint,
    open_entry,
    shardpoint_tree,
    tensor_entry,
    write_rows,
)

WORKER_TIMEOUT_S = 600.0
"""Default seconds a worker may stay silent (no band of rows written) before the conversion
is stopped: generous for a slow band, short enough that a hung worker never stalls a job."""

STARTUP_TIMEOUT_S = 180.0
"""Seconds a worker may take to start and open the source before its first report (the fork
server imports torch first: seconds on a busy machine)."""


@dataclass(frozen=True)
class WorkItem:
    """Rows ``start:stop`` of the tensor at ``path`` (``stop`` 0 for a 0-d tensor)."""

    path: tuple
    start: int
    stop: int


# ------------------------------------------------------------------------------ planning
def plan_shares(tensors: list, procs: int, row_step: dict) -> list:
    """Split ``tensors`` (``[TensorInfo]``) into ``procs`` lists of :class:`WorkItem`, balanced
    by bytes. A tensor bigger than an even share is cut into bands of rows, each a multiple of
    ``row_step[path]`` rows (its chunk rows: one writer per chunk), of about a share each; the
    pieces go largest first to the least loaded worker. Each worker's list is in source order.
    Pure: no I/O."""
    total = sum(t.nbytes for t in tensors)
    share = max(1, math.ceil(total / max(1, procs)))
    order = {t.path: i for i, t in enumerate(tensors)}
    units = []
    for t in tensors:
        rows = t.shape[0] if t.shape else 0
        if not t.shape or t.nbytes <= share or rows <= 1:
            units.append((t.nbytes, WorkItem(t.path, 0, rows)))
            continue
        step = max(1, row_step.get(t.path, 1))
        row_bytes = t.nbytes // rows
        per = max(step, (share // max(1, row_bytes)) // step * step)
        for lo in range(0, rows, per):
            hi = min(rows, lo + per)
            units.append(((hi - lo) * row_bytes, WorkItem(t.path, lo, hi)))
    loads = [0] * procs
    out: list = [[] for _ in range(procs)]
    for nbytes, item in sorted(units, key=lambda u: (-u[0], order[u[1].path], u[1].start)):
        w = loads.index(min(loads))
        loads[w] += nbytes
        out[w].append(item)
    return [sorted(items, key=lambda i: (order[i.path], i.start)) for items in out]


# ------------------------------------------------------------------------------ workers
@dataclass(frozen=True)
class SourceSpec:
    """How a worker opens the source again (its own handles, only the tensors)."""

    path: str
    format: str
    skip_common: bool
    trust_pickle: bool = False  # what the caller allowed when it opened the source


def _open_for_worker(spec: SourceSpec) -> Source:
    from shardpoint.tools.convert.sources import open_source

    return open_source(
        spec.path,
        spec.format,
        skip_common=spec.skip_common,
        tensors_only=True,
        trust_pickle=spec.trust_pickle,
    )


def _worker(wid: int, spec: SourceSpec, target: tuple, items: list, q: Any, env: dict) -> None:
    """One worker: open the source, write each item of its share, make it durable, report.
    ``env``: the caller's environment at the call (a worker forks from the fork server,
    whose environment is the one it started with: a store's credentials set since, as a
    job's launcher or a test does, would be missing)."""
    os.environ.clear()
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    die_with_parent()
    key = None
    try:
        import torch

        torch.set_num_threads(1)
        limit_heap_growth()
        with _open_for_worker(spec) as src:
            base = _reset_peak_rss()
            by_path = {t.path: t for t in src.tensors}
            missing = [i.path for i in items if i.path not in by_path]
            if missing:
                key = key_of(missing[0])
                raise ConversionError(
                    f"tensor {key!r} is not in {spec.path!r} as this worker "
                    "opened it (did the source change during conversion?)"
                )
            whole = [
                i.path
                for i in items
                if not by_path[i.path].shape or (i.start, i.stop) == (0, by_path[i.path].shape[0])
            ]
            # The source lists (and batches reads of) this worker's whole tensors only.
            src.tensors = [by_path[p] for p in dict.fromkeys(whole)]
            sink = _SINKS[target[0]](*target[1:])

            def progress(n: int) -> None:
                q.put(("bytes", wid, n))

            for it in items:
                t = by_path[it.path]
                key = t.key
                q.put(("start", wid, key))
                windows = getattr(src, "windows", None)
                if windows is not None:
                    windows.clear()
                    if it.path not in whole:
                        windows[it.path] = (it.start, it.stop)
                sink.write(src, t, it.start, it.stop, progress)
            key = None
            report = sink.finish()
        q.put(("done", wid, _peak_rss() - base, report))
    except BaseException as e:  # noqa: BLE001 - reported to the coordinator, named by key
        if isinstance(e, OSError) and not isinstance(e, errors.ShardpointError):
            # A full or read-only disk: the cause and its fix, not a traceback.
            q.put(
                (
                    "error",
                    wid,
                    key,
                    "ConversionError",
                    os_error_text(e) + "; nothing was written to the destination",
                    "",
                )
            )
            return
        q.put(
            (
                "error",
                wid,
                key,
                type(e).__name__,
                str(e).strip()[:2000],
                traceback.format_exc(limit=-3),
            )
        )


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(ln for ln in f if ln.startswith(field)).split()[1])


def _reset_peak_rss() -> int:
    """Reset the peak resident size to now (Linux ``clear_refs``); the current RSS in bytes
    (0 where /proc is not there)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kib("VmRSS:") * 1024
    except (OSError, StopIteration):
        return 0


def _peak_rss() -> int:
    try:
        return _status_kib("VmHWM:") * 1024
    except (OSError, StopIteration):
        return 0


class _ShardpointSink:
    """Writes bands of rows into arrays the coordinator created, in the save of ``dst`` it
    began (staged at ``staging``): this worker joins that save."""

    def __init__(self, dst: str, staging: str, entries: dict) -> None:
        self.entries = entries
        self.w = CheckpointWriter.join(dst, staging, call="convert")
        self.handles: dict = {}

    def write(self, src: Source, t: TensorInfo, start: int, stop: int, progress: Progress) -> None:
        e = self.entries[t.key]
        if t.key not in self.handles:
            self.handles[t.key] = open_entry(self.w, e)
        write_rows(self.w, self.handles[t.key], src, t, e, start, stop, progress)

    def finish(self) -> dict:
        """Durable; the crc32c of the chunks written, for the chunk tables ([SP-MAN-7])."""
        return self.w.flush()


class _SafetensorsSink:
    """Writes bands of rows at their offsets in files the coordinator created."""

    def __init__(self, places: dict) -> None:
        self.places = places  # key -> (file, name in the file, data offset)
        self.files: dict = {}

    def write(self, src: Source, t: TensorInfo, start: int, stop: int, progress: Progress) -> None:
        fn, name, offset = self.places[t.key]
        if fn not in self.files:
            self.files[fn] = open(fn, "r+b")
        write_rows_at(self.files[fn], src, name, t, start, stop, offset, progress)

    def finish(self) -> dict:
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        self.files.clear()
        return {}


_SINKS = {"shardpoint": _ShardpointSink, "safetensors": _SafetensorsSink}


# ------------------------------------------------------------------------------ coordinator
def start_workers_early() -> None:
    """Start the fork server now (it imports torch and the readers in the background), so
    that its start overlaps the coordinator opening the source and laying out the target."""
    import multiprocessing.forkserver

    worker_context()
    multiprocessing.forkserver.ensure_running()


def worker_context() -> Any:
    """The multiprocessing context workers start from: a fork server that has imported this
    module (torch, the source readers, the backend) once, so each worker is a fork of a clean,
    single-threaded process: no inherited threads or locks, and no import per worker (seconds
    each on a busy machine). Later conversions in the same process reuse the server."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        [__name__] + [m for m in _WORKER_MODULES if importlib.util.find_spec(m.split(".")[0])]
    )
    return ctx


# What workers import late (readers of the source formats, the default backend): preloaded
# in the fork server only, never at this module's import.
_WORKER_MODULES = ("torch.distributed.checkpoint", "safetensors.torch", "shardpoint_core.arrays")


def run_workers(
    spec: SourceSpec, target: tuple, shares: list, progress: Progress, timeout: float
) -> tuple:
    """Run one worker per non-empty share and wait for all of them; the first failure, death
    or ``timeout`` seconds of silence from a worker (``STARTUP_TIMEOUT_S`` at least before its
    first report) stops them all and raises. Returns (each worker's peak memory growth while
    converting: bytes above its resident size once the source was open; each worker's
    report: the crc32c of the chunks it wrote, for a shardpoint target's chunk tables)."""
    ctx = worker_context()
    q = ctx.Queue()
    procs = {}
    for wid, items in enumerate(shares):
        if items:
            procs[wid] = ctx.Process(
                target=_worker,
                args=(wid, spec, target, items, q, dict(os.environ)),
                name=f"shardpoint-convert-{wid}",
                daemon=True,
            )
    heard = {wid: time.monotonic() for wid in procs}
    current: dict = {}
    peaks: dict = {}
    reports: dict = {}
    running = set(procs)
    try:
        for p in procs.values():
            p.start()
        while running:
            try:
                msg = q.get(timeout=1.0)
            except queue.Empty:
                msg = None
            now = time.monotonic()
            if msg is not None:
                kind, wid = msg[0], msg[1]
                heard[wid] = now
                if kind == "bytes":
                    if progress:
                        progress(msg[2])
                elif kind == "start":
                    current[wid] = msg[2]
                elif kind == "done":
                    running.discard(wid)
                    peaks[wid], reports[wid] = msg[2], msg[3]
                elif kind == "error":
                    raise _worker_error(wid, *msg[2:])
                continue
            for wid in sorted(running):
                code = procs[wid].exitcode
                if code is not None:
                    raise ConversionError(
                        f"conversion worker {wid} exited with code {code} while converting "
                        f"{_what(current.get(wid))} without reporting why (killed for memory? "
                        "try fewer --procs); nothing was written to the destination"
                    )
                # Before its first report a worker may still be starting (forking, opening
                # the source): it gets at least STARTUP_TIMEOUT_S for that.
                limit = timeout if wid in current else max(timeout, STARTUP_TIMEOUT_S)
                if now - heard[wid] > limit:
                    raise ConversionError(
                        f"conversion worker {wid} reported nothing for {limit:g}s while "
                        f"converting {_what(current.get(wid))}; stopped (raise timeout= for "
                        "slow storage); nothing was written to the destination"
                    )
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
        for p in procs.values():
            if p.pid is not None:
                p.join(timeout=10)
        q.close()
        q.join_thread()
    return [peaks[w] for w in sorted(peaks)], [reports[w] for w in sorted(reports)]


def _what(key: Optional[str]) -> str:
    return f"tensor {key!r}" if key else "(before its first tensor)"


def _worker_error(wid: int, key: Optional[str], name: str, message: str, tb: str) -> Exception:
    """The worker's error, re-raised with its own type when it is one of ours, naming the key."""
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.ShardpointError)):
        cls = ConversionError
        message = f"{name}: {message}\n{tb.strip()}"
    where = f"converting {_what(key)}" if key else "opening the source"
    return cls(f"conversion worker {wid} failed {where}: {message}")


# ------------------------------------------------------------------------------ targets
def write_shardpoint_parallel(
    src: Source,
    dst: str,
    spec: SourceSpec,
    *,
    procs: int,
    overwrite: Overwrite = False,
    progress: Progress = None,
    max_chunk_bytes: int = 256 << 20,
    timeout: float = WORKER_TIMEOUT_S,
    worker_peaks: Optional[list] = None,
) -> list:
    """:func:`~shardpoint.tools.convert.native.write_shardpoint` with ``procs`` worker processes:
    the same checkpoint, committed once by this process (arrays durable, manifest last,
    rename). ``worker_peaks`` receives each worker's peak memory growth in bytes."""
    tree, objects, skipped = shardpoint_tree(src)
    entries = {t.key: tensor_entry(t, max_chunk_bytes) for t in src.tensors}
    shares = plan_shares(
        src.tensors, procs, {t.path: entries[t.key].chunk_shape[0] for t in src.tensors if t.shape}
    )
    with begin_writer(dst, overwrite, (src.path,)) as w:
        for e in entries.values():
            open_entry(w, e)  # metadata once, before any worker opens it
        w.flush()
        peaks, reports = run_workers(
            spec, ("shardpoint", w.path, w.staging, entries), shares, progress, timeout
        )
        src.check_unchanged()  # the workers read the source this process opened
        commit_shardpoint(w, tree, entries, objects, reports)
    if worker_peaks is not None:
        worker_peaks += peaks
    return skipped


def write_safetensors_parallel(
    src: Source,
    dst: str,
    spec: SourceSpec,
    *,
    procs: int,
    max_shard_size: Any = None,
    overwrite: Overwrite = False,
    progress: Progress = None,
    timeout: float = WORKER_TIMEOUT_S,
    worker_peaks: Optional[list] = None,
) -> list:
    """:func:`~shardpoint.tools.convert.hf_safetensors.write_safetensors` with ``procs`` workers:
    this process writes each file's header and sizes it, workers fill their tensors' bytes at
    known offsets and fsync, then the index and the rename as with one process."""
    plan = plan_files(src, dst, max_shard_size)
    places: dict = {}  # key -> (file, name in it, where its data starts)
    with staged_output(
        dst, overwrite, is_dir=plan.is_dir, is_output=is_safetensors_output, protect=(src.path,)
    ) as root:
        for fn, items in plan.files:
            header, offsets = file_layout(items)
            path = root if fn is None else os.path.join(root, fn)
            with open(path, "wb") as f:
                f.write(header)
                f.truncate(len(header) + sum(t.nbytes for _, t in items))
                f.flush()
                os.fsync(f.fileno())
            places.update({t.key: (path, name, offsets[name]) for name, t in items})
        peaks, _ = run_workers(
            spec, ("safetensors", places), plan_shares(src.tensors, procs, {}), progress, timeout
        )
        src.check_unchanged()
        if plan.index is not None:
            write_index(root, plan.index)
    if worker_peaks is not None:
        worker_peaks += peaks
    return plan.skipped


__all__ = [
    "plan_shares",
    "run_workers",
    "start_workers_early",
    "write_shardpoint_parallel",
    "write_safetensors_parallel",
    "SourceSpec",
    "WorkItem",
    "WORKER_TIMEOUT_S",
    "STARTUP_TIMEOUT_S",
]
