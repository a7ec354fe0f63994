"""The bookkeeping of a gather that sends each distinct blob once (:meth:`Comm.gather_parts`).

A rank's message is ``[head, blob, ...]``. Data-parallel ranks send mostly the same blobs
(tree branches, key tables, column runs), so the gather runs in three steps: every rank
sends its head with a 16-byte digest and the size of each blob (:func:`offer`); the
coordinator picks one owner per distinct digest, itself first (:func:`requests`), and tells
the owners; the owners send those blobs alone, point to point, and the coordinator rebuilds
every rank's list (:func:`assemble`), identical blobs as one bytes object. Pure: no process
group here, so ``benchmarks/plan_scale.py`` runs the coordinator's side of the gather for
65,536 simulated ranks in one process.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import msgpack

DIGEST_BYTES = 16  # BLAKE2b-128: a collision would hand a rank another's plan


def digest(b: bytes) -> bytes:
    return hashlib.blake2b(b, digest_size=DIGEST_BYTES).digest()


def offer(parts: Sequence[bytes]) -> tuple:
    """``(message, digests)``: what a rank sends first (``msgpack([head, digests joined,
    blob sizes])``) and its blobs' digests."""
    digs = [digest(b) for b in parts[1:]]
    return msgpack.packb([parts[0], b"".join(digs), [len(b) for b in parts[1:]]]), digs


def read_offer(msg: bytes) -> tuple:
    """``(head, digests, sizes)`` of an :func:`offer` message."""
    head, joined, sizes = msgpack.unpackb(msg)
    if len(joined) != DIGEST_BYTES * len(sizes):
        raise ValueError("a gather offer's digests do not match its blob count")
    return head, [joined[i : i + DIGEST_BYTES] for i in range(0, len(joined), DIGEST_BYTES)], sizes


def requests(offers: Sequence[tuple]) -> dict:
    """Coordinator: ``{rank: [blob index, ...]}``, the blobs to send, one owner (the lowest
    rank) per distinct digest; rank 0's own blobs are never requested."""
    seen: set = set()
    want: dict = {}
    for r, (_h, digs, _s) in enumerate(offers):
        for i, d in enumerate(digs):
            if d not in seen:
                seen.add(d)
                if r:
                    want.setdefault(r, []).append(i)
    return want


def encode_requests(want: dict) -> bytes:
    return msgpack.packb([[r, idx] for r, idx in want.items()])


def my_requests(msg: bytes, rank: int) -> list:
    """The blob indices ``rank`` must send, from the coordinator's broadcast."""
    for r, idx in msgpack.unpackb(msg):
        if r == rank:
            return idx
    return []


def assemble(offers: Sequence[tuple], own: Sequence[bytes], want: dict, got: dict) -> list:
    """Every rank's ``[head, blob, ...]``: ``own`` = rank 0's blobs, ``got`` = ``{rank: the
    blobs ``want`` (:func:`requests`) asked of it, concatenated}``. Checks every received
    blob against its digest."""
    by_digest: dict = {}
    for d, b in zip(offers[0][1], own):
        by_digest.setdefault(d, b)
    for r, idx in want.items():
        buf, pos = got[r], 0
        _h, digs, sizes = offers[r]
        for i in idx:
            b = bytes(buf[pos : pos + sizes[i]])
            pos += sizes[i]
            if digest(b) != digs[i]:
                raise ValueError(f"rank {r}'s blob {i} does not match its digest")
            by_digest[digs[i]] = b
        if pos != len(buf):
            raise ValueError(f"rank {r} sent {len(buf)} bytes, {pos} were asked for")
    return [[h, *map(by_digest.__getitem__, digs)] for h, digs, _s in offers]


def wanted_bytes(offers: Sequence[tuple], want: dict) -> dict:
    """``{rank: bytes it sends}`` for the requests ``want`` (what the coordinator receives
    from each)."""
    return {r: sum(offers[r][2][i] for i in idx) for r, idx in want.items()}
