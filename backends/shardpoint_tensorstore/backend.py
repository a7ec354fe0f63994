"""Checkpoints on a local or shared file system, tensors as Zarr v3 arrays via TensorStore.

Every chunk and shard index carries a crc32c codec; arrays are written with
``store_data_equal_to_fill_value`` (an all-zero chunk is still a stored chunk) and read with
``fill_missing_data_reads: false`` (a missing chunk is an error, never silent zeros). Writes
reference the caller's buffer without copying; reads land directly in the caller's buffer.
One ``ts.Context`` is shared by all arrays so I/O concurrency is pooled.
"""
from __future__ import annotations

import ctypes
import math
import os
import shutil
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Sequence

import numpy as np
import tensorstore as ts

from shardpoint.errors import (CheckpointExistsError, CheckpointNotFoundError,
                               CorruptCheckpointError, IncompleteCheckpointError,
                               SaveFailedError)
from shardpoint.storage import MANIFEST_NAME, ArraySpec

from .direct import DirectLayout, DirectReader, parse_layout, read_zarr_json

_BYTES_CRC = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
MAX_MANIFEST_BYTES = 1 << 30


def _fill_value(dtype: str) -> Any:
    if dtype == "bool":
        return False
    if dtype.startswith("complex"):
        return [0.0, 0.0]
    if dtype.startswith(("float", "bfloat")):
        return 0.0
    return 0


