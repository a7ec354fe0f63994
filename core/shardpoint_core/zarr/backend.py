"""Checkpoints on a local or shared file system, tensors as Zarr v3 arrays.

Reads and writes go through this project's own code: whole chunks by the direct paths
(``pwritev``/``preadv``), everything else (a write of part of a chunk, a chunk the direct
reader could not prove intact, bool arrays, verification) through the Zarr layer over a
:class:`~shardpoint_core.store.files.FileStore` (:mod:`.array`), which raises the spec's
errors. TensorStore is needed only with ``direct_reads=False`` / ``direct_writes=False`` (the
cross-check: the same files through TensorStore) and on big-endian hosts.

Every chunk and shard index carries a crc32c codec; arrays are written with
``store_data_equal_to_fill_value`` (an all-zero chunk is still a stored chunk) and read with
``fill_missing_data_reads: false`` (a missing chunk is an error, never silent zeros). Writes
reference the caller's buffer without copying; reads land directly in the caller's buffer.
Where TensorStore is used, one ``ts.Context`` is shared by all arrays.
"""
from __future__ import annotations

import errno
import math
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Sequence

import numpy as np

from shardpoint_core.errors import (CheckpointNotFoundError,
                                    CorruptCheckpointError, IncompleteCheckpointError,
                                    SaveFailedError, ShardpointError)
from shardpoint_core.hints import path_hint
from shardpoint_core.storage import MANIFEST_NAME, ArraySpec

from shardpoint_core.zarr.layout import codecs_for, fill_value
from shardpoint_core.zarr.checks import (check_array_files, check_regular_file, check_zarr_json,
                                         chunk_file_sizes, metadata_problems, read_zarr_json)

from shardpoint_core.fsutil import makedirs_below

from shardpoint_core.commit.durable import fsync_trees, syncfs, will_need
from shardpoint_core.commit.posix import PosixCommitter
from shardpoint_core.zarr.direct_read import (DirectLayout, DirectReader, parse_layout,
                                              whole_chunk_files)
from shardpoint_core.zarr.direct_write import (DirectWriter, WritePool, stored_codecs,
                                               write_layout, zarr_json_bytes)
from shardpoint_core.zarr.array import ArrayLayout, read_region, write_region
from shardpoint_core.store.files import FileStore


def _ts() -> Any:
    """TensorStore, imported only where it is used (the cross-check paths)."""
    try:
        import tensorstore
    except ImportError as e:
        from shardpoint_core.errors import InvalidOptionError
        raise InvalidOptionError("TensorStoreBackend(direct_reads=False / direct_writes="
                                 "False) and big-endian hosts need TensorStore: pip install "
                                 "'shardpoint[tensorstore]'") from e
    return tensorstore

MAX_MANIFEST_BYTES = 1 << 30


