"""shardpoint checkpoints as a conversion source and sink.

The sink writes through the storage backend array by array (chunk by chunk from one tensor
at a time) into a staging location, then writes the manifest and commits with the backend's
own protocol: the converted checkpoint appears complete or not at all.
"""
from __future__ import annotations

import math
import secrets
from typing import Any, Optional

import numpy as np
import torch

from .. import dtypes, values
from ..errors import ConversionError, UnsupportedValueError
from ..grid import plan_chunk_grid
from ..keys import encode_key
from ..metadata import Manifest, TensorEntry, array_path_for, decode_manifest, encode_manifest
from ..model import iter_tree_leaves
from ..plans import PlanOptions
from ..storage import ArraySpec, StorageBackend, get_backend
from ..views import to_numpy
from .base import Progress, Source, TensorInfo, key_of, nest

FORMAT = "shardpoint"


class ShardpointSource(Source):
    """Reads a committed shardpoint checkpoint; rows are read straight from the chunks."""

    def __init__(self, path: str, backend: Optional[StorageBackend] = None) -> None:
        super().__init__(str(path), FORMAT)
        self.backend = get_backend(backend)
        self.manifest = decode_manifest(self.backend.read_manifest(self.path))
        self._handles: dict = {}
        self._entries: dict = {}
        for path, node in iter_tree_leaves(self.manifest.tree):
            if "tensor" in node:
                e = self.manifest.tensors[node["tensor"]]
                t = TensorInfo(tuple(path), tuple(e.shape), dtypes.from_name(e.dtype).torch)
                self.tensors.append(t)
                self._entries[t.path] = e
            elif "object" in node:
                self.objects[tuple(path)] = list(self.manifest.objects[node["object"]])
            else:
                self.values[tuple(path)] = node.get("value")

    def _handle(self, t: TensorInfo) -> Any:
        if t.path not in self._handles:
            e = self._entries[t.path]
            self._handles[t.path] = self.backend.open_array_for_read(self.path, e.array,
                                                                     e.spec, e.key)
        return self._handles[t.path]

    def read_rows(self, t: TensorInfo, start: int, stop: int) -> torch.Tensor:
        shape = (stop - start,) + tuple(t.shape[1:]) if t.shape else ()
        out = torch.empty(shape, dtype=t.dtype)
        if out.numel():
            off = (start,) + (0,) * (len(shape) - 1) if shape else ()
            self.backend.wait([self.backend.read_into(self._handle(t), off, to_numpy(out))])
        return out

    def read(self, t: TensorInfo) -> torch.Tensor:
        return self.read_rows(t, 0, t.shape[0] if t.shape else 0)

    def close(self) -> None:
        self._handles.clear()


class _Leaf:
    def __init__(self, node: dict) -> None:
        self.node = node


def _tree_of(nested: dict) -> dict:
    """The manifest tree (``{"dict": [[k, node], ...]}``) of nested dicts of leaves."""
    return {"dict": [[k, v.node if isinstance(v, _Leaf) else _tree_of(v)]
                     for k, v in nested.items()]}


def write_shardpoint(src: Source, dst: str, *, overwrite: bool = False,
                     backend: Optional[StorageBackend] = None, progress: Progress = None,
                     max_chunk_bytes: int = 256 << 20) -> list:
    """Write ``src`` as a shardpoint checkpoint at ``dst``, one tensor in memory at a time.
    Returns ``[(key, reason)]`` for the values that could not be stored."""
    be = get_backend(backend)
    skipped: list = []
    leaves: list = []
    for t in src.tensors:
        leaves.append((t.path, _Leaf({"tensor": encode_key(t.path)})))
    for p, v in src.values.items():
        try:
            values.check_value(v, f"value {key_of(p)!r}")
        except UnsupportedValueError as e:
            skipped.append((key_of(p), str(e)))
            continue
        leaves.append((p, _Leaf({"value": v})))
    objects = {}
    for p, vs in src.objects.items():
        try:
            for i, v in enumerate(vs):
                values.check_value(v, f"object {key_of(p)!r}[{i}]")
        except UnsupportedValueError as e:
            skipped.append((key_of(p), str(e)))
            continue
        objects[encode_key(p)] = list(vs)
        leaves.append((p, _Leaf({"object": encode_key(p)})))
    if not leaves:
        raise ConversionError(f"{src.path!r} ({src.format}) holds nothing that can be stored")
    tree = _tree_of(nest(leaves, f"converting {src.path!r}"))
    staging = be.staging_path(dst, secrets.token_hex(6))
    be.begin_save(staging)
    try:
        entries = {}
        for t in src.tensors:
            entries[t.key] = _write_tensor(be, staging, src, t, max_chunk_bytes, progress)
        m = Manifest(tree, entries, objects, save_world_size=1)
        be.write_manifest(staging, encode_manifest(m))
        be.commit(staging, dst, overwrite=overwrite)
    except BaseException:
        be.abort(staging)
        raise
    return skipped


def _write_tensor(be: StorageBackend, staging: str, src: Source, t: TensorInfo,
                  max_chunk_bytes: int, progress: Progress) -> TensorEntry:
    name = dtypes.from_torch(t.dtype, f"tensor {t.key!r}").name
    shape = tuple(t.shape)
    whole = ((0,) * len(shape), shape)
    chunk = plan_chunk_grid(shape, t.itemsize, [([whole], [0])], [whole],
                            PlanOptions(max_chunk_bytes=max_chunk_bytes))
    key = t.key
    entry = TensorEntry(key, array_path_for(key), shape, name, tuple(chunk))
    h = be.open_array_for_write(staging, entry.array, ArraySpec(shape, name, tuple(chunk)))
    data = src.read(t)
    if tuple(data.shape) != shape or data.dtype != t.dtype:
        raise ConversionError(f"tensor {key!r}: the source read {data.dtype}{list(data.shape)}"
                              f", its metadata says {t.dtype}{list(shape)}")
    arr = to_numpy(data.contiguous())
    if not shape:
        be.wait([be.write(h, (), arr)])
    elif arr.size:
        grid = [math.ceil(n / c) for n, c in zip(shape, chunk)]
        ops = []
        for idx in np.ndindex(*grid):
            off = tuple(i * c for i, c in zip(idx, chunk))
            box = tuple(slice(o, min(o + c, n)) for o, c, n in zip(off, chunk, shape))
            ops.append(be.write(h, off, arr[box]))
        be.wait(ops)
    if progress:
        progress(t.nbytes)
    return entry


def is_shardpoint(path: str) -> bool:
    import os
    return os.path.isfile(os.path.join(path, "manifest.msgpack"))

