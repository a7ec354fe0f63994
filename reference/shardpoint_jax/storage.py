"""Files and Zarr v3 arrays through TensorStore (spec/format.md sections 3, 7, 9, 10):
create and write arrays, validate zarr.json against the manifest, read regions strictly."""
from __future__ import annotations

import json
import math
import os
from typing import Optional, Sequence

import numpy as np
import tensorstore as ts

from .dtypes import FILL
from .errors import (CheckpointNotFoundError, CorruptCheckpointError,
                     IncompleteCheckpointError, UnsupportedFormatError)
from .manifest import MAX_MANIFEST_BYTES, decode_manifest

MANIFEST = "manifest.msgpack"
CHUNK_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
ONE_BYTE = {"bool", "int8", "uint8", "float8_e4m3fn", "float8_e5m2"}
_CONTEXT = None


def context() -> ts.Context:
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
    return _CONTEXT


# -------------------------------------------------------------------------------- manifest
def read_manifest(path: str) -> dict:
    """The checked manifest body of the checkpoint at ``path`` [SP-COMMIT-3] [SP-SEC-2]."""
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"no checkpoint at {path!r}", spec_id="SP-COMMIT-3")
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        raise IncompleteCheckpointError(f"{path!r} has no {MANIFEST}: not a checkpoint (a save "
                                        "that crashed or is still running)",
                                        spec_id="SP-COMMIT-3")
    size = os.path.getsize(mpath)
    if size > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{mpath!r} is {size} bytes, over the 1 GiB limit",
                                     spec_id="SP-SEC-2")
    with open(mpath, "rb") as f:
        return decode_manifest(f.read())


# -------------------------------------------------------------------------------- arrays
def array_metadata(shape: Sequence[int], dtype: str, chunk: Sequence[int]) -> dict:
    """zarr.json metadata of a tensor: regular grid, bytes + crc32c [SP-ARRAY-2] [SP-ARRAY-3]."""
    return {"shape": list(shape), "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
            "chunk_key_encoding": {"name": "default"}, "fill_value": FILL[dtype],
            "codecs": CHUNK_CODECS}


def _spec(root: str, array: str) -> dict:
    return {"driver": "zarr3", "kvstore": {"driver": "file",
                                           "path": os.path.join(root, array) + "/"}}


def create_array(root: str, array: str, shape, dtype: str, chunk) -> None:
    """Write the array's zarr.json (no chunks yet)."""
    spec = dict(_spec(root, array), metadata=array_metadata(shape, dtype, chunk), create=True)
    ts.open(spec, context=context()).result()


def open_for_write(root: str, array: str) -> ts.TensorStore:
    spec = dict(_spec(root, array), open=True, store_data_equal_to_fill_value=True)
    return ts.open(spec, context=context()).result()   # [SP-ARRAY-4]


def write_region(store: ts.TensorStore, offset: Sequence[int], data: np.ndarray) -> None:
    """Write ``data`` at ``offset``; the region covers whole chunks (one writer each)."""
    if data.size == 0:
        return
    region = tuple(slice(o, o + n) for o, n in zip(offset, data.shape))
    store[region].write(data).result() if region else store.write(data).result()


def _codec_ok(codecs, dtype: str) -> bool:
    def plain(chain) -> bool:
        if not isinstance(chain, list) or len(chain) != 2 or chain[1] != {"name": "crc32c"}:
            return False
        b = chain[0]
        return b in ({"name": "bytes", "configuration": {"endian": "little"}},) or (
            dtype in ONE_BYTE and b in ({"name": "bytes"},
                                        {"name": "bytes", "configuration": {}}))
    if plain(codecs):
        return True
    if (isinstance(codecs, list) and len(codecs) == 1 and isinstance(codecs[0], dict)
            and codecs[0].get("name") == "sharding_indexed"):
        cfg = codecs[0].get("configuration", {})
        return (plain(cfg.get("codecs")) and plain(cfg.get("index_codecs"))
                and cfg.get("index_location", "end") == "end"
                and isinstance(cfg.get("chunk_shape"), list))
    return False


