"""shardpoint checkpoints as a conversion source and sink, through the core's checkpoint
transactions.

The source reads through a :class:`~shardpoint_core.transactions.reader.CheckpointReader`; the
sink writes through a :class:`~shardpoint_core.transactions.writer.CheckpointWriter`, array by
array (chunk by chunk from one tensor at a time) into its staging location, then commits the
manifest with the store's own protocol: the converted checkpoint appears complete or not at
all.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np
import torch

from shardpoint.tree import dtypes
from shardpoint.tree import values
from shardpoint_core.commit.base import Overwrite
from shardpoint_core.format.errors import (
    CheckpointExistsError,
    ConversionError,
    InvalidKeyError,
    UnsupportedValueError,
)
from shardpoint.planning.grid import plan_chunk_grid
from shardpoint_core.format.keys import encode_key
from shardpoint_core.arrays.identity import join_tables
from shardpoint_core.format.manifest import (
    FORMAT_VERSION_1_3,
    Manifest,
    TensorEntry,
    array_path_for,
)
from shardpoint.planning.plans import PlanOptions
from shardpoint_core.commit.posix import check_not_containing
from shardpoint_core.stores.registry import is_local
from shardpoint_core.format.spec import ArraySpec
from shardpoint_core.transactions.protocol import StorageBackend
from shardpoint_core.transactions.reader import CheckpointReader
from shardpoint_core.transactions.writer import CheckpointWriter
from shardpoint.tree.views import to_numpy
from shardpoint_core.format.statetree import ValueLeaf, encode_tree, map_tree, plain_children
from shardpoint.tools.convert.base import Progress, Source, TensorInfo, key_of, nest, with_cli_flag

FORMAT = "shardpoint"


class ShardpointSource(Source):
    """Reads a committed shardpoint checkpoint; rows are read straight from the chunks."""

    def __init__(self, path: str, backend: Optional[StorageBackend] = None) -> None:
        super().__init__(str(path), FORMAT)
        # s3://...: the object-store backend; the manifest read once, with its commit's identity
        self.reader = CheckpointReader.open(self.path, backend=backend, call="convert")
        self.manifest = self.reader.manifest
        self._handles: dict = {}
        self._entries: dict = {}
        for path, leaf in _leaves(self.manifest.tree, ()):
            if leaf.kind == "tensor":
                e = leaf.entry
                t = TensorInfo(tuple(path), tuple(e.shape), dtypes.from_name(e.dtype).torch)
                self.tensors.append(t)
                self._entries[t.path] = e
            elif leaf.kind == "object":
                self.objects[tuple(path)] = list(leaf.values)
            else:
                self.values[tuple(path)] = leaf.value

    def _handle(self, t: TensorInfo) -> Any:
        if t.path not in self._handles:
            self._handles[t.path] = self.reader.array(self._entries[t.path].key)
        return self._handles[t.path]

    def read_rows(self, t: TensorInfo, start: int, stop: int) -> torch.Tensor:
        shape = (stop - start,) + tuple(t.shape[1:]) if t.shape else ()
        out = torch.empty(shape, dtype=t.dtype)
        if out.numel():
            off = (start,) + (0,) * (len(shape) - 1) if shape else ()
            self.reader.wait([self.reader.read_into(self._handle(t), off, to_numpy(out))])
        return out

    def read(self, t: TensorInfo) -> torch.Tensor:
        return self.read_rows(t, 0, t.shape[0] if t.shape else 0)

    def check_unchanged(self) -> None:
        """LoadFailedError ([SP-COMMIT-14]) where another save replaced the checkpoint since
        its manifest was read: its tensors may come from two checkpoints."""
        self.reader.check_unchanged()

    def close(self) -> None:
        self._handles.clear()


def _only_value(path: tuple, key: Optional[str], leaf: Any) -> Any:
    if leaf.kind != "value":
        raise KeyError(leaf.kind)
    return leaf.value


def _leaves(node: Any, path: tuple):
    """Leaves of the typed tree, with a list or tuple holding only values given back as one
    value leaf (as DCP and ``torch.save`` hold them)."""
    kid = plain_children(node)
    if kid is None:
        yield path, node
        return
    if path and kid[0] != "dict":
        try:
            yield path, ValueLeaf(encode_key(path), map_tree(node, _only_value, keys=False))
            return
        except KeyError:  # it holds a tensor or a sharded object
            pass
    for c, v in kid[1]:
        yield from _leaves(v, path + (c,))


class _Stored:
    """A tensor or sharded object of the source in the tree being written: its manifest
    node is ``{kind: key}``."""

    def __init__(self, kind: str) -> None:
        self.kind = kind


def _node(path: tuple, key: str, leaf: Any) -> dict:
    """The manifest node of a leaf of the tree being written (inside a value, every leaf is
    a value, as the source holds it)."""
    return {leaf.kind: key} if isinstance(leaf, _Stored) else {"value": leaf}


def shardpoint_tree(src: Source) -> tuple:
    """The manifest tree and sharded objects of ``src`` (tensors as leaves keyed by their
    path), and ``[(key, reason)]`` for the values that cannot be stored. No I/O."""
    skipped: list = []
    leaves: list = []
    for t in src.tensors:
        leaves.append((t.path, _Stored("tensor")))
    for p, v in src.values.items():
        try:
            values.check_value(v, f"value {key_of(p)!r}")
            encode_tree([v], _node)  # its dict keys, checked as save checks them
            leaves.append((p, v))
        except (UnsupportedValueError, InvalidKeyError) as e:
            skipped.append((key_of(p), str(e)))
    objects = {}
    for p, vs in src.objects.items():
        try:
            for i, v in enumerate(vs):
                values.check_value(v, f"object {key_of(p)!r}[{i}]")
        except UnsupportedValueError as e:
            skipped.append((key_of(p), str(e)))
            continue
        objects[encode_key(p)] = list(vs)
        leaves.append((p, _Stored("object")))
    if not leaves:
        raise ConversionError(f"{src.path!r} ({src.format}) holds nothing that can be stored")
    # The core's container walk, the one sp.save's flattening uses: containers inside values
    # become tree nodes exactly as a save lays them out.
    return encode_tree(nest(leaves, f"converting {src.path!r}"), _node), objects, skipped


def tensor_entry(t: TensorInfo, max_chunk_bytes: int) -> TensorEntry:
    """The manifest entry of a converted tensor: its whole shape, chunked into bands of rows
    of at most ``max_chunk_bytes`` (the same grid whichever process writes it)."""
    name = dtypes.from_torch(t.dtype, f"tensor {t.key!r}").name
    shape = tuple(t.shape)
    whole = ((0,) * len(shape), shape)
    chunk = plan_chunk_grid(
        shape, t.itemsize, [([whole], [0])], [whole], PlanOptions(max_chunk_bytes=max_chunk_bytes)
    )
    return TensorEntry(t.key, array_path_for(t.key), shape, name, tuple(chunk))


def open_entry(w: CheckpointWriter, e: TensorEntry) -> Any:
    """Create (or open, when another process created it) the array of ``e`` in the save."""
    return w.open_array(e.array, ArraySpec(e.shape, e.dtype, e.chunk_shape))


def begin_writer(
    dst: str,
    overwrite: Overwrite,
    protect: Sequence[str] = (),
    backend: Optional[StorageBackend] = None,
) -> CheckpointWriter:
    """Begin the save of the converted checkpoint at ``dst``: refuse a ``dst`` holding one
    of ``protect`` (the source: replacing it would delete it) and what the commit would
    refuse there, before anything is written; then the writer's staging location."""
    try:
        if is_local(dst):
            check_not_containing(dst, protect)
        else:  # an object-store prefix: the source is it or lies below it
            d = str(dst).rstrip("/")
            for p in protect:
                if str(p).rstrip("/") == d or str(p).startswith(d + "/"):
                    raise CheckpointExistsError(
                        f"{dst!r} holds {p!r}, the input of this command; writing there "
                        "would delete it. Choose a destination outside the input",
                        spec_id="SP-COMMIT-5",
                    )
        return CheckpointWriter.begin(dst, backend=backend, overwrite=overwrite, call="convert")
    except CheckpointExistsError as e:
        raise with_cli_flag(e) from e


