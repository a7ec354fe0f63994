"""The handles :class:`~shardpoint_core.transactions.backend.ZarrBackend` gives out for an
array and for a read in flight, and what is done with each kind: open an array on local files
for writing or reading (direct ``pwritev``/``preadv``, the Zarr layer or the TensorStore
cross-check), start a read, wait for reads (naming the tensor in an error), verify one.

Kept apart from the backend, which holds the state, pools and committer of a save or load,
so that this module holds the per-handle choices (which writer or reader, pool, fallback).
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import replace
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from shardpoint_core.arrays import local
from shardpoint_core.arrays.array import ArrayLayout, read_chunk, read_region, write_region
from shardpoint_core.arrays.checks import check_metadata, check_shard_files, read_zarr_json
from shardpoint_core.arrays.direct_read import DirectReader, parse_layout
from shardpoint_core.arrays.direct_write import DirectWriter, stored_codecs, write_layout
from shardpoint_core.arrays.direct_write import zarr_json_bytes
from shardpoint_core.arrays.object_read import ObjectArray
from shardpoint_core.arrays.opening import open_local_array
from shardpoint_core.arrays.packed_base import verify_hashes
from shardpoint_core.arrays.packed_read import PackedView, verify_packed
from shardpoint_core.arrays.ts_check import LazyTS, TensorStoreCheck, TSHandle
from shardpoint_core.format.errors import CorruptCheckpointError, SaveFailedError, ShardpointError
from shardpoint_core.format.layout import codecs_for, fill_value
from shardpoint_core.format.spec import ArraySpec
from shardpoint_core.stores.files import FileStore
from shardpoint_core.stores.registry import is_local

__all__ = [
    "_Array",
    "_DirectHandle",
    "_KeyedRead",
    "_WriteHandle",
    "array_metas",
    "open_local_for_read",
    "open_local_for_write",
    "start_read",
    "verify_array",
    "wait_reads",
]


class _Array:
    """An array the Zarr layer reads or writes: its store, key below the store's root,
    layout, and the tensor's key (for errors). ``root``: the save it is written in, while
    its zarr.json is still to be written by this process."""

    __slots__ = ("store", "path", "layout", "key", "root", "sink")

    def __init__(
        self,
        store: Any,
        path: str,
        layout: ArrayLayout,
        key: str,
        root: Optional[str] = None,
        sink: Any = None,
    ) -> None:
        self.store, self.path, self.layout, self.key = store, path, layout, key
        self.root, self.sink = root, sink


class _WriteHandle(LazyTS):
    """An array on local files written by direct whole-chunk writes; a write of anything but
    one whole chunk goes through the Zarr layer (``arr``), one at a time per array: two parts
    of one chunk written at once must not lose each other's bytes."""

    def __init__(self, writer: DirectWriter, open_ts: Any, arr: _Array) -> None:
        super().__init__(open_ts)
        self.writer, self.arr = writer, arr
        self.partial = threading.Lock()

    def write_part(self, offset: tuple[int, ...], data: np.ndarray) -> None:
        with self.partial:
            write_region(
                self.arr.store, self.arr.path, self.arr.layout, offset, data, sink=self.arr.sink
            )


class _DirectHandle(LazyTS):
    """An array on local files read by direct chunk reads; a chunk they cannot prove intact
    is read again by the Zarr layer (``arr``), which raises the spec's error."""

    def __init__(self, layout: Any, open_ts: Any, arr: _Array) -> None:
        super().__init__(open_ts)
        self.layout, self.arr, self.key = layout, arr, arr.key


class _KeyedRead:
    """A read in flight and the tensor it reads, so :meth:`ZarrBackend.wait` names the key."""

    def __init__(self, op: Any, key: Optional[str]) -> None:
        self.op, self.key = op, key


