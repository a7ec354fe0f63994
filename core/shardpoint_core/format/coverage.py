"""Coverage rules: the written regions of a tensor tile its global shape exactly once.

Pure functions over boxes ``(offset, shape)``; no I/O, no process group. The checks are
sub-quadratic in the common cases (regular grids, slab decompositions of flattened ranges)
and fall back to a sort-and-sweep for irregular layouts. See [SP-COVER-1] .. [SP-COVER-3].
"""

from __future__ import annotations

import bisect
import math
from typing import Any, Callable, NoReturn, Optional, Sequence

import numpy as np

from shardpoint_core.format.errors import InvalidShardingError

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape)
MAX_CELLS = 1 << 22


def box_intersection(
    a_off: Sequence[int], a_shape: Sequence[int], b_off: Sequence[int], b_shape: Sequence[int]
) -> Optional[Box]:
    """The common box of two boxes, or None when they share no element."""
    off: list[int] = []
    shp: list[int] = []
    for ao, as_, bo, bs in zip(a_off, a_shape, b_off, b_shape):
        lo, hi = max(ao, bo), min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        off.append(lo)
        shp.append(hi - lo)
    return tuple(off), tuple(shp)


def regular_grid_of(shape: Sequence[int], boxes: Sequence[Box]) -> Optional[tuple[int, ...]]:
    """If every box is exactly one cell of one regular grid, that grid's chunk shape."""
    if not boxes:
        return None
    origin = [b for b in boxes if not any(b[0])]
    if len(origin) != 1:
        return None
    chunk = origin[0][1]
    for off, shp in boxes:
        for o, s, c, n in zip(off, shp, chunk, shape):
            if o % c or s != min(c, n - o):
                return None
    return tuple(chunk)


def regions_tile(shape: Sequence[int], regions: Sequence[tuple[Any, ...]]) -> bool:
    """A quick sufficient test that distinct non-empty ``regions`` (``(offset, shape, flat or
    None)``) tile ``shape`` exactly once: their blocks are all the cells of one regular grid,
    and within each block the flattened ranges (a rectangular region: the whole block) follow
    one another from 0 to the block's size. False means "not shown": the full check
    (:func:`check_exact_cover` on the pieces) then decides and names the fault."""
    ranges: dict[Box, list[tuple[int, ...]]] = {}
    for o, s, f in regions:
        ranges.setdefault((tuple(o), tuple(s)), []).append(tuple(f) if f else (0, math.prod(s)))
    grid = regular_grid_of(shape, list(ranges))
    if grid is None or math.prod(-(-n // c) for n, c in zip(shape, grid)) != len(ranges):
        return False
    for (_, s), rs in ranges.items():
        end = 0
        for a, b in sorted(rs):
            if a != end:
                return False
            end = b
        if end != math.prod(s):
            return False
    return True


def check_exact_cover(
    shape: Sequence[int], boxes: Sequence[Box], describe: Callable[[int], str], key: str
) -> None:
    """Raise :class:`InvalidShardingError` unless the non-empty ``boxes`` tile ``shape`` once.

    ``describe(i)`` names who holds box ``i`` (ranks, replica ids) for the error message.
    """
    total = math.prod(shape)
    vol = sum(math.prod(s) for _, s in boxes)
    grid = regular_grid_of(shape, boxes)
    if grid is not None:
        cells = math.prod(-(-n // c) for n, c in zip(shape, grid))
        if cells == len(boxes) and vol == total:
            return  # distinct cells of a regular grid, as many as the grid has
    if total == 0:
        if boxes:
            raise InvalidShardingError(
                f"tensor {key!r} has no elements but {describe(0)} claims a non-empty region",
                spec_id="SP-COVER-1",
            )
        return
    if not shape:  # 0-d: exactly one holder of the single element
        if len(boxes) != 1:
            _fail_count(key, len(boxes), describe)
        return
    bounds = [
        sorted({0, n} | {o[d] for o, _ in boxes} | {o[d] + s[d] for o, s in boxes})
        for d, n in enumerate(shape)
    ]
    ncells = math.prod(len(b) - 1 for b in bounds)
    if ncells <= MAX_CELLS:
        count = np.zeros([len(b) - 1 for b in bounds], dtype=np.int32)
        for off, shp in boxes:
            sl = tuple(
                slice(bisect.bisect_left(b, o), bisect.bisect_left(b, o + s))
                for b, o, s in zip(bounds, off, shp)
            )
            count[sl] += 1
        over = np.argwhere(count > 1)
        if len(over):
            _fail_overlap(key, shape, boxes, bounds, tuple(over[0]), describe)
        gap = np.argwhere(count == 0)
        if len(gap):
            cell = tuple(gap[0])
            lo = tuple(b[i] for b, i in zip(bounds, cell))
            hi = tuple(b[i + 1] for b, i in zip(bounds, cell))
            raise InvalidShardingError(
                f"tensor {key!r} of shape {tuple(shape)}: no rank holds the region "
                f"[{lo}, {hi}) (a gap; {total - vol} elements uncovered in all)",
                spec_id="SP-COVER-2",
            )
        return
    _sweep(key, shape, boxes, describe)
    if vol != total:
        raise InvalidShardingError(
            f"tensor {key!r} of shape {tuple(shape)}: the holdings "
            f"cover {vol} of {total} elements (a gap)",
            spec_id="SP-COVER-2",
        )


def _fail_count(key: str, n: int, describe: Callable[[int], str]) -> NoReturn:
    raise InvalidShardingError(
        f"tensor {key!r} is 0-d but {n} distinct holdings claim it "
        f"({', '.join(describe(i) for i in range(n))})",
        spec_id="SP-COVER-3",
    )


def _fail_overlap(
    key: str,
    shape: Sequence[int],
    boxes: Sequence[Box],
    bounds: Sequence[Sequence[int]],
    cell: tuple[int, ...],
    describe: Callable[[int], str],
) -> NoReturn:
    point = tuple(b[i] for b, i in zip(bounds, cell))
    hits = [
        i
        for i, (o, s) in enumerate(boxes)
        if all(oo <= p < oo + ss for oo, ss, p in zip(o, s, point))
    ][:2]
    a, b = hits
    raise InvalidShardingError(
        f"tensor {key!r} of shape {tuple(shape)}: regions overlap without being replicas: "
        f"{describe(a)} holds offset {boxes[a][0]} shape {boxes[a][1]}, {describe(b)} holds "
        f"offset {boxes[b][0]} shape {boxes[b][1]}; equal regions are replicas, partial "
        "overlaps are not allowed",
        spec_id="SP-COVER-3",
    )


def _sweep(
    key: str, shape: Sequence[int], boxes: Sequence[Box], describe: Callable[[int], str]
) -> None:
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][0])
    active: list[int] = []
    for i in order:
        o, s = boxes[i]
        active = [j for j in active if boxes[j][0][0] + boxes[j][1][0] > o[0]]
        for j in active:
            if box_intersection(o, s, *boxes[j]) is not None:
                raise InvalidShardingError(
                    f"tensor {key!r}: {describe(i)} (offset {o}, shape {s}) and {describe(j)} "
                    f"(offset {boxes[j][0]}, shape {boxes[j][1]}) overlap",
                    spec_id="SP-COVER-3",
                )
        active.append(i)