def write_shardpoint(
    src: Source,
    dst: str,
    *,
    overwrite: Overwrite = False,
    backend: Optional[StorageBackend] = None,
    progress: Progress = None,
    max_chunk_bytes: int = 256 << 20,
) -> list:
    """Write ``src`` as a shardpoint checkpoint at ``dst``, one tensor in memory at a time.
    Returns ``[(key, reason)]`` for the values that could not be stored."""
    tree, objects, skipped = shardpoint_tree(src)
    with begin_writer(dst, overwrite, (src.path,), backend) as w:
        entries = {}
        for t in src.tensors:
            e = entries[t.key] = tensor_entry(t, max_chunk_bytes)
            write_rows(w, open_entry(w, e), src, t, e, 0, t.shape[0] if t.shape else 0, progress)
        crcs = w.flush()
        src.check_unchanged()  # nothing built from two checkpoints is committed
        commit_shardpoint(w, tree, entries, objects, [crcs])
    return skipped


def commit_shardpoint(
    w: CheckpointWriter, tree: dict, entries: dict, objects: dict, reports: Sequence[dict] = ()
) -> None:
    """Every array of the save is durable: the manifest last, then the commit. ``reports``:
    what each writer's :meth:`~CheckpointWriter.flush` recorded, for the chunk tables
    ([SP-MAN-7]: a tensor gets one where every chunk's crc32c was recorded; the manifest
    is then a 1.3 one, as ``sp.save`` writes it)."""
    tables = {k: join_tables(reports, e.array, e.shape, e.chunk_shape) for k, e in entries.items()}
    entries = {
        k: TensorEntry(e.key, e.array, e.shape, e.dtype, e.chunk_shape, tables[k])
        for k, e in entries.items()
    }
    m = Manifest(tree, entries, objects, save_world_size=1)
    if any(t is not None for t in tables.values()):
        m.format_version = FORMAT_VERSION_1_3  # the bytes hold a 1.3 construct
    w.commit(m)


