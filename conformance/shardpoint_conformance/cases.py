"""Checkpoint cases as plain data, and how a rank turns one into tensors and checks.

A *case* is a JSON-serialisable dict: a tree of tensors and objects, a saving layout and an
independent loading layout. It is drawn from a seed (:mod:`.strategies`), so every rank of a
job draws the same case and a failing one is replayed from its printed seed. Tensor contents
are random *bits* derived from ``(seed, key)`` only, so ranks build their pieces without
communicating and a loader knows the exact expected bytes (NaN payloads and -0.0 included).

Case layout (all fields plain JSON)::

    {"seed": 7, "id": "c0007", "profile": "ci",
     "tensors": [{"path": ["model", 0, "w"], "key": "model/0/w", "dtype": "bfloat16",
                  "shape": [5, 3]}],
     "values":  [{"path": ["step"], "value": 12}],          # bytes as {"$b64": "..."}
     "objects": [{"path": ["rng"], "key": "rng", "count": 4}],   # optional "shape": [2, 2]
     "save": {"world": 4, "tensors": {KEY: LAYOUT}, "objects": {KEY: [[rank, index, replica]]}},
     "load": {"world": 2, "like": true, "tensors": {KEY: LAYOUT}, "objects": {KEY: [[rank, index]]}}}

    LAYOUT = {"kind": "split-uneven d0", "pieces": [[rank, offset, shape, flat, replica], ...]}

``flat`` is ``[start, stop]`` (a flattened range of the block ``offset``/``shape``) or null;
``replica`` is a list of ints, or null for a plain (unsharded) tensor leaf, which the library
treats as a replica across ranks. A rank has at most one piece per key, except in layouts
whose kind starts with ``pieces``: there a rank may hold several (disjoint) pieces of the key,
passed to the library as one leaf of several pieces (``sp.ShardedPieces``), and a rank with
none leaves the key out. A sharded object may be a multi-dimensional grid (spec 1.1,
[SP-OBJ-1..4]): its entry then has ``"shape"`` (product ``count``) and its indexes are lists
of ints, one per dimension; without ``"shape"`` indexes are ints (the 1-D case, as before).
"""

from __future__ import annotations

import base64
import math
import zlib
from typing import Any

import ml_dtypes
import numpy as np

SPEC_DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
]
NUMPY_DTYPES: dict[str, np.dtype] = {
    "bool": np.dtype(np.bool_),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32),
    "uint64": np.dtype(np.uint64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "complex64": np.dtype(np.complex64),
    "complex128": np.dtype(np.complex128),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
# Dtypes numpy cannot name without ml_dtypes: adapters exchange them as raw bits.
RAW_BITS: dict[str, np.dtype] = {
    "bfloat16": np.dtype("<u2"),
    "float8_e4m3fn": np.dtype("u1"),
    "float8_e5m2": np.dtype("u1"),
}


# -------------------------------------------------------------------------------- contents
def expected_array(seed: int, key: str, dtype: str, shape) -> np.ndarray:
    """The full global tensor of ``key`` in a case drawn with ``seed``: random bits."""
    dt = NUMPY_DTYPES[dtype]
    n = math.prod(shape)
    rng = np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32, zlib.crc32(key.encode())])
    raw = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8)
    if dtype == "bool":
        raw &= 1
    return raw.view(dt).reshape(tuple(shape))


def piece_of(full: np.ndarray, offset, shape, flat) -> np.ndarray:
    """The part of ``full`` a piece stands for (1-D for a flattened range)."""
    block = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))] if shape else full
    block = block.copy(order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
    return block if flat is None else block.reshape(-1)[flat[0] : flat[1]]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.shape == b.shape
        and a.dtype.itemsize == b.dtype.itemsize
        and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
    )


