"""load(): read a checkpoint into a pytree (spec/format.md sections 10, 11). Each process
reads only the regions its addressable devices need, from any saved layout, straight into
the shard buffers, from a local directory or any registered store (``s3://``, ``memory://``),
through the core's :class:`~shardpoint_core.transactions.reader.CheckpointReader`
(:mod:`.storage`); a checkpoint replaced while it was read is an error, never a mix of two
[SP-COMMIT-14]."""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import numpy as np

from shardpoint_core.format.errors import LayoutMismatchError
from shardpoint_core.format.manifest import Manifest
from shardpoint_core.format.statetree import TensorLeaf, iter_leaves, materialize
from shardpoint_jax.dtypes import numpy_dtype, numpy_of
from shardpoint_jax.storage import (
    PendingRead,
    StoredArray,
    checkpoint_path,
    manifest_of,
    open_reader,
    start_listing,
)
from shardpoint_jax.tree import ShardedObject, walk

# Bytes of reads started ahead of the one being handed to JAX: enough to keep the I/O
# threads and the disk busy, bounded so a load never holds much more than its result.
READ_AHEAD_BYTES = 256 << 20


class Checkpoint:
    """A checked manifest (the core's :class:`~shardpoint_core.format.manifest.Manifest`) and lazily
    opened arrays of one checkpoint (a directory, or a prefix on an object store)."""

    def __init__(self, path: str) -> None:
        self.path = checkpoint_path(path, "load(path, target)")
        self.reader = open_reader(self.path)
        self.manifest: Manifest = manifest_of(self.reader)
        # The layout known, only what it needs: the per-array layout's listing ([SP-READ-6]
        # on object stores) starts now; a packed checkpoint's index is in the manifest and
        # its data objects are checked when its arrays are opened ([SP-PACK-7]): no LIST.
        self.listing = (
            start_listing(self.path)
            if self.manifest.packed is None and self.manifest.tensors
            else None
        )
        # key -> TensorLeaf / ObjectLeaf / ValueLeaf of the typed tree
        self.leaves: dict = {leaf.key: leaf for _p, leaf in iter_leaves(self.manifest.tree)}
        self._stores: dict = {}
        self.ahead: Optional[ReadAhead] = None

    def array(self, key: str) -> StoredArray:
        if key not in self._stores:
            self._stores[key] = StoredArray(self.reader, key, self.listing)
        return self._stores[key]

    def read(self, key: str, offset, shape, out=None) -> np.ndarray:
        """Elements ``offset``..``offset + shape`` of tensor ``key`` (only the chunks they
        touch are read): a read started ahead if there is one, else read now."""
        pending = self.ahead.take(key, offset, shape, out) if self.ahead else None
        if pending is not None:
            return pending.result()
        return self.array(key).read(offset, shape, out)

    def object_values(self, key: str) -> list:
        """Every value of sharded object ``key``, in row-major order of its grid."""
        return list(self.manifest.objects[key])

    # ---------------------------------------------------------------- whole tree
    def whole(self, node: Any) -> Any:
        """The typed tree ``node`` (``manifest.tree`` or part of it) with its leaves read."""
        return materialize(node, self._whole_tensor)

    def _whole_tensor(self, node: TensorLeaf) -> Any:
        t = node.entry
        data = self.read(t.key, [0] * len(t.shape), t.shape)
        if node.origin == "numpy" or not exact_in_jax(data.dtype):
            return data  # 64-bit dtypes without jax_enable_x64 stay numpy: never narrowed
        return jax.device_put(data)