def check_zarr_json(root: str, key: str, entry: dict) -> None:
    """Compare zarr.json with the manifest entry before reading [SP-ARRAY-1..3]."""
    p = os.path.join(root, entry["array"], "zarr.json")
    try:
        with open(p, "rb") as f:
            meta = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"tensor {key!r}: {entry['array']}/zarr.json does not "
                                     f"open ({type(e).__name__})", spec_id="SP-ARRAY-1") from None
    if not isinstance(meta, dict) or meta.get("zarr_format") != 3 or \
            meta.get("node_type") != "array":
        raise CorruptCheckpointError(f"tensor {key!r}: not a Zarr v3 array",
                                     spec_id="SP-ARRAY-1")
    grid = meta.get("chunk_grid", {})
    problems = []
    if meta.get("shape") != entry["shape"]:
        problems.append(f"shape {meta.get('shape')} != manifest {entry['shape']}")
    if meta.get("data_type") != entry["dtype"]:
        problems.append(f"data_type {meta.get('data_type')!r} != manifest {entry['dtype']!r}")
    if grid.get("name") != "regular" or grid.get("configuration", {}).get(
            "chunk_shape") != entry["chunk_shape"]:
        problems.append(f"chunk_grid {grid} != regular {entry['chunk_shape']}")
    if problems:
        raise CorruptCheckpointError(f"tensor {key!r}: zarr.json disagrees with the manifest: "
                                     + "; ".join(problems), spec_id="SP-ARRAY-2")
    if not _codec_ok(meta.get("codecs"), entry["dtype"]):
        names = [c.get("name") for c in meta.get("codecs", []) if isinstance(c, dict)]
        if all(n in ("bytes", "crc32c", "sharding_indexed") for n in names):
            raise CorruptCheckpointError(f"tensor {key!r}: codec chain {meta.get('codecs')} "
                                         "lacks crc32c last", spec_id="SP-ARRAY-2")
        raise UnsupportedFormatError(f"tensor {key!r}: codecs {names} are not all defined by "
                                     "format 1.x", spec_id="SP-ARRAY-1")
    cke = meta.get("chunk_key_encoding", {})
    if cke.get("name") != "default" or cke.get("configuration", {}).get("separator", "/") != "/":
        raise CorruptCheckpointError(f"tensor {key!r}: chunk_key_encoding {cke}",
                                     spec_id="SP-ARRAY-3")
    if meta.get("fill_value") != FILL[entry["dtype"]]:
        raise CorruptCheckpointError(f"tensor {key!r}: fill_value {meta.get('fill_value')!r}",
                                     spec_id="SP-ARRAY-3")


def open_for_read(root: str, key: str, entry: dict) -> ts.TensorStore:
    """Open strictly: missing chunks are errors, never fill values [SP-READ-2]."""
    check_zarr_json(root, key, entry)
    spec = dict(_spec(root, entry["array"]), open=True, fill_missing_data_reads=False,
                recheck_cached_metadata=True, recheck_cached_data=True)
    try:
        return ts.open(spec, context=context()).result()
    except Exception as e:  # noqa: BLE001 - TensorStore's errors are ValueErrors with text
        raise CorruptCheckpointError(f"tensor {key!r}: array does not open: {e}",
                                     spec_id="SP-ARRAY-1") from None


def read_region(store: ts.TensorStore, key: str, offset: Sequence[int],
                shape: Sequence[int], out: Optional[np.ndarray] = None) -> np.ndarray:
    """The stored elements of a region, crc32c checked [SP-READ-1..3]."""
    if any(o < 0 or o + n > d for o, n, d in zip(offset, shape, store.shape)) or \
            len(offset) != store.rank:
        raise CorruptCheckpointError(f"tensor {key!r}: region {list(offset)}+{list(shape)} is "
                                     f"outside {list(store.shape)}", spec_id="SP-SEC-2")
    if math.prod(shape) == 0:
        return np.empty(tuple(shape), store.dtype.numpy_dtype) if out is None else out
    region = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    view = store[region].translate_to[(0,) * len(region)] if region else store
    if out is None:
        out = np.empty(tuple(shape), store.dtype.numpy_dtype)
    try:
        ts.array(out, copy=False, write=True).write(view).result()   # straight into out
        return out
    except Exception as e:  # noqa: BLE001
        text = str(e)
        missing = "NOT_FOUND" in text or "missing" in text.lower() or "not found" in text
        raise CorruptCheckpointError(
            f"tensor {key!r}: stored data of region {list(offset)}+{list(shape)} "
            f"{'is missing' if missing else 'is damaged'}: {text[:300]}",
            spec_id="SP-READ-2" if missing else "SP-READ-3") from None


# -------------------------------------------------------------------------------- durability
def fsync_tree(root: str) -> None:
    """fsync every file and directory under ``root`` (TensorStore syncs files; we sync again
    to be independent of its settings) [SP-COMMIT-1]."""
    for d, _dirs, files in os.walk(root, topdown=False):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(d)


def fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