def first_difference(got: np.ndarray, want: np.ndarray) -> str:
    if got.shape != want.shape:
        return f"shape {got.shape} != expected {want.shape}"
    g = (
        np.ascontiguousarray(got).reshape(-1).view(np.uint8).reshape(got.size, -1)
        if got.size
        else got
    )
    w = (
        np.ascontiguousarray(want).reshape(-1).view(np.uint8).reshape(want.size, -1)
        if want.size
        else want
    )
    bad = np.nonzero((g != w).any(axis=1))[0]
    if not len(bad):
        return "bits equal"
    i = int(bad[0])
    idx = np.unravel_index(i, want.shape) if want.shape else ()
    return (
        f"{len(bad)} of {want.size} elements differ; first at {tuple(map(int, idx))}: "
        f"got bytes {g[i].tobytes().hex()} expected {w[i].tobytes().hex()}"
    )


def object_value(seed: int, key: str, index: Any) -> Any:
    """The value a sharded object holds at ``index`` (an int, or a list/tuple of ints for a
    grid cell; JSON-tagged, see :func:`decode_value`)."""
    if isinstance(index, (list, tuple)):
        index = [int(i) for i in index]
        h = zlib.crc32(f"{seed}:{key}:{index}".encode())
        times = sum(index) % 3
    else:
        h = zlib.crc32(f"{seed}:{key}:{index}".encode())
        times = index % 3
    return {
        "index": index,
        "h": h,
        "blob": {"$b64": base64.b64encode(h.to_bytes(4, "little") * times).decode()},
        "f": h / 7.0,
    }


def object_grid(o: dict) -> Any:
    """What ``sp.ShardedObject`` takes as count: the int ``count``, or the tuple ``shape`` of a
    grid when the case gives one (an object entry's optional ``"shape"``, product ``count``)."""
    return tuple(o["shape"]) if o.get("shape") else o["count"]


def object_index(idx: Any) -> Any:
    """A case's object index (an int, or a list for a grid cell) as ``sp.ShardedObject`` takes
    it."""
    return tuple(idx) if isinstance(idx, list) else idx


def grid_cell(i: int, shape: Any) -> Any:
    """Cell number ``i`` of a grid in row-major order: ``i`` itself for an int count (1-D),
    else the list of its components."""
    if not isinstance(shape, (list, tuple)):
        return i
    return [int(c) for c in np.unravel_index(i, tuple(shape))]


def grid_values(seed: int, key: str, grid: Any) -> list:
    """Every value of a sharded object, as a full load hands them back ([SP-OBJ-4]): a list
    for a 1-D grid, nested lists (outer = first dimension) for two or more dimensions."""
    if not isinstance(grid, (list, tuple)) or len(grid) == 1:
        n = grid if not isinstance(grid, (list, tuple)) else grid[0]
        return [
            decode_value(object_value(seed, key, i if not isinstance(grid, (list, tuple)) else [i]))
            for i in range(n)
        ]

    def level(prefix: list, dims: tuple) -> list:
        if not dims:
            return decode_value(object_value(seed, key, prefix))
        return [level(prefix + [i], dims[1:]) for i in range(dims[0])]

    return level([], tuple(grid))


# -------------------------------------------------------------------------------- values
def decode_value(v: Any) -> Any:
    """JSON-tagged value -> Python value (``{"$b64": s}`` -> bytes)."""
    if isinstance(v, dict):
        if set(v) == {"$b64"}:
            return base64.b64decode(v["$b64"])
        return {k: decode_value(x) for k, x in v.items()}
    if isinstance(v, list):
        return [decode_value(x) for x in v]
    return v