def array_metas(
    spec: ArraySpec, shard_above_bytes: int, inner_chunk_bytes: int
) -> Tuple[dict[str, Any], dict[str, Any], list[Any], int]:
    """(zarr.json the backend writes for ``spec`` as TensorStore takes it, the same as
    stored, the codec chain, the itemsize)."""
    from shardpoint_core.format.dtypes import from_name

    itemsize = from_name(spec.dtype).itemsize
    codecs = codecs_for(spec, itemsize, shard_above_bytes, inner_chunk_bytes)
    meta = {
        "shape": list(spec.shape),
        "data_type": spec.dtype,
        "chunk_grid": {
            "name": "regular",
            "configuration": {"chunk_shape": list(spec.chunk_shape)},
        },
        "chunk_key_encoding": {"name": "default"},
        "fill_value": fill_value(spec.dtype),
        "codecs": codecs,
    }
    return meta, dict(meta, codecs=stored_codecs(codecs, itemsize)), codecs, itemsize


def open_local_for_write(
    root: str,
    array_path: str,
    spec: ArraySpec,
    path: str,
    apath: str,
    metas: Tuple[dict[str, Any], dict[str, Any], list[Any], int],
    lay: ArrayLayout,
    sink: Any,
    ts: TensorStoreCheck,
    direct_writes: bool,
    fsync: bool,
    submit: Any,
) -> Any:
    """The write handle of a new array on local files (``path``: its key below ``root``,
    ``apath``: its directory, ``metas``: :func:`array_metas`): its zarr.json created unless
    another writer did, then direct whole-chunk writes on ``submit``'s pool, or the Zarr
    layer (compressed chunks), or the TensorStore cross-check (``ts``)."""
    meta, stored, codecs, itemsize = metas

    def open_ts() -> Any:
        return ts.open_for_write(root, array_path, meta)

    wlay = (
        write_layout(apath, spec.shape, spec.chunk_shape, codecs, itemsize)
        if direct_writes
        else None
    )
    if wlay is None and (lay.zstd_level is None or not direct_writes):
        return open_ts()
    try:
        local.create_zarr_json(root, apath, zarr_json_bytes(stored))
    except OSError as e:
        raise SaveFailedError(f"cannot create array {array_path!r} under {root}: {e}") from e
    if wlay is None:  # (1.5) compressed chunks: encoded by the Zarr layer, made durable by flush
        return _Array(FileStore(root, fsync=False), path, lay, array_path, sink=sink)
    return _WriteHandle(
        DirectWriter(wlay, submit, fsync, sink),
        open_ts,
        _Array(FileStore(root, fsync=False), path, lay, array_path, sink=sink),
    )


def open_local_for_read(
    store: Any,
    root: str,
    array_path: str,
    path: str,
    spec: ArraySpec,
    key: str,
    direct_reads: bool,
    ts: TensorStoreCheck,
) -> Any:
    """The read handle of an array on local files (``path``: its key in ``store``): its
    zarr.json and directory checked in one pass ([SP-READ-6]), then direct chunk reads where
    they apply, else the Zarr layer (bool) or the TensorStore cross-check (``ts``)."""
    from shardpoint_core.format.dtypes import DTYPES, from_name

    meta = open_local_array(
        root,
        array_path,
        tuple(spec.shape),
        spec.dtype,
        tuple(spec.chunk_shape),
        from_name(spec.dtype).itemsize,
        key,
    )
    if not (direct_reads and spec.dtype in DTYPES and sys.byteorder == "little"):
        return TSHandle(ts.open_for_read(root, array_path, spec, key), key)
    apath = os.path.join(root, array_path)
    lay = ArrayLayout.from_meta(meta).with_table(spec.chunk_crc32c, key, array_path)
    arr = _Array(store, path, lay, key)
    # bool goes to the Zarr layer, which refuses bytes other than 0/1 ([SP-READ-5]).
    dlay = parse_layout(meta, apath, DTYPES[spec.dtype].numpy) if spec.dtype != "bool" else None
    if dlay is None:
        return arr
    dlay = replace(dlay, crcs=lay.crcs)  # the chunk table too ([SP-READ-8])
    check_metadata(dlay.shape, meta, spec, key, array_path)
    return _DirectHandle(dlay, lambda: ts.open_for_read(root, array_path, spec, key), arr)