def write_rows(
    w: CheckpointWriter,
    h: Any,
    src: Source,
    t: TensorInfo,
    e: TensorEntry,
    start: int,
    stop: int,
    progress: Progress,
) -> None:
    """Write rows ``start:stop`` of ``t`` (whole bands of chunk rows, or up to the end) into
    the array ``h``, one band of chunk rows in memory at a time (a 0-d tensor: all of it)."""
    shape, chunk = tuple(t.shape), e.chunk_shape
    if not shape:
        data = src.read(t)
        _check_read(t, data, ())
        w.wait([w.write(h, (), to_numpy(data.contiguous()))])
    elif math.prod(shape):
        grid = [math.ceil(n / c) for n, c in zip(shape[1:], chunk[1:])]
        for lo in range(start, stop, chunk[0]):
            hi = min(stop, lo + chunk[0])
            data = src.read_rows(t, lo, hi)
            _check_read(t, data, (hi - lo,) + shape[1:])
            arr = to_numpy(data.contiguous())
            ops = []
            for idx in np.ndindex(*grid):
                off = tuple(i * c for i, c in zip(idx, chunk[1:]))
                box = (slice(None),) + tuple(
                    slice(o, min(o + c, n)) for o, c, n in zip(off, chunk[1:], shape[1:])
                )
                ops.append(w.write(h, (lo,) + off, arr[box]))
            w.wait(ops)
            if progress:
                progress(data.numel() * data.element_size())
            del data, arr, ops
        return
    if progress:
        progress(t.nbytes)


def _check_read(t: TensorInfo, data: torch.Tensor, want: tuple) -> None:
    if tuple(data.shape) != tuple(want) or data.dtype != t.dtype:
        raise ConversionError(
            f"tensor {t.key!r}: the source read {data.dtype}"
            f"{list(data.shape)}, expected {t.dtype}{list(want)}"
        )


def is_shardpoint(path: str) -> bool:
    import os

    return os.path.isfile(os.path.join(path, "manifest.msgpack"))