def encode_value(v: Any) -> Any:
    """Python value -> JSON-tagged value (inverse of :func:`decode_value`)."""
    if isinstance(v, (bytes, bytearray)):
        return {"$b64": base64.b64encode(bytes(v)).decode()}
    if isinstance(v, dict):
        return {str(k): encode_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [encode_value(x) for x in v]
    return v


# -------------------------------------------------------------------------------- tree
def set_path(tree: dict, path: list, leaf: Any) -> None:
    node = tree
    for c in path[:-1]:
        node = node.setdefault(c, {})
    node[path[-1]] = leaf


def get_path(tree: Any, path: list) -> Any:
    for c in path:
        tree = tree[c]
    return tree


def tensor_entries(case: dict) -> dict:
    return {t["key"]: t for t in case["tensors"]}


def rank_pieces(layout: dict, rank: int) -> list:
    return [p for p in layout["pieces"] if p[0] == rank]


def is_pieces(layout: dict) -> bool:
    """Whether a rank may hold several pieces of the key (one ``ShardedPieces`` leaf)."""
    return layout["kind"].startswith("pieces")


def describe_layout(side: dict) -> str:
    """A short text for the report table: world size and the layout kinds used."""
    kinds = sorted({v["kind"].split(" ")[0] for v in side["tensors"].values()})
    return f"w{side['world']}:" + ",".join(kinds)


def case_bytes(case: dict) -> int:
    return sum(math.prod(t["shape"]) * NUMPY_DTYPES[t["dtype"]].itemsize for t in case["tensors"])


def check_case(case: dict) -> None:
    """Raise ``ValueError`` if a case breaks its own rules (used by the strategy tests)."""
    ents = tensor_entries(case)
    for side in ("save", "load"):
        world = case[side]["world"]
        for key, lay in case[side]["tensors"].items():
            shape = ents[key]["shape"]
            ranks = [p[0] for p in lay["pieces"]]
            several = is_pieces(lay)
            if (not several and len(ranks) != len(set(ranks))) or any(
                not 0 <= r < world for r in ranks
            ):
                raise ValueError(f"{side} {key}: bad ranks {ranks}")
            for _r, off, shp, flat, _rep in lay["pieces"]:
                if len(off) != len(shape) or any(
                    o + s > n or o < 0 or s < 0 for o, s, n in zip(off, shp, shape)
                ):
                    raise ValueError(f"{side} {key}: piece {off}+{shp} outside {shape}")
                if flat is not None and not 0 <= flat[0] <= flat[1] <= math.prod(shp):
                    raise ValueError(f"{side} {key}: flat {flat} outside block {shp}")
    for key, lay in case["save"]["tensors"].items():
        shape = ents[key]["shape"]
        cover = np.zeros(shape, dtype=np.int64)
        seen = set()
        for _r, off, shp, flat, _rep in lay["pieces"]:
            region = (tuple(off), tuple(shp), tuple(flat) if flat else None)
            if region in seen:
                continue  # a replica
            seen.add(region)
            idx = np.arange(cover.size).reshape(shape) if shape else np.array(0)
            block = idx[tuple(slice(o, o + s) for o, s in zip(off, shp))] if shape else idx
            ids = block.reshape(-1)
            if flat is not None:
                ids = ids[flat[0] : flat[1]]
            np.add.at(cover.reshape(-1), ids, 1)
        if cover.size and not (cover == 1).all():
            raise ValueError(f"save {key}: pieces do not cover the tensor exactly once")
    for o in case["objects"]:
        grid = o.get("shape") or [o["count"]]
        if math.prod(grid) != o["count"] or any(n < 1 for n in grid):
            raise ValueError(f"object {o['key']}: shape {grid} does not have {o['count']} cells")
        held = set()
        for side in ("save", "load"):
            for entry in case[side]["objects"].get(o["key"], []):
                cell = entry[1] if isinstance(entry[1], list) else [entry[1]]
                if len(cell) != len(grid) or not all(0 <= i < n for i, n in zip(cell, grid)):
                    raise ValueError(f"{side} object {o['key']}: index {entry[1]} not in {grid}")
                if side == "save":
                    held.add(tuple(cell))
        if case["save"]["objects"].get(o["key"]) and len(held) != o["count"]:
            raise ValueError(f"save object {o['key']}: {len(held)} of {o['count']} cells held")


def as_json_case(case: dict) -> dict:
    """Round trip through JSON (what every rank and every adapter sees)."""
    import json

    return json.loads(json.dumps(case))
