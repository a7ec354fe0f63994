"""save()'s planning (spec/format.md section 8): what each process holds (:class:`LocalPlan`:
its tree node, tensors, sharded objects and arrays, sent as msgpack metadata) and process 0's
checks and merge of every process's plan (:func:`plan_global`, :func:`plan_objects`). Pure:
no I/O and no collective, so the rules can be read and tested apart from the save's steps."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from shardpoint_core.format.treemerge import merge_many
from shardpoint_jax import errors as E
from shardpoint_jax.dtypes import name_of
from shardpoint_jax.grid import chunk_shape, local_chunk_shape
from shardpoint_jax.tree import ShardedObject, is_array, tree_node
from shardpoint_jax.values import check_value, is_scalar_value, pack


def is_global(a: Any) -> bool:
    """A jax.Array laid out over the job (written shard by shard); others are local copies."""
    return isinstance(a, jax.Array) and (jax.process_count() == 1 or not a.is_fully_addressable)


def blocks_of(a: jax.Array) -> list:
    """Every device's block of ``a`` as (start, stop) per dimension."""
    return [
        [(s.start or 0, a.shape[d] if s.stop is None else s.stop) for d, s in enumerate(idx)]
        for idx in a.sharding.devices_indices_map(a.shape).values()
    ]


class LocalPlan:
    """What this process holds: its tree node, tensors, objects and arrays to write."""

    def __init__(self, tree: Any) -> None:
        self.arrays: dict = {}
        self.tensors: dict = {}
        self.objects: dict = {}
        self.node = tree_node(tree, self._leaf)

    def _leaf(self, path: tuple, key: str, v: Any) -> dict:
        if isinstance(v, ShardedObject):
            v.check(key)
            check_value(v.value, key)
            rep = [v.replica_id] if isinstance(v.replica_id, int) else list(v.replica_id)
            self.objects[key] = [list(v.cell), list(v.grid), rep, v.value]
            return {"object": key}
        if is_array(v):
            if isinstance(v, np.ndarray) and v.dtype.byteorder == ">":
                v = v.astype(v.dtype.newbyteorder("<"))  # the format is little-endian
            dt = name_of(v.dtype, key)
            glob = is_global(v)
            chunk = (
                chunk_shape(key, v.shape, blocks_of(v))
                if glob
                else local_chunk_shape(v.shape, np.dtype(v.dtype).itemsize)
            )
            self.arrays[key] = v
            self.tensors[key] = {
                "shape": list(v.shape),
                "dtype": dt,
                "global": glob,
                "chunk": chunk,
            }
            return (
                {"tensor": key} if isinstance(v, jax.Array) else {"tensor": key, "origin": "numpy"}
            )
        check_value(v, key)  # refuses what msgpack cannot carry, naming the key
        if not is_scalar_value(v):
            raise E.UnsupportedValueError(
                f"{key}: a {type(v).__name__} is not a value "
                "leaf; store numbers, str, bytes or None",
                spec_id="SP-VALUE-1",
            )
        return {"value": v}

    def encode(self) -> bytes:
        return pack({"tree": self.node, "tensors": self.tensors, "objects": self.objects})


def plan_global(plans: list, world: int) -> dict:
    """Checks and decisions of process 0 on every process's local plan [SP-PLAN-1]."""
    node = merge_many([p["tree"] for p in plans])
    tensors: dict = {}
    writers: dict = {}
    for rank, p in enumerate(plans):
        for key, t in p["tensors"].items():
            if key not in tensors:
                tensors[key], writers[key] = t, rank
                continue
            first = tensors[key]
            if (first["shape"], first["dtype"], first["global"]) != (
                t["shape"],
                t["dtype"],
                t["global"],
            ):
                raise E.InvalidShardingError(
                    f"tensor {key!r}: process {writers[key]} holds {first['dtype']} "
                    f"{first['shape']}, process {rank} {t['dtype']} {t['shape']} (global "
                    f"{first['global']} vs {t['global']})",
                    spec_id="SP-COVER-4",
                )
    objects = plan_objects(plans)
    return {"tree": node, "tensors": tensors, "writers": writers, "objects": objects}


def plan_objects(plans: list) -> dict:
    """Pick one entry per grid cell [SP-OBJ-1..3] [SP-REPL-2]."""
    entries: dict = {}
    for rank, p in enumerate(plans):
        for key, (cell, grid, rep, value) in p["objects"].items():
            entries.setdefault(key, []).append((rank, tuple(cell), tuple(grid), rep, value))
    out = {}
    for key, es in entries.items():
        grids = {g for _, _, g, _, _ in es}
        if len(grids) > 1:
            raise E.InvalidShardingError(
                f"sharded object {key!r}: processes disagree on the grid: {sorted(grids)}",
                spec_id="SP-OBJ-2",
            )
        grid = grids.pop()
        cells: dict = {}
        for rank, cell, _, rep, value in es:
            cells.setdefault(cell, []).append((rank, rep, value))
        values = []
        for flat in range(math.prod(grid)):
            cell = tuple(int(i) for i in np.unravel_index(flat, grid))
            held = cells.get(cell)
            if not held:
                raise E.InvalidShardingError(
                    f"sharded object {key!r}: no process holds cell {cell} of grid {grid}",
                    spec_id="SP-OBJ-3",
                )
            mains = [h for h in held if not any(h[1])]
            if len(mains) > 1:
                raise E.InvalidShardingError(
                    f"sharded object {key!r}: cell {cell} has main entries (replica id 0) on "
                    f"processes {[h[0] for h in mains]}; give the others replica id 1",
                    spec_id="SP-REPL-2",
                )
            values.append(min(held, key=lambda h: (tuple(h[1]), h[0]))[2])
        entry = {"count": len(values), "values": values}
        if len(grid) > 1:
            entry["shape"] = list(grid)  # [SP-OBJ-4]: omitted for a 1-D grid
        out[key] = entry
    return out