def _largest_divisor_at_most(n: int, limit: int) -> int:
    best = 1
    i = 1
    while i * i <= n:
        if n % i == 0:
            for d in (i, n // i):
                if d <= limit and d > best:
                    best = d
        i += 1
    return best


def inner_chunk_shape(chunk: Sequence[int], itemsize: int, target: int) -> tuple:
    """Inner chunks of a shard: divisors of ``chunk``, split from the first dimension on,
    until one inner chunk is at most ``target`` bytes (or every dimension is split to 1)."""
    inner = list(chunk)
    for d in range(len(inner)):
        rest = math.prod(inner[d + 1:]) * itemsize
        if rest * inner[d] <= target:
            break
        inner[d] = _largest_divisor_at_most(inner[d], max(1, target // max(rest, 1)))
    return tuple(inner)


def codecs_for(spec: ArraySpec, itemsize: int, shard_above: int, inner_target: int) -> list:
    """The codec chain the writer uses: bytes+crc32c, or sharding_indexed for large chunks."""
    nbytes = math.prod(spec.chunk_shape) * itemsize
    if spec.chunk_shape and nbytes > shard_above:
        inner = inner_chunk_shape(spec.chunk_shape, itemsize, inner_target)
        if inner != tuple(spec.chunk_shape):
            return [{"name": "sharding_indexed", "configuration": {
                "chunk_shape": list(inner), "codecs": _BYTES_CRC,
                "index_codecs": _BYTES_CRC, "index_location": "end"}}]
    return _BYTES_CRC


def _has_crc(codecs: list) -> bool:
    """Every chunk ends in crc32c: a chain whose last codec is crc32c, or one
    sharding_indexed codec whose inner and index chains both do ([SP-ARRAY-2])."""
    if not codecs:
        return False
    if len(codecs) == 1 and codecs[0].get("name") == "sharding_indexed":
        conf = codecs[0].get("configuration", {})
        return _has_crc(conf.get("codecs", [])) and _has_crc(conf.get("index_codecs", []))
    return codecs[-1].get("name") == "crc32c"


def _region(handle: Any, offset: Sequence[int], shape: Sequence[int]) -> Any:
    if not shape:
        return handle
    return handle[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


def _metadata_problems(shape: Any, meta: dict, spec: ArraySpec) -> list:
    """Where a zarr.json disagrees with the manifest's entry ([SP-ARRAY-2])."""
    problems = []
    if tuple(shape) != tuple(spec.shape):
        problems.append(f"shape {tuple(shape)} != manifest {tuple(spec.shape)}")
    if meta.get("data_type") != spec.dtype:
        problems.append(f"data_type {meta.get('data_type')!r} != manifest {spec.dtype!r}")
    grid = meta.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape")
    if grid is not None and tuple(grid) != tuple(spec.chunk_shape):
        problems.append(f"chunk_shape {tuple(grid)} != manifest {tuple(spec.chunk_shape)}")
    if not _has_crc(meta.get("codecs", [])):
        problems.append("codec chain has no crc32c")
    return problems


class _DirectHandle:
    """A stored array read with direct chunk reads; TensorStore is opened only if a chunk
    needs the fallback (then it raises the documented error for what is wrong)."""

    def __init__(self, layout: DirectLayout, open_ts: Any) -> None:
        self.layout = layout
        self._open_ts = open_ts
        self._ts: Any = None
        self._lock = threading.Lock()

    def tensorstore(self) -> Any:
        with self._lock:
            if self._ts is None:
                self._ts = self._open_ts()
            return self._ts


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(p: str) -> None:
    """Remove what a replacement moved aside: a directory tree, or a file."""
    if os.path.isdir(p) and not os.path.islink(p):
        shutil.rmtree(p, ignore_errors=True)
    elif os.path.lexists(p):
        os.remove(p)


def _exchange_dirs(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    return rc == 0


class TensorStoreBackend:
    """The default :class:`shardpoint.storage.StorageBackend` (file kvstore, Zarr v3)."""

    name = "tensorstore-zarr3"

    def __init__(self, *, context: Optional[dict] = None, shard_above_bytes: int = 8 << 20,
                 inner_chunk_bytes: int = 2 << 20, fsync: bool = True,
                 read_threads: int = 8, direct_reads: bool = True) -> None:
        spec = dict(context or {})
        if not fsync:
            spec.setdefault("file_io_sync", False)
        self.context = ts.Context(spec)
        self.shard_above_bytes = shard_above_bytes
        self.inner_chunk_bytes = inner_chunk_bytes
        self.fsync = fsync
        self.read_threads = read_threads
        self.direct_reads = direct_reads
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pool_pid = 0
        self._pool_lock = threading.Lock()

    def _submit(self, fn: Any, *args: Any) -> Future:
        # A forked child inherits the pool object but not its threads: start a new one.
        if self._pool is None or self._pool_pid != os.getpid():
            with self._pool_lock:
                if self._pool is None or self._pool_pid != os.getpid():
                    self._pool = ThreadPoolExecutor(self.read_threads,
                                                    thread_name_prefix="shardpoint-read")
                    self._pool_pid = os.getpid()
        return self._pool.submit(fn, *args)

    def __repr__(self) -> str:
        return f"TensorStoreBackend(context={self.context.spec.to_json()})"

    def supports_concurrent_writers(self) -> bool:
        return True

    # -- checkpoint directories ---------------------------------------------------------
    def checkpoint_state(self, path: str) -> str:
        if os.path.isfile(os.path.join(path, MANIFEST_NAME)):
            return "committed"
        return "incomplete" if os.path.exists(path) else "missing"

    def staging_path(self, path: str, token: str) -> str:
        path = os.path.abspath(path)
        parent, name = os.path.split(path.rstrip(os.sep))
        return os.path.join(parent, f".{name}.shardpoint-tmp-{token}")

    def begin_save(self, staging: str) -> None:
        parent = os.path.dirname(staging)
        os.makedirs(parent, exist_ok=True)
        os.makedirs(staging, exist_ok=False)

    # -- arrays ---------------------------------------------------------------------------
    def _tspec(self, root: str, array_path: str) -> dict:
        return {"driver": "zarr3",
                "kvstore": {"driver": "file", "path": os.path.join(root, array_path) + "/"}}

    def open_array_for_write(self, root: str, array_path: str, spec: ArraySpec) -> Any:
        from shardpoint.dtypes import from_name
        itemsize = from_name(spec.dtype).itemsize
        s = self._tspec(root, array_path)
        s.update({"metadata": {
            "shape": list(spec.shape), "data_type": spec.dtype,
            "chunk_grid": {"name": "regular",
                           "configuration": {"chunk_shape": list(spec.chunk_shape)}},
            "chunk_key_encoding": {"name": "default"},
            "fill_value": _fill_value(spec.dtype),
            "codecs": codecs_for(spec, itemsize, self.shard_above_bytes,
                                 self.inner_chunk_bytes)},
            "create": True, "open": True, "store_data_equal_to_fill_value": True})
        try:
            return ts.open(s, context=self.context).result()
        except ValueError as e:
            raise SaveFailedError(f"cannot create array {array_path!r} under {root}: {e}") from e

    def write(self, handle: Any, offset: Sequence[int], data: np.ndarray) -> Any:
        return _region(handle, offset, data.shape).write(
            data, can_reference_source_data_indefinitely=True)

    def _open_ts_for_read(self, root: str, array_path: str, spec: ArraySpec,
                          key: str) -> Any:
        s = self._tspec(root, array_path)
        # Revalidate cached metadata and data once, at open: a checkpoint replaced in place
        # (overwrite=True) must never be read through entries cached from the old one.
        s.update({"open": True, "fill_missing_data_reads": False,
                  "recheck_cached_data": "open", "recheck_cached_metadata": "open"})
        try:
            h = ts.open(s, context=self.context).result()
        except ValueError as e:
            raise CorruptCheckpointError(f"tensor {key!r}: cannot open its array "
                                         f"{array_path!r}: {e}", spec_id="SP-ARRAY-1") from e
        meta = h.spec(retain_context=False).to_json().get("metadata", {})
        self._check_metadata(h.domain.shape, meta, spec, key, array_path)
        return h

    @staticmethod
    def _check_metadata(shape: Any, meta: dict, spec: ArraySpec, key: str,
                        array_path: str) -> None:
        problems = _metadata_problems(shape, meta, spec)
        if problems:
            raise CorruptCheckpointError(f"tensor {key!r}: zarr.json of {array_path!r} "
                                         f"disagrees with the manifest: {'; '.join(problems)}",
                                         spec_id="SP-ARRAY-2")

    def open_array_for_read(self, root: str, array_path: str, spec: ArraySpec,
                            key: str) -> Any:
        """Cheap when the array is in this backend's own layout: zarr.json is parsed and
        checked here, chunks are read directly; otherwise a full TensorStore open."""
        from shardpoint.dtypes import DTYPES
        apath = os.path.join(root, array_path)
        if self.direct_reads and spec.dtype in DTYPES:
            meta = read_zarr_json(apath)
            layout = parse_layout(meta, apath, DTYPES[spec.dtype].numpy)
            if layout is not None and meta.get("data_type") in DTYPES:
                self._check_metadata(layout.shape, meta, spec, key, array_path)
                return _DirectHandle(layout, lambda: self._open_ts_for_read(
                    root, array_path, spec, key))
        return self._open_ts_for_read(root, array_path, spec, key)

    def read_into(self, handle: Any, offset: Sequence[int], out: np.ndarray) -> Any:
        if isinstance(handle, _DirectHandle):
            def fallback(off: Sequence[int], view: np.ndarray) -> None:
                h = handle.tensorstore()
                ts.array(view, copy=False, write=True).write(
                    _region(h, off, view.shape)).result()
            return DirectReader(handle.layout, self._submit, fallback).read(tuple(offset), out)
        return ts.array(out, copy=False, write=True).write(_region(handle, offset, out.shape))

    def wait(self, ops: Sequence[Any]) -> None:
        first: Optional[BaseException] = None
        todo = list(ops)
        while todo:
            op = todo.pop()
            if isinstance(op, list):
                todo.extend(op)
                continue
            try:
                more = op.result()
            except Exception as e:  # noqa: BLE001 - every op is waited for before raising
                first = first or e
                continue
            if isinstance(more, list):
                todo.extend(more)
        if first is not None and not isinstance(first, ValueError):
            raise first
        if first is not None:
            msg = str(first).split("[tensorstore_spec")[0].strip()
            missing = "NOT_FOUND" in msg
            raise CorruptCheckpointError(
                f"stored data {'is missing' if missing else 'failed its checks'}: {msg}",
                spec_id="SP-READ-2" if missing else "SP-READ-3") from first

    def verify_array(self, root: str, array_path: str, spec: ArraySpec, key: str) -> list:
        try:
            h = self._open_ts_for_read(root, array_path, spec, key)
        except CorruptCheckpointError as e:
            return [(e.spec_id or "SP-ARRAY-1", str(e))]
        problems = []
        meta = h.spec(retain_context=False).to_json().get("metadata", {})
        if meta.get("chunk_key_encoding", {}).get("name", "default") != "default":
            problems.append(("SP-ARRAY-3", f"tensor {key!r}: chunk_key_encoding is "
                             f"{meta['chunk_key_encoding']!r}, not 'default'"))
        if meta.get("fill_value") != _fill_value(spec.dtype):
            problems.append(("SP-ARRAY-3", f"tensor {key!r}: fill_value "
                             f"{meta.get('fill_value')!r} is not {_fill_value(spec.dtype)!r}"))
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

    # -- manifest and commit ----------------------------------------------------------
    def write_manifest(self, root: str, data: bytes) -> None:
        tmp = os.path.join(root, MANIFEST_NAME + ".partial")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        os.replace(tmp, os.path.join(root, MANIFEST_NAME))

    def read_manifest(self, path: str) -> bytes:
        state = self.checkpoint_state(path)
        if state == "missing":
            raise CheckpointNotFoundError(f"no checkpoint at {path!r}: the path does not exist")
        if state == "incomplete":
            if not os.path.isdir(path):
                raise CheckpointNotFoundError(f"{path!r} is a file, not a checkpoint directory")
            raise IncompleteCheckpointError(
                f"{path!r} has no {MANIFEST_NAME}: the save that made it never committed "
                "(crashed or still running); it is not a checkpoint", spec_id="SP-COMMIT-3")
        mpath = os.path.join(path, MANIFEST_NAME)
        size = os.path.getsize(mpath)
        if size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"manifest of {path!r} is {size} bytes, over the "
                                         f"{MAX_MANIFEST_BYTES}-byte cap", spec_id="SP-SEC-2")
        with open(mpath, "rb") as f:
            return f.read()

    def _fsync_tree(self, root: str) -> None:
        for dirpath, _dirs, _files in os.walk(root):
            _fsync_dir(dirpath)

    def commit(self, staging: str, path: str, *, overwrite: bool) -> None:
        path = os.path.abspath(path)
        if self.fsync:
            self._fsync_tree(staging)
        if os.path.lexists(path):
            if not overwrite and self.checkpoint_state(path) == "committed":
                raise CheckpointExistsError(f"a checkpoint already exists at {path!r}; pass "
                                            "overwrite=True to replace it")
            if not overwrite and not (os.path.isdir(path) and not os.listdir(path)):
                # Not a checkpoint, but not ours to delete either (a user's directory, a
                # file): replacing it would destroy whatever it holds.
                raise CheckpointExistsError(f"{path!r} exists and is not an empty directory or "
                                            "a checkpoint; refusing to replace it (pass "
                                            "overwrite=True, or choose another path)")
            if _exchange_dirs(staging, path):
                # One atomic step: the new checkpoint is at path, the old one at staging.
                if self.fsync:
                    _fsync_dir(os.path.dirname(path))
                _remove(staging)
                return
            # No atomic exchange here: move the old one aside first; a crash between the two
            # renames leaves it recoverable as .<name>.shardpoint-old-* ([SP-COMMIT-4]).
            old = staging.replace(".shardpoint-tmp-", ".shardpoint-old-")
            os.rename(path, old)
            os.rename(staging, path)
            if self.fsync:
                _fsync_dir(os.path.dirname(path))
            _remove(old)
            return
        os.rename(staging, path)
        if self.fsync:
            _fsync_dir(os.path.dirname(path))

    def abort(self, staging: str) -> None:
        shutil.rmtree(staging, ignore_errors=True)
