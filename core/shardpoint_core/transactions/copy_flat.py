"""Flattening an incremental packed checkpoint for a copy ([SP-PACK-9]): the chunks its index
takes from bases move into *flat objects* of the copy's own, so the copy is a whole
checkpoint that names no base (a copy elsewhere cannot take its bases along: they would
have to lie beside it, under the same names and identities).

:func:`flatten` rewrites the index (records of base chunks renumbered to the flat objects,
back to back; the bases dropped; crc32c and hashes kept, so the copy can be a base in
turn) and says which bytes each flat object takes from where; :func:`flat_bytes` reads
them, each checked against its record (crc32c and [SP-PACK-10] hash) before it is written.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from shardpoint_core.arrays.packed import OBJECT_CAP, PACKED_DIR
from shardpoint_core.arrays.packed_base import manifest_identity, sibling_path
from shardpoint_core.format.errors import CorruptCheckpointError
from shardpoint_core.format.manifest import Manifest
from shardpoint_core.format.packed import HASH_BYTES, PackedIndex, chunk_hash
from shardpoint_core.stores.location import locate

PIECE = 64 << 20  # a base object up to this size is read whole (once), a larger one by ranges


def _join(root: str, key: str) -> str:
    return f"{root}/{key}" if root else key


#: (flattening) one chunk a flat object takes from a base: the base's location, the object's
#: path there, offset and length in it, the record's crc32c and hash, its offset in the flat
#: object
FlatPiece = Tuple[str, str, int, int, int, Optional[bytes], int]


def base_checks(src: str, packed: PackedIndex) -> Dict[str, bytes]:
    """Base location -> identity of every base of ``packed`` (the index of the checkpoint at
    ``src``), each checked now and again before the copy's commit. CorruptCheckpointError
    where one is not there with the identity the index records ([SP-PACK-9])."""
    checks: Dict[str, bytes] = {}
    for name, ident in packed.bases:
        where = sibling_path(src, name)
        got = manifest_identity(where)
        if got != ident:
            raise CorruptCheckpointError(
                f"copy of {src!r}: its base {name!r} at {where!r} is "
                f"{'missing' if got is None else 'another checkpoint (identity differs)'}; "
                "nothing was copied",
                spec_id="SP-PACK-9",
            )
        checks[where] = ident
    return checks


def flatten(
    src: str, m: Manifest, target_local: bool
) -> Tuple[Any, Dict[str, List[FlatPiece]], Dict[str, bytes]]:
    """The packed index of the incremental checkpoint ``m`` (at ``src``) without its bases
    ([SP-PACK-9]): every chunk a base holds moves into flat objects of the copy's own
    (``packed/flat-<token>-<n>.bin``; one on files, split at the object-store cap
    elsewhere), back to back; the records follow, the rest of the index (own objects, hashes,
    crc32c) stays. Returns (the index, flat object key -> its pieces, base location ->
    identity to check again before the commit). CorruptCheckpointError where a base is not
    there with the identity the index records."""
    assert m.packed is not None, "only a packed index has bases"
    packed: PackedIndex = m.packed
    checks = base_checks(src, packed)
    own = [i for i in range(len(packed.objects)) if packed.base_of(i) is None]
    renum = np.full(len(packed.objects), -1, np.int64)
    renum[own] = np.arange(len(own))
    rec = np.array(packed.records, copy=True)
    hashes = (
        None
        if packed.hashes is None
        else np.frombuffer(packed.hashes, np.uint8).reshape(-1, HASH_BYTES)
    )
    is_base = np.array([packed.base_of(i) is not None for i in range(len(packed.objects))])
    shared = np.flatnonzero(is_base[rec["object"]]) if len(rec) else np.zeros(0, np.int64)
    order = shared[np.lexsort((rec["offset"][shared], rec["object"][shared]))]
    token = secrets.token_hex(4)
    cap = 0 if target_local else OBJECT_CAP
    flat: Dict[str, List[FlatPiece]] = {}
    objects = [packed.objects[i] for i in own]
    key, at = "", 0
    for j in order.tolist():
        r = rec[j]
        n = int(r["length"])
        if not key or (cap and at and at + n > cap):
            if key:
                objects.append((key, at))
            key, at = f"{PACKED_DIR}/flat-{token}-{len(flat)}.bin", 0
            flat[key] = []
        o = int(r["object"])
        b = packed.base_of(o)
        assert b is not None  # (a record of an object of a base, by ``shared``)
        flat[key].append(
            (
                sibling_path(src, packed.bases[b][0]),
                packed.objects[o][0],
                int(r["offset"]),
                n,
                int(r["crc32c"]),
                None if hashes is None else bytes(hashes[j]),
                at,
            )
        )
        rec["offset"][j] = at
        rec["object"][j] = len(objects)  # the flat object's number once appended
        at += n
    if key:
        objects.append((key, at))
    mine = np.flatnonzero(~is_base[packed.records["object"]]) if len(rec) else shared
    rec["object"][mine] = renum[packed.records["object"][mine]]
    index = dataclasses.replace(packed, objects=objects, records=rec, bases=[], object_bases=None)
    return index, flat, checks


def flat_bytes(pieces: List[Any], src: str, dst: str) -> Iterator[Tuple[Any, bytes]]:
    """The chunks of one flat object (:func:`_flatten`), read from their bases and each
    checked against its record (crc32c, and the [SP-PACK-10] hash), in order, one at a
    time. A base object is read whole where it is small (a memory-tier object checks its
    crc32c per read; the pieces come in object order), in ranges where it is large."""
    cache: Tuple[str, bytes] = ("", b"")
    for piece in pieces:
        where, path, off, n, crc, h, _at = piece
        store, root = locate(where, "copy").pair()
        key = _join(root, path)
        try:
            if cache[0] != f"{where}/{path}":
                info = store.head(key)
                whole = info is not None and info.size <= PIECE
                cache = (f"{where}/{path}", bytes(store.get(key)) if whole else b"")
            data = cache[1][off : off + n] if cache[1] else store.get_range(key, off, n)
        except FileNotFoundError as e:
            raise CorruptCheckpointError(
                f"copy of {src!r}: object {path!r} of its base {where!r} could not be read "
                f"intact ({e}); nothing was committed at {dst!r}",
                spec_id="SP-PACK-9",
            ) from e
        bad = len(data) != n or int.from_bytes(data[-4:], "little") != crc
        if not bad and h is not None:
            bad = chunk_hash([data]) != h
        if bad:
            raise CorruptCheckpointError(
                f"copy of {src!r}: bytes {off}+{n} of object {path!r} of its base {where!r} "
                "are not the chunk its index records (crc32c or hash); nothing was committed "
                f"at {dst!r}",
                spec_id="SP-PACK-10",
            )
        yield piece, data
