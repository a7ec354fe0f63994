"""A copy that builds on an earlier checkpoint beside its target ([SP-PACK-9]): the memory
tier's durable copies with ``incremental=True``, each building on the newest storage step.

:func:`storage_base` loads the base the copy is asked to build on (None: there is none
usable, and the copy is a full one, flattened as :mod:`.copy_flat` does). :func:`build_on`
plans the copy: a chunk of the source whose length, crc32c and [SP-PACK-10] hash equal the
base's chunk of the same array and number is referred to (its owner, object and offset,
as a regular incremental save records it: the base itself, or the base's own base, never a
chain); every other chunk is copied. A data object of the source none of whose chunks is
referred to is copied byte for byte as before; the chunks still needed of the others, and
those the source takes from its own bases, land back to back in new objects of the copy's
own (``packed/onto-<token>-<n>.bin``: one per source object, one for the chunks of its
bases; split at the object-store cap), each read and checked against its crc32c and hash
(:func:`~.copy_flat.flat_bytes`). The index is built by the packed writer's own
:func:`~shardpoint_core.arrays.packed.build_index`, so the bases and references are encoded
exactly as a regular incremental save encodes them.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from shardpoint_core.arrays.packed import OBJECT_CAP, PACKED_DIR, build_index
from shardpoint_core.arrays.packed_base import Base, sibling_path
from shardpoint_core.format.errors import ShardpointError
from shardpoint_core.format.manifest import Manifest, array_path_for
from shardpoint_core.format.packed import HASH_BYTES, PackedIndex
from shardpoint_core.transactions.copy_flat import FlatPiece, base_checks
from shardpoint_core.transactions.incremental import resolve_base

log = logging.getLogger("shardpoint")


@dataclass
class OntoPlan:
    """A copy building on ``base`` (its location and identity, checked again before the
    commit): ``index``, the copy's packed index; ``whole``, the source's data objects copied
    byte for byte; ``flat``, the new objects and the chunks each takes (from the source or
    its bases); ``origin``, the source object each new object's chunks come from (none: its
    bases'); ``checks``, the source's bases (location -> identity)."""

    index: PackedIndex
    base: Tuple[str, bytes]
    whole: List[str] = field(default_factory=list)
    flat: Dict[str, List[FlatPiece]] = field(default_factory=dict)
    origin: Dict[str, str] = field(default_factory=dict)
    checks: Dict[str, bytes] = field(default_factory=dict)


def storage_base(dst: str, incremental: str, zarr: Any) -> Optional[Base]:
    """The :class:`Base` a copy to ``dst`` builds on (``incremental``: its name or path
    beside ``dst``; ``zarr``: the backend that reads its manifest), or None where there is
    none usable (gone, not packed, without hashes, unreadable): the copy is then a full one,
    never a failed one because of the base."""
    try:
        base = resolve_base(dst, incremental, zarr)
    except (ShardpointError, OSError) as e:
        log.info("shardpoint: the copy to %s builds on no base (%s): a full copy", dst, e)
        return None
    return base if base is not None and base.hashed else None


def _matches(m: Manifest, packed: PackedIndex, hashes: np.ndarray, base: Base) -> Any:
    """Per record of ``packed``: whether the base holds the same chunk (length, crc32c and
    hash equal, for the same array and chunk number), and where (the base's object number
    and offset)."""
    rec = packed.records
    hit = np.zeros(len(rec), bool)
    b_obj = np.zeros(len(rec), np.int64)
    b_off = np.zeros(len(rec), np.int64)
    entries = {e.array: e for e in m.tensors.values()}
    col = rec["array"]
    for k, (name, inner) in enumerate(packed.arrays):
        lo, hi = int(np.searchsorted(col, k, "left")), int(np.searchsorted(col, k, "right"))
        e = entries.get(name)
        if lo == hi or e is None:
            continue
        part = base.candidates(array_path_for(e.key), e.shape, e.dtype, e.chunk_shape, inner)
        if part is None or part.hashes is None or part.codec != packed.codec_of(k):
            continue
        mine = rec[lo:hi]
        c = mine["chunk"].astype(np.int64)
        if len(part.records) != hi - lo or not np.array_equal(c, np.arange(hi - lo)):
            continue  # (one record per chunk in chunk order on both sides, [SP-PACK-4])
        theirs = part.records
        hit[lo:hi] = (
            (theirs["length"] == mine["length"])
            & (theirs["crc32c"] == mine["crc32c"])
            & (np.asarray(part.hashes) == hashes[lo:hi]).all(axis=1)
        )
        b_obj[lo:hi] = theirs["object"]
        b_off[lo:hi] = theirs["offset"]
    return hit, b_obj, b_off


def build_on(src: str, dst: str, m: Manifest, base: Base, target_local: bool) -> Optional[OntoPlan]:
    """The plan of a copy of ``m`` (the committed manifest at ``src``) to ``dst`` building on
    ``base`` (see the module); None where nothing can be referred to (the source records no
    hashes, or no chunk is the base's): the copy is then made as without a base.
    CorruptCheckpointError where a base of the source is not there with its identity."""
    packed = m.packed
    if packed is None or packed.hashes is None or not len(packed.records):
        return None
    hashes = np.frombuffer(packed.hashes, np.uint8).reshape(-1, HASH_BYTES)
    hit, b_obj, b_off = _matches(m, packed, hashes, base)
    if not hit.any():
        return None
    rec = packed.records
    n_obj = len(packed.objects)
    is_base = np.array([packed.base_of(i) is not None for i in range(n_obj)], bool)
    obj = rec["object"].astype(np.int64)
    referred = np.bincount(obj[hit], minlength=n_obj)
    whole = [i for i in range(n_obj) if not is_base[i] and referred[i] == 0]
    number = {o: n for n, o in enumerate(whole)}
    objects: List[Tuple[str, int]] = [packed.objects[i] for i in whole]
    # the chunks moved into new objects: those of the source's bases, and those still
    # needed of a source object some of whose chunks the base holds
    moved = np.flatnonzero(~hit & (is_base[obj] | (referred[obj] > 0)))
    group = np.where(is_base[obj[moved]], -1, obj[moved])
    moved = moved[np.lexsort((rec["offset"][moved], obj[moved], group))]
    token, cap = secrets.token_hex(4), (0 if target_local else OBJECT_CAP)
    checks = base_checks(src, packed)
    flat: Dict[str, List[FlatPiece]] = {}
    origin: Dict[str, str] = {}
    place: Dict[int, Tuple[int, int]] = {}  # record -> (object number, offset)
    key, at, last = "", 0, -2
    for j in moved.tolist():
        o, n = int(obj[j]), int(rec["length"][j])
        g = -1 if is_base[o] else o
        if not key or g != last or (cap and at and at + n > cap):
            if key:
                objects.append((key, at))
            key, at, last = f"{PACKED_DIR}/onto-{token}-{len(flat)}.bin", 0, g
            flat[key] = []
            if g >= 0:
                origin[key] = packed.objects[o][0]
        b = packed.base_of(o)
        where = src if b is None else sibling_path(src, packed.bases[b][0])
        h = bytes(hashes[j])
        flat[key].append(
            (where, packed.objects[o][0], int(rec["offset"][j]), n, int(rec["crc32c"][j]), h, at)
        )
        place[j] = (len(objects), at)
        at += n
    if key:
        objects.append((key, at))
    names = [name for name, _i in packed.arrays]
    rows, refs = [], []
    cols = zip(
        rec["array"].tolist(),
        rec["chunk"].tolist(),
        rec["object"].tolist(),
        rec["offset"].tolist(),
        rec["length"].tolist(),
        rec["crc32c"].tolist(),
        hit.tolist(),
        b_obj.tolist(),
        b_off.tolist(),
    )
    for j, (ai, c, o, off, n, crc32c, shared, bo, boff) in enumerate(cols):
        a, crc, h = names[ai], crc32c.to_bytes(4, "little"), hashes[j].tobytes()
        if shared:
            owner, ident, path, size = base.owners[bo]
            refs.append((a, c, owner, ident, path, size, boff, n, crc, h))
        else:
            obj_n, at = place[j] if j in place else (number[o], off)
            rows.append((a, c, obj_n, at, n, crc, h))
    arrays: Dict[str, Any] = {}
    for k, (name, inner) in enumerate(packed.arrays):
        codec = packed.codec_of(k)
        arrays[name] = codec if codec is not None else inner
    return OntoPlan(
        build_index(objects, rows, arrays, refs, hashes=True),
        (sibling_path(dst, base.name), base.identity),
        [packed.objects[i][0] for i in whole],
        flat,
        origin,
        checks,
    )
