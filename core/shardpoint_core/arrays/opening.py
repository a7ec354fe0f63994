"""Every check of an array on local files before its first read, in the spec's order: the
directory scan and zarr.json of :mod:`.checks`, then the sparse-file rule of :mod:`.sparse`."""

from __future__ import annotations

from typing import Any

from shardpoint_core.arrays.checks import (
    check_backed_bytes,
    check_chunk_places,
    check_chunk_sizes,
    checked_zarr_json,
    chunk_file_sizes,
    scan_array,
)
from shardpoint_core.arrays.sparse import check_sparse_chunks
from shardpoint_core.format.compression import MAX_RATIO, compression_of


def open_local_array(
    root: str,
    array_path: str,
    shape: tuple[int, ...],
    dtype: str,
    chunk: tuple[int, ...],
    itemsize: int,
    key: str,
) -> dict[str, Any]:
    """Every check of a local array before its first read, in the order of [SP-ERR-2]: file
    kinds and the zarr.json cap, zarr.json against the spec and the manifest entry, chunk
    file sizes, bytes present against the declared size ([SP-READ-6]), then the checksums of
    what sparse chunk files do not hold ([SP-SEC-6]). Returns the checked zarr.json (shared:
    not to be changed)."""
    return open_local_array_counted(root, array_path, shape, dtype, chunk, itemsize, key)[0]


def open_local_array_counted(
    root: str,
    array_path: str,
    shape: tuple[int, ...],
    dtype: str,
    chunk: tuple[int, ...],
    itemsize: int,
    key: str,
) -> tuple[dict[str, Any], tuple[int, int]]:
    """:func:`open_local_array`, returning ``(zarr.json, (chunk files, their bytes))``."""
    raw, entries = scan_array(root, array_path, key)
    meta = checked_zarr_json(raw, shape, dtype, chunk, key, f"{array_path}/zarr.json")
    check_chunk_places(entries, len(shape), key)
    found = check_chunk_sizes(entries, chunk_file_sizes(meta, itemsize), key)
    ratio = MAX_RATIO if compression_of(meta["codecs"]) is not None else 1  # (1.5)
    check_backed_bytes(key, array_path, shape, chunk, itemsize, found, ratio)
    check_sparse_chunks(entries, meta, itemsize, key)
    return meta, found
