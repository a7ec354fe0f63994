"""What a reader checks on local storage before it plans a load or allocates its targets, so
that what a manifest declares costs in proportion to what storage holds (issue 28).

A load plans per tensor and per chunk before it reads: a 29 MiB manifest naming 200,000
arrays that do not exist, or a 3M-element tensor with ``chunk_shape [1]``, cost gigabytes and
minutes of planning (and of allocated targets) before the first open found the problem.
Both are found here first, from the files alone:

- every array the load reads exists ([SP-ARRAY-1]): one listing per distinct parent
  directory of the array paths, no ``stat`` per array;
- an array whose chunk grid has more than :data:`LARGE_GRID` chunks is opened (its directory
  scanned, zarr.json and every chunk file's size checked, [SP-READ-3], [SP-READ-5],
  [SP-READ-6], [SP-SEC-6]) before anything is built per chunk, and when the whole tensor is
  read, its chunk files must all be there ([SP-READ-2]).

Example::

    check_before_planning("/ckpt/step_5", [("w", entry, True)])   # raises on a problem
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterable, Tuple

from shardpoint_core.format.errors import CorruptCheckpointError

#: Chunks in a tensor's grid above which its files are checked before planning.
LARGE_GRID = 1 << 16


def grid_size(shape: Iterable[int], chunk: Iterable[int]) -> int:
    """How many chunks the regular grid of ``chunk`` over ``shape`` has."""
    return math.prod(-(-n // c) for n, c in zip(shape, chunk))


def first_missing_array(root: str, array_paths: Iterable[str]) -> str:
    """The first of ``array_paths`` (relative, checked by [SP-SEC-1]) with no directory
    below ``root``, or ``""``: each distinct parent directory is listed once."""
    listed: dict[str, Any] = {}
    for path in array_paths:
        parent, _, name = path.rpartition("/")
        names = listed.get(parent)
        if names is None:
            try:
                with os.scandir(os.path.join(root, parent) if parent else root) as it:
                    names = listed[parent] = {e.name for e in it}
            except OSError:
                names = listed[parent] = set()
        if name not in names:
            return path
    return ""


def check_before_planning(root: str, reads: Iterable[Tuple[str, Any, bool]]) -> None:
    """:func:`check_arrays_exist`, then :func:`check_large_grids`."""
    reads = list(reads)
    check_arrays_exist(root, reads)
    check_large_grids(root, reads)


def check_arrays_exist(root: str, reads: Iterable[Tuple[str, Any, bool]]) -> None:
    """Every array of ``reads`` (``(key, manifest entry, whether the whole tensor is
    read)``; entries have ``array``, ``shape``, ``dtype`` and ``chunk_shape``) has its
    directory ([SP-ARRAY-1]). Before a load allocates its targets: a manifest naming 200k
    absent tensors would cost their targets first. (1.4) Packed arrays have no directory:
    their index, checked with the manifest, names every chunk ([SP-PACK-4])."""
    reads = [r for r in reads if getattr(r[1], "packed", None) is None]
    missing = first_missing_array(root, (e.array for _k, e, _w in reads))
    if missing:
        key = next(k for k, e, _w in reads if e.array == missing)
        raise CorruptCheckpointError(
            f"tensor {key!r}: array {missing!r} has no zarr.json "
            f"(no directory {missing!r} in {root!r})",
            spec_id="SP-ARRAY-1",
        )


def check_large_grids(root: str, reads: Iterable[Tuple[str, Any, bool]]) -> None:
    """Arrays of ``reads`` whose grids have more than :data:`LARGE_GRID` chunks are opened
    (every check of :func:`~shardpoint_core.arrays.opening.open_local_array`), and one read whole must have all its
    chunk files ([SP-READ-2]). Before a load plans anything per chunk."""
    from shardpoint_core.format.dtypes import from_name
    from shardpoint_core.arrays.opening import open_local_array_counted

    for key, e, whole in reads:
        grid = grid_size(e.shape, e.chunk_shape)
        if grid <= LARGE_GRID or getattr(e, "packed", None) is not None:
            continue
        _meta, (files, _stored) = open_local_array_counted(
            root,
            e.array,
            tuple(e.shape),
            e.dtype,
            tuple(e.chunk_shape),
            from_name(e.dtype).itemsize,
            key,
        )
        if whole and files < grid:
            raise CorruptCheckpointError(
                f"tensor {key!r}: array {e.array!r} holds {files} chunk files of the {grid} "
                f"its chunk grid {list(e.chunk_shape)} over {list(e.shape)} needs: chunks "
                "are missing",
                spec_id="SP-READ-2",
            )