def start_read(
    handle: Any,
    offset: Sequence[int],
    out: np.ndarray,
    reads: Any,
    remote: Any,
    meta_reads: Any,
    packed_reads: Any,
    ts: TensorStoreCheck,
) -> Any:
    """Start reading the box at ``offset`` of ``handle`` into ``out``: ``reads`` (local
    files) or ``remote`` (object stores) is the pool it runs on, ``meta_reads`` the one of
    zarr.json reads, ``packed_reads`` gathers packed reads until a wait plans them."""
    if isinstance(handle, _DirectHandle):
        arr = handle.arr

        def fallback(off: Sequence[int], view: np.ndarray) -> None:
            # A chunk the direct reader cannot prove intact: the layer raises the spec's
            # error for it (a damaged bool chunk fails as SP-READ-3, [SP-READ-5]).
            read_region(arr.store, arr.path, arr.layout, off, view, arr.key)

        return _KeyedRead(
            DirectReader(handle.layout, reads.submit, fallback, arr.key).read(tuple(offset), out),
            arr.key,
        )
    if isinstance(handle, ObjectArray):
        return _KeyedRead(
            remote.submit(handle.read, tuple(offset), out, meta_reads.submit, remote.submit),
            handle.key,
        )
    if isinstance(handle, _Array):
        pool = reads if handle.store.capabilities.local_path else remote
        if isinstance(handle.store, PackedView):  # (1.4) packed: planned at wait()
            return _KeyedRead(packed_reads.add(handle.store, tuple(offset), out, pool), handle.key)
        return _KeyedRead(
            pool.submit(
                read_region,
                handle.store,
                handle.path,
                handle.layout,
                tuple(offset),
                out,
                handle.key,
            ),
            handle.key,
        )
    return _KeyedRead(ts.read_into(handle, offset, out), handle.key)


def wait_reads(ops: Sequence[Any]) -> None:
    """Wait for every op (each finishes before an error is raised); the first error is
    raised, a TensorStore one as the spec's error naming the tensor."""
    first: Optional[tuple[Any, ...]] = None  # (error, key of the tensor read, or None)
    todo: List[tuple[Any, ...]] = [(op, None) for op in ops]
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
    if first is None:
        return
    if not isinstance(first[0], ValueError):
        raise first[0]
    msg = str(first[0]).split("[tensorstore_spec")[0].strip()
    missing = "NOT_FOUND" in msg
    raise CorruptCheckpointError(
        (f"tensor {first[1]!r}: " if first[1] is not None else "")
        + f"stored data {'is missing' if missing else 'failed its checks'}: {msg}",
        spec_id="SP-READ-2" if missing else "SP-READ-3",
    ) from first[0]


def verify_array(
    open_array: Any, ts: TensorStoreCheck, root: str, array_path: str, spec: ArraySpec, key: str
) -> list[Any]:
    """Every chunk read and checked; one ``(spec ID, message)`` per problem. ``open_array``:
    the backend's ``open_array_for_read``, ``ts``: its TensorStore cross-check."""
    if spec.packed is not None:  # (1.4) a packed checkpoint
        try:
            view = open_array(root, array_path, spec, key).store
            return verify_packed(view) + verify_hashes(view)
        except ShardpointError as e:
            return [(e.spec_id or "SP-READ-3", str(e))]
    try:
        handle = open_array(root, array_path, spec, key)
        if is_local(root):
            check_shard_files(root, array_path, read_zarr_json(root, array_path, key), key)
        else:
            _ = handle.layout  # zarr.json read and checked now
    except ShardpointError as e:
        return [(e.spec_id or "SP-ARRAY-1", str(e))]
    if isinstance(handle, TSHandle):
        return ts.verify(root, array_path, spec, key)
    arr = handle.arr if isinstance(handle, _DirectHandle) else handle
    problems = []
    lay = arr.layout
    for cidx in np.ndindex(*lay.grid()) if lay.shape else [()]:
        try:
            read_chunk(arr.store, arr.path, lay, cidx, key)
        except CorruptCheckpointError as e:
            problems.append((e.spec_id or "SP-READ-3", f"chunk {list(cidx)}: {e}"))
    return problems