def _region(handle: Any, offset: Sequence[int], shape: Sequence[int]) -> Any:
    if not shape:
        return handle
    return handle[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


class _LazyTS:
    """An array handle whose TensorStore is opened only on first need (a write that is not
    one whole chunk, a chunk that needs the fallback reader), once, from any thread."""

    def __init__(self, open_ts: Any) -> None:
        self._open_ts = open_ts
        self._ts: Any = None
        self._lock = threading.Lock()

    def tensorstore(self) -> Any:
        with self._lock:
            if self._ts is None:
                self._ts = self._open_ts()
            return self._ts


class _WriteHandle(_LazyTS):
    """An array being written with direct chunk writes (on the zarr.json written here); a
    write of anything but one whole chunk goes through the Zarr layer over ``store``."""

    def __init__(self, writer: DirectWriter, open_ts: Any, store: FileStore, array_path: str,
                 layout: ArrayLayout) -> None:
        super().__init__(open_ts)
        self.writer = writer
        self.store, self.array_path, self.layout = store, array_path, layout
        self.partial = threading.Lock()   # writes of parts of chunks read, change, rewrite

    def write_part(self, offset: tuple, data: np.ndarray) -> None:
        """A write that is not one whole chunk, one at a time per array: two parts of one
        chunk written at once must not lose each other's bytes."""
        with self.partial:
            write_region(self.store, self.array_path, self.layout, offset, data)


def _create_zarr_json(root: str, apath: str, data: bytes) -> None:
    """Write ``apath/zarr.json`` unless it exists (another rank writing chunks of the same
    array created it, with the same bytes: both derive it from the manifest's layout).
    ``root`` (the staging directory) must exist: it is never re-created here."""
    makedirs_below(root, apath)
    try:
        fd = os.open(os.path.join(apath, "zarr.json"),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    except FileExistsError:
        return
    path = os.path.join(apath, "zarr.json")
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.EIO, "short write", path)
    except OSError as e:
        if e.filename is None and e.strerror:   # name the file (a full disk's ENOSPC does not)
            raise OSError(e.errno, e.strerror, path) from e
        raise
    finally:
        os.close(fd)


class _DirectHandle(_LazyTS):
    """A stored array read with direct chunk reads; a chunk they cannot prove intact is read
    again by the Zarr layer (``store``, ``array``), which raises the spec's error."""

    def __init__(self, layout: DirectLayout, open_ts: Any, key: str, store: FileStore,
                 array_path: str, array: ArrayLayout) -> None:
        super().__init__(open_ts)
        self.layout, self.key = layout, key
        self.store, self.array_path, self.array = store, array_path, array


class _LayerHandle:
    """A stored array read by the Zarr layer alone (bool: it refuses bytes other than 0/1,
    [SP-READ-5]; a layout the direct reader does not take)."""

    def __init__(self, store: FileStore, array_path: str, array: ArrayLayout, key: str) -> None:
        self.store, self.array_path, self.array, self.key = store, array_path, array, key


class _TSHandle:
    """A stored array read through TensorStore alone (bool, or a layout not this backend's)."""

    def __init__(self, h: Any, key: str) -> None:
        self.ts, self.key = h, key


class _KeyedRead:
    """A read in flight and the tensor it reads, so :meth:`TensorStoreBackend.wait` can name
    the key in the error."""

    def __init__(self, op: Any, key: str) -> None:
        self.op, self.key = op, key


def _not_a_checkpoint_hint(path: str) -> str:
    """What a path given for a checkpoint holds instead, for the error: another format (with
    the command converting it), a checkpoint's manifest or one of its arrays, or ``""``."""
    if os.path.basename(os.path.normpath(path)) == MANIFEST_NAME:
        return f" (the checkpoint is its directory, {os.path.dirname(path) or '.'!r})"
    if os.path.isfile(os.path.join(path, "zarr.json")):
        return " (it is one tensor's Zarr array; the checkpoint is the directory holding tensors/)"
    return path_hint(path)


class TensorStoreBackend:
    """The default :class:`shardpoint_core.storage.StorageBackend` (file kvstore, Zarr v3).

    Writes: whole chunks of the backend's own codec chains are written directly
    (:mod:`.direct_write`: ``pwritev`` from ``write_threads`` threads, byte for byte what
    TensorStore writes, each file's writeback started as soon as it is written); anything
    else goes through TensorStore with ``file_io_sync`` off. ``direct_writes=False`` writes
    everything through TensorStore. Durability: ``flush`` syncs everything a rank wrote at
    once, before the rank reports success (so the manifest still follows durable chunks,
    [SP-COMMIT-1]). ``sync_method='auto'`` (the default) uses one ``syncfs(2)`` of the file
    system where Linux has it, else ``'fsync'``: an fsync of every file and directory the rank
    wrote, from 16 threads. ``syncfs`` also flushes other dirty data of the same file system:
    on a busy shared one, prefer ``'fsync'``. ``fsync=False`` skips all syncing (tests,
    scratch data; not crash-safe).

    Measured (ext4 on a virtual disk, 2 cores shared with other jobs, cold cache, medians of 5,
    one interleaved run of ``benchmarks/bench.py --ts-writes``), sync save against the best
    raw write (one file, 16 threads of pwrite with early writeback, + fsync) and DCP at its
    best ``thread_count``: mixed state (1.2 GB, 149 tensors) 2.36 s = 1.04x raw, 0.89x DCP,
    through TensorStore's writer 2.83 s = 1.25x raw; uniform state (1.07 GB, 32 tensors)
    2.31 s = 1.10x raw, 1.08x DCP, through TensorStore's writer 3.08 s = 1.47x raw. Earlier
    (1.16 GB, 157 tensors, TensorStore writes): per-file fsync as TensorStore does by default
    1.44x a one-file write + fsync, ``syncfs`` 1.16x, parallel fsync 1.27x.
    """

    name = "tensorstore-zarr3"

    def __init__(self, *, context: Optional[dict] = None, shard_above_bytes: int = 8 << 20,
                 inner_chunk_bytes: int = 2 << 20, fsync: bool = True,
                 sync_method: str = "auto", read_threads: int = 8,
                 direct_reads: bool = True, direct_writes: bool = True,
                 write_threads: int = 16) -> None:
        if sync_method not in ("auto", "syncfs", "fsync"):
            raise ValueError(f"sync_method must be 'auto', 'syncfs' or 'fsync', not "
                             f"{sync_method!r}")
        spec = dict(context or {})
        # Chunks are written without a per-file fsync; ``flush`` makes them durable at once.
        spec.setdefault("file_io_sync", False)
        self._context_spec = spec
        self._context: Any = None
        self.shard_above_bytes = shard_above_bytes
        self.inner_chunk_bytes = inner_chunk_bytes
        self.fsync = fsync
        self.sync_method = sync_method
        self._lock = threading.Lock()
        self._written: dict = {}     # staging root -> array directories this process wrote
        self.committer = PosixCommitter(fsync=fsync)   # publishes, replaces, removes
        self.read_threads = read_threads
        self.direct_reads = direct_reads
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pool_pid = 0
        self._pool_lock = threading.Lock()
        self.direct_writes = direct_writes
        self._write_pool = WritePool(write_threads, "shardpoint-write")

    def _submit(self, fn: Any, *args: Any) -> Future:
        # A forked child inherits the pool object but not its threads: start a new one.
        if self._pool is None or self._pool_pid != os.getpid():
            with self._pool_lock:
                if self._pool is None or self._pool_pid != os.getpid():
                    self._pool = ThreadPoolExecutor(self.read_threads,
                                                    thread_name_prefix="shardpoint-read")
                    self._pool_pid = os.getpid()
        return self._pool.submit(fn, *args)

    @property
    def context(self) -> Any:
        """The ``ts.Context`` shared by this backend's TensorStore opens (made on first use)."""
        with self._lock:
            if self._context is None:
                self._context = _ts().Context(self._context_spec)
            return self._context

    def __repr__(self) -> str:
        return f"TensorStoreBackend(context={self._context_spec})"

    def supports_concurrent_writers(self) -> bool:
        return True

    # -- checkpoint directories: the committer's ------------------------------------------
    def checkpoint_state(self, path: str) -> str:
        return self.committer.state(path)

    def check_target(self, path: str, overwrite: Any) -> None:
        self.committer.check_target(path, overwrite)

    def staging_path(self, path: str, token: str) -> str:
        return self.committer.staging_for(path, token)

    def begin_save(self, staging: str) -> None:
        self.committer.create_staging(staging)

    # -- arrays ---------------------------------------------------------------------------
    def _tspec(self, root: str, array_path: str) -> dict:
        return {"driver": "zarr3",
                "kvstore": {"driver": "file", "path": os.path.join(root, array_path) + "/"}}

    def open_array_for_write(self, root: str, array_path: str, spec: ArraySpec) -> Any:
        """A handle to write whole chunks of a new array. Direct chunk writes where the codec
        chain is this backend's own (``direct_write``), TensorStore otherwise."""
        from shardpoint_core.dtypes import from_name
        itemsize = from_name(spec.dtype).itemsize
        codecs = codecs_for(spec, itemsize, self.shard_above_bytes, self.inner_chunk_bytes)
        meta = {"shape": list(spec.shape), "data_type": spec.dtype,
                "chunk_grid": {"name": "regular",
                               "configuration": {"chunk_shape": list(spec.chunk_shape)}},
                "chunk_key_encoding": {"name": "default"},
                "fill_value": fill_value(spec.dtype), "codecs": codecs}
        s = self._tspec(root, array_path)
        s.update({"metadata": meta, "create": True, "open": True,
                  "store_data_equal_to_fill_value": True})
        apath = os.path.abspath(os.path.join(root, array_path))
        with self._lock:
            self._written.setdefault(os.path.abspath(root), set()).add(apath)

        def open_ts() -> Any:
            tsm = _ts()
            try:
                return tsm.open(s, context=self.context).result()
            except ValueError as e:
                raise SaveFailedError(f"cannot create array {array_path!r} under {root}: "
                                      f"{e}") from e

        lay = write_layout(apath, spec.shape, spec.chunk_shape, codecs, itemsize) \
            if self.direct_writes else None
        if lay is None:
            return open_ts()
        stored = dict(meta, codecs=stored_codecs(codecs, itemsize))
        try:
            _create_zarr_json(root, apath, zarr_json_bytes(stored))
        except OSError as e:
            raise SaveFailedError(f"cannot create array {array_path!r} under {root}: "
                                  f"{e}") from e
        return _WriteHandle(DirectWriter(lay, self._write_pool.submit, self.fsync),
                            open_ts, FileStore(root, fsync=False), array_path,
                            ArrayLayout.from_meta(stored))

    def flush(self, root: str) -> None:
        """Make every array this process wrote under ``root`` durable: one ``syncfs`` of the
        file system where it exists (``sync_method='auto'``), else an fsync of each of those
        files and directories from a thread pool. See the class docstring for the figures."""
        with self._lock:
            dirs = sorted(self._written.pop(os.path.abspath(root), ()))
        if not self.fsync or not dirs:
            return
        try:
            if self.sync_method in ("auto", "syncfs") and syncfs(root):
                return
            fsync_trees(dirs, os.path.abspath(root))
        except OSError as e:
            raise SaveFailedError(f"cannot make the chunks under {root} durable: {e}") from e

    def write(self, handle: Any, offset: Sequence[int], data: np.ndarray) -> Any:
        if isinstance(handle, _WriteHandle):
            op = handle.writer.write(offset, data)
            if op is not None:
                return op
            return self._write_pool.submit(handle.write_part, tuple(offset), data)
        return _region(handle, offset, data.shape).write(
            data, can_reference_source_data_indefinitely=True)

    def _open_ts_for_read(self, root: str, array_path: str, spec: ArraySpec,
                          key: str) -> Any:
        s = self._tspec(root, array_path)
        # Revalidate cached metadata and data once, at open: a checkpoint replaced in place
        # (overwrite=True) must never be read through entries cached from the old one.
        s.update({"open": True, "fill_missing_data_reads": False,
                  "recheck_cached_data": "open", "recheck_cached_metadata": "open"})
        tsm = _ts()          # a missing TensorStore is a missing dependency, not corruption
        try:
            h = tsm.open(s, context=self.context).result()
        except ValueError as e:
            raise CorruptCheckpointError(f"tensor {key!r}: cannot open its array "
                                         f"{array_path!r}: {e}", spec_id="SP-ARRAY-1") from e
        meta = h.spec(retain_context=False).to_json().get("metadata", {})
        self._check_metadata(h.domain.shape, meta, spec, key, array_path)
        return h

    @staticmethod
    def _check_metadata(shape: Any, meta: dict, spec: ArraySpec, key: str,
                        array_path: str) -> None:
        problems = metadata_problems(shape, meta, spec)
        if problems:
            raise CorruptCheckpointError(f"tensor {key!r}: zarr.json of {array_path!r} "
                                         f"disagrees with the manifest: {'; '.join(problems)}",
                                         spec_id="SP-ARRAY-2")

    def open_array_for_read(self, root: str, array_path: str, spec: ArraySpec,
                            key: str) -> Any:
        """Cheap: zarr.json is parsed and checked here (file kinds, size caps, codecs, fill
        value), chunks are read directly, and what the direct reader does not take by the
        Zarr layer; a TensorStore open only with ``direct_reads=False`` (the cross-check)."""
        from shardpoint_core.dtypes import DTYPES, from_name
        meta = read_zarr_json(root, array_path, key)
        check_zarr_json(meta, tuple(spec.shape), spec.dtype, tuple(spec.chunk_shape), key)
        apath = os.path.join(root, array_path)
        if os.path.isdir(apath):
            check_array_files(root, array_path, key,
                              chunk_file_sizes(meta, from_name(spec.dtype).itemsize))
        if self.direct_reads and spec.dtype in DTYPES and sys.byteorder == "little":
            array = ArrayLayout.from_meta(meta)
            store = FileStore(root, fsync=False)
            # bool goes to the Zarr layer, which refuses bytes other than 0/1 ([SP-READ-5]).
            layout = parse_layout(meta, apath, DTYPES[spec.dtype].numpy) \
                if spec.dtype != "bool" else None
            if layout is not None:
                self._check_metadata(layout.shape, meta, spec, key, array_path)
                return _DirectHandle(layout, lambda: self._open_ts_for_read(
                    root, array_path, spec, key), key, store, array_path, array)
            return _LayerHandle(store, array_path, array, key)
        return _TSHandle(self._open_ts_for_read(root, array_path, spec, key), key)

    def prefetch(self, handle: Any, offset: Sequence[int], shape: Sequence[int]) -> None:
        """A hint, nothing read here: start reading the chunk files a later ``read_into`` of
        this box will read whole (``posix_fadvise(WILLNEED)``), so reads issued in rounds
        find them in the page cache instead of leaving the disk idle between rounds."""
        if not isinstance(handle, _DirectHandle) or not hasattr(os, "posix_fadvise"):
            return
        # fadvise can block while it queues the reads: one pool task, the caller goes on.
        self._submit(will_need, whole_chunk_files(handle.layout, offset, shape))

    def read_into(self, handle: Any, offset: Sequence[int], out: np.ndarray) -> Any:
        # A chunk the direct reader cannot prove intact is read again by the Zarr layer,
        # which raises the spec's error for it (a damaged bool chunk fails as SP-READ-3,
        # never reads as True, [SP-READ-5]).
        if isinstance(handle, _DirectHandle):
            def fallback(off: Sequence[int], view: np.ndarray) -> None:
                read_region(handle.store, handle.array_path, handle.array, off, view,
                            handle.key)
            return _KeyedRead(DirectReader(handle.layout, self._submit, fallback).read(
                tuple(offset), out), handle.key)
        if isinstance(handle, _LayerHandle):
            return _KeyedRead(self._submit(read_region, handle.store, handle.array_path,
                                           handle.array, tuple(offset), out, handle.key),
                              handle.key)
        return _KeyedRead(_ts().array(out, copy=False, write=True).write(
            _region(handle.ts, offset, out.shape)), handle.key)

    def wait(self, ops: Sequence[Any]) -> None:
        first: Optional[tuple] = None      # (error, key of the tensor read, or None)
        todo: list = [(op, None) for op in ops]
        while todo:
            op, key = todo.pop()
            if isinstance(op, _KeyedRead):
                todo.append((op.op, op.key))
                continue
            if isinstance(op, list):
                todo.extend((o, key) for o in op)
                continue
            try:
                more = op.result()
            except Exception as e:  # noqa: BLE001 - every op is waited for before raising
                first = first or (e, key)
                continue
            if isinstance(more, list):
                todo.extend((m, key) for m in more)
        if first is not None and not isinstance(first[0], ValueError):
            raise first[0]
        if first is not None:
            msg = str(first[0]).split("[tensorstore_spec")[0].strip()
            missing = "NOT_FOUND" in msg
            raise CorruptCheckpointError(
                (f"tensor {first[1]!r}: " if first[1] is not None else "")
                + f"stored data {'is missing' if missing else 'failed its checks'}: {msg}",
                spec_id="SP-READ-2" if missing else "SP-READ-3") from first[0]

    def verify_array(self, root: str, array_path: str, spec: ArraySpec, key: str) -> list:
        try:
            handle = self.open_array_for_read(root, array_path, spec, key)  # the file checks
        except ShardpointError as e:
            return [(e.spec_id or "SP-ARRAY-1", str(e))]
        if isinstance(handle, (_DirectHandle, _LayerHandle)):
            return self._verify_chunks(handle, spec, key)
        try:
            h = self._open_ts_for_read(root, array_path, spec, key)
        except ShardpointError as e:
            return [(e.spec_id or "SP-ARRAY-1", str(e))]
        problems = []
        meta = h.spec(retain_context=False).to_json().get("metadata", {})
        if meta.get("chunk_key_encoding", {}).get("name", "default") != "default":
            problems.append(("SP-ARRAY-3", f"tensor {key!r}: chunk_key_encoding is "
                             f"{meta['chunk_key_encoding']!r}, not 'default'"))
        if meta.get("fill_value") != fill_value(spec.dtype):
            problems.append(("SP-ARRAY-3", f"tensor {key!r}: fill_value "
                             f"{meta.get('fill_value')!r} is not {fill_value(spec.dtype)!r}"))
        shape = tuple(spec.shape)
        chunk = tuple(spec.chunk_shape)
        grid = [math.ceil(n / c) if c else 0 for n, c in zip(shape, chunk)]
        for idx in np.ndindex(*grid) if shape else [()]:
            off = tuple(i * c for i, c in zip(idx, chunk))
            sh = tuple(min(c, n - o) for c, n, o in zip(chunk, shape, off))
            try:
                _region(h, off, sh).read().result()
            except ValueError as e:
                msg = str(e).split("[tensorstore_spec")[0].strip()
                sid = "SP-READ-2" if "NOT_FOUND" in msg else "SP-READ-3"
                problems.append((sid, f"tensor {key!r} chunk {list(idx)}: {msg}"))
        return problems

    @staticmethod
    def _verify_chunks(handle: Any, spec: ArraySpec, key: str) -> list:
        """Every chunk read by the Zarr layer; one problem per damaged chunk."""
        problems = []
        lay = handle.array
        for idx in np.ndindex(*lay.grid()) if lay.shape else [()]:
            off = tuple(i * c for i, c in zip(idx, lay.chunk))
            sh = tuple(min(c, n - o) for c, n, o in zip(lay.chunk, lay.shape, off))
            try:
                read_region(handle.store, handle.array_path, lay, off,
                            np.empty(sh, lay.np_dtype), key)
            except CorruptCheckpointError as e:
                problems.append((e.spec_id or "SP-READ-3", f"chunk {list(idx)}: {e}"))
        return problems

    # -- manifest and commit ----------------------------------------------------------
    def write_manifest(self, root: str, data: bytes) -> None:
        self.committer.write_manifest(root, data)

    def read_manifest(self, path: str) -> bytes:
        state = self.checkpoint_state(path)
        if state == "missing":
            raise CheckpointNotFoundError(f"no checkpoint at {path!r}: the path does not exist")
        if state == "incomplete":
            other = _not_a_checkpoint_hint(path)
            if not os.path.isdir(path) or other:
                what = "a file" if not os.path.isdir(path) else "a directory"
                raise CheckpointNotFoundError(f"{path!r} is {what}, not a shardpoint "
                                              f"checkpoint{other}")
            raise IncompleteCheckpointError(
                f"{path!r} has no {MANIFEST_NAME}: the save that made it never committed "
                "(crashed or still running); it is not a checkpoint", spec_id="SP-COMMIT-3")
        mpath = os.path.join(path, MANIFEST_NAME)
        try:
            size = check_regular_file(path, MANIFEST_NAME, "<manifest>")
        except FileNotFoundError as e:
            raise IncompleteCheckpointError(f"{path!r} has no {MANIFEST_NAME}",
                                            spec_id="SP-COMMIT-3") from e
        if size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"manifest of {path!r} is {size} bytes, over the "
                                         f"{MAX_MANIFEST_BYTES}-byte cap", spec_id="SP-SEC-2")
        with open(mpath, "rb") as f:
            return f.read(MAX_MANIFEST_BYTES + 1)

    def checkpoint_identity(self, path: str) -> Optional[list]:
        """Which commit of ``path`` is there now: its manifest's inode, modification time and
        size (a commit renames a whole new directory into place, so each commit has its own
        manifest file); None when there is none. ``load`` compares it before and after its
        reads. Host-independent fields only: ranks on several hosts compare them."""
        try:
            st = os.stat(os.path.join(path, MANIFEST_NAME))
        except OSError:
            return None
        return [st.st_ino, st.st_mtime_ns, st.st_size]

    def commit(self, staging: str, path: str, *, overwrite: Any) -> None:
        self.committer.publish(staging, path, overwrite=overwrite)

    # -- leftovers of crashed saves ([SP-COMMIT-6]): the committer's ---------------------
    def list_leftovers(self, directory: str) -> list:
        return self.committer.leftovers(directory)

    def restore_leftover(self, leftover: str, path: str) -> bool:
        return self.committer.restore(leftover, path)

    def remove_leftover(self, leftover: str) -> bool:
        return self.committer.discard(leftover)

    def abort(self, staging: str) -> None:
        with self._lock:
            self._written.pop(os.path.abspath(staging), None)
        self.committer.abort(staging)