class ReadAhead:
    """The regions a load will ask for, in order, read ahead of their use a window of bytes
    at a time, so the disk works on the next regions while one is handed to JAX (one read
    after another left the disk idle in between)."""

    def __init__(self, ck: Checkpoint, regions: list, window: int) -> None:
        self.ck, self.regions, self.window = ck, regions, window
        # Every array opened before any data read (on files it would wait behind them; on an
        # object store an open sends nothing: zarr.json goes with the array's first read).
        keys = list(dict.fromkeys(r[0] for r in regions))
        ck.reader.will_open(keys)  # packed on object stores: every data object's check at once
        for key in keys:
            try:
                ck.array(key)
            except Exception:  # noqa: BLE001 - raised again where that array is read
                pass
        self.pos: dict = {}
        for i, (key, off, shp, _out) in enumerate(regions):
            self.pos.setdefault((key, tuple(off), tuple(shp)), i)
        self.started: dict = {}
        self.next = self.inflight = 0

    def take(self, key: str, offset, shape, out) -> Optional[PendingRead]:
        """The read of this region if it was planned (started now at the latest) into the
        same buffer; None otherwise."""
        k = (key, tuple(offset), tuple(shape))
        i = self.pos.get(k)
        if i is None or self.regions[i][3] is not out:
            return None
        self._start(i)
        del self.pos[k]
        pending = self.started.pop(k, None)
        if pending is not None:
            self.inflight -= pending.nbytes
        return pending

    def _start(self, upto: int) -> None:
        while self.next < len(self.regions) and (self.next <= upto or self.inflight < self.window):
            key, off, shp, out = self.regions[self.next]
            self.next += 1
            k = (key, tuple(off), tuple(shp))
            if k in self.started or k not in self.pos:
                continue
            try:
                pending = self.ck.array(key).start_read(off, shp, out)
            except Exception:  # noqa: BLE001 - the read itself raises it, in its turn
                continue
            self.started[k] = pending
            self.inflight += pending.nbytes
        self.ck.reader.start_reads()  # the reads started ahead run while JAX takes this one

    def drain(self) -> None:
        """Wait for every started read (a load that failed must not leave reads filling
        buffers); their errors were or would be raised by the reads themselves."""
        for pending in self.started.values():
            try:
                pending.result()
            except Exception:  # noqa: BLE001
                pass
        self.started = {}


def region_of(index: Optional[tuple], shape) -> tuple:
    """``(offset, shape)`` of a shard's index (a tuple of slices) in an array of ``shape``."""
    assert index is not None  # JAX's index maps give each addressable device one
    off = [s.start or 0 for s in index]
    return off, [(n if s.stop is None else s.stop) - o for s, o, n in zip(index, off, shape)]


def planned_regions(ck: Checkpoint, target: Any) -> list:
    """``(key, offset, shape, out)`` of every region ``load`` will read for ``target`` (the
    whole tree when None), in the order it will ask; leaves it will refuse are left out."""
    regions: list = []
    tensors = ck.manifest.tensors
    if target is None:
        for key, node in ck.leaves.items():
            if isinstance(node, TensorLeaf):
                regions.append((key, [0] * len(tensors[key].shape), list(tensors[key].shape), None))
        return regions

    def visit(_path: tuple, key: str, leaf: Any) -> Any:
        t = tensors.get(key)
        if (
            t is None
            or not isinstance(ck.leaves.get(key), TensorLeaf)
            or not isinstance(leaf, (jax.ShapeDtypeStruct, jax.Array, np.ndarray))
        ):
            return leaf
        try:
            dtype = numpy_of(t.dtype, key)
            if tuple(leaf.shape) != t.shape or numpy_dtype(leaf.dtype, key) != dtype:
                return leaf
        except Exception:  # noqa: BLE001 - load_array raises it
            return leaf
        if isinstance(leaf, np.ndarray):
            into = leaf if leaf.flags.c_contiguous and leaf.flags.writeable else None
            regions.append((key, [0] * leaf.ndim, list(leaf.shape), into))
            return leaf
        if not exact_in_jax(dtype):
            return leaf
        for index in _indices(leaf, t.shape):
            regions.append((key, *region_of(index, t.shape), None))
        return leaf

    walk(target, visit)
    return regions


def _indices(leaf: Any, shape) -> list:
    """The distinct shard indices of ``leaf``'s sharding on this process's devices."""
    sharding = getattr(leaf, "sharding", None) or jax.sharding.SingleDeviceSharding(
        jax.local_devices()[0]
    )
    seen: dict = {}
    for index in sharding.addressable_devices_indices_map(tuple(shape)).values():
        off, shp = region_of(index, shape)
        seen.setdefault((tuple(off), tuple(shp)), index)
    return list(seen.values())


def exact_in_jax(dtype) -> bool:
    """Whether JAX keeps ``dtype`` as is (64-bit types need ``jax_enable_x64``)."""
    return jax.dtypes.canonicalize_dtype(dtype) == np.dtype(dtype)


def load(
    path: str,
    target: Any = None,
    *,
    strict: bool = True,
    leaf_hook: Optional[Callable[[Any, str, Any], Any]] = None,
) -> Any:
    """Load the checkpoint at ``path``. Without ``target``: the whole tree (jax.Arrays on the
    default device, numpy arrays where numpy saved them, values, objects as lists of all their
    values). With ``target``: a pytree whose leaves say what to read and where: a
    ``jax.ShapeDtypeStruct`` (with ``sharding=``) or a jax.Array gives a new jax.Array with that
    sharding, a numpy array is filled in place, a ``ShardedObject(None, index, shape)`` gets its
    cell's value, any other leaf is a placeholder for a value. Keys the target does not name are
    not read. With ``strict=False`` keys the checkpoint lacks keep the target's leaf.
    ``leaf_hook(checkpoint, key, leaf)``: for front ends on this one (the Orbax handler), a
    leaf's result, or ``NotImplemented`` for the standard read."""
    ck = Checkpoint(path)
    try:
        return _load(ck, target, strict, leaf_hook)
    finally:
        # the backend drops what it kept for this load (a packed checkpoint's checked data
        # objects): the next load checks them again [SP-PACK-7], as the torch load does
        ck.reader.close()


def _load(ck: Checkpoint, target: Any, strict: bool, leaf_hook: Optional[Callable]) -> Any:
    ck.ahead = ReadAhead(ck, planned_regions(ck, target), READ_AHEAD_BYTES)
    try:
        if target is None:
            out = ck.whole(ck.manifest.tree)
        elif leaf_hook is None:
            out = walk(target, lambda p, key, leaf: load_leaf(ck, key, leaf, strict))
        else:

            def hooked(_p: tuple, key: str, leaf: Any) -> Any:
                got = leaf_hook(ck, key, leaf)
                return load_leaf(ck, key, leaf, strict) if got is NotImplemented else got

            out = walk(target, hooked)
    finally:
        ck.ahead.drain()
    ck.reader.check_unchanged()  # every read done: nothing of another save mixed in
    return out


def load_leaf(ck: Checkpoint, key: str, leaf: Any, strict: bool) -> Any:
    node = ck.leaves.get(key)
    if node is None:
        if strict:
            raise LayoutMismatchError(
                f"{key!r} is not in the checkpoint; load with strict=False to skip it",
                spec_id="SP-LOAD-1",
            )
        return leaf
    kind = node.kind
    if isinstance(leaf, (jax.ShapeDtypeStruct, jax.Array, np.ndarray)):
        _expect(kind, "tensor", key)
        return load_array(ck, key, leaf)
    if isinstance(leaf, ShardedObject):
        _expect(kind, "object", key)
        grid = ck.manifest.objects[key].shape
        if grid != leaf.grid:
            raise LayoutMismatchError(
                f"sharded object {key!r}: asked for grid {leaf.grid}, "
                f"the checkpoint stores grid {grid}",
                spec_id="SP-OBJ-2",
            )
        leaf.check(key)
        flat = int(np.ravel_multi_index(leaf.cell, grid))
        return ShardedObject(ck.object_values(key)[flat], leaf.index, leaf.shape, leaf.replica_id)
    if kind == "value":
        return node.value
    hint = (
        "a ShardedObject(None, index, grid)"
        if kind == "object"
        else "a jax.ShapeDtypeStruct or an array"
    )
    raise LayoutMismatchError(
        f"{key!r} is a {kind} in the checkpoint, the target asks for a "
        f"value; ask for it with {hint} [SP-LOAD-3]",
        spec_id="SP-LOAD-1",
    )


def _expect(kind: str, want: str, key: str) -> None:
    if kind != want:
        raise LayoutMismatchError(
            f"{key!r}: asked for a {want}, the checkpoint holds a {kind}", spec_id="SP-LOAD-1"
        )


def load_array(ck: Checkpoint, key: str, leaf: Any) -> Any:
    t = ck.manifest.tensors[key]
    dtype = numpy_of(t.dtype, key)
    if not isinstance(leaf, np.ndarray) and not exact_in_jax(dtype):
        raise LayoutMismatchError(
            f"tensor {key!r} is {t.dtype}, which JAX narrows without "
            "jax_enable_x64; enable it or load into a numpy array",
            spec_id="SP-DTYPE-2",
        )
    if tuple(leaf.shape) != t.shape or numpy_dtype(leaf.dtype, key) != dtype:
        raise LayoutMismatchError(
            f"tensor {key!r}: asked for {leaf.dtype} "
            f"{list(leaf.shape)}, the checkpoint holds {t.dtype} "
            f"{list(t.shape)}",
            spec_id="SP-LOAD-1",
        )
    if isinstance(leaf, np.ndarray):
        if leaf.flags.c_contiguous and leaf.flags.writeable:
            return ck.read(key, [0] * leaf.ndim, leaf.shape, out=leaf)
        leaf[...] = ck.read(key, [0] * leaf.ndim, leaf.shape)
        return leaf
    sharding: Optional[jax.sharding.Sharding] = getattr(leaf, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    cache: dict = {}

    def region(index: Optional[tuple]) -> np.ndarray:
        off, shp = region_of(index, t.shape)
        k = (tuple(off), tuple(shp))
        if k not in cache:  # replicated devices of this process share one read
            cache[k] = ck.read(key, off, shp)
        return cache[k]

    return jax.make_array_from_callback(t.shape, sharding, region)
