"""The gather that sends each distinct blob once (Comm.gather_parts, shardpoint.exchange.dedup),
with real gloo processes: the coordinator gets every rank's parts exactly, identical blobs as
one object; run_collectively hands decide() the parts and forwards a rank's failure to all."""

import msgpack
import pytest

from shardpoint.exchange import dedup
from shardpoint.exchange.comm import Comm, run_collectively
from shardpoint_core.format import errors
from shardpoint_testing.launch import run_world


def _parts(rank):
    return [
        f"head {rank}".encode(),
        b"shared by all" * 20,
        f"only {rank}".encode() * 9,
        b"",
        *([b"odd ranks" * 30] if rank % 2 else []),
    ]


def _gather(rank, world):
    comm = Comm()
    got = comm.gather_parts(_parts(rank))
    if rank:
        return got
    ident = [got[r][1] is got[1][1] for r in range(world)]
    return [[bytes(b) for b in p] for p in got], ident, got[1][4] is got[3][4]


def test_gather_parts_delivers_every_ranks_parts_identical_blobs_once():
    out = run_world(4, _gather, timeout=90)
    assert out[1:] == [None, None, None]
    got, ident, odd_same = out[0]
    assert got == [_parts(r) for r in range(4)]
    assert all(ident) and odd_same  # the shared blobs arrived once, as one object


def _collective(rank, world, fail_rank):
    comm = Comm()

    def local():
        if rank == fail_rank:
            raise errors.InvalidShardingError("rank-local problem", spec_id="SP-PLAN-1")
        return [msgpack.packb(rank), b"same" * 50, bytes([rank]) * 10]

    def decide(payloads):
        assert all(isinstance(p, list) and len(p) == 3 for p in payloads)
        return [
            msgpack.packb([msgpack.unpackb(p[0]), p[1] == payloads[0][1], p[2]]) for p in payloads
        ]

    try:
        return msgpack.unpackb(run_collectively(comm, local, decide, errors.InvalidShardingError))
    except errors.InvalidShardingError as e:
        return f"error: {e}"


def test_run_collectively_with_parts_and_a_failing_rank():
    out = run_world(3, _collective, -1, timeout=90)
    assert out == [[r, True, bytes([r]) * 10] for r in range(3)]
    out = run_world(3, _collective, 2, timeout=90)
    assert all(o.startswith("error: ") and "rank-local problem" in o for o in out)


def test_assemble_refuses_a_blob_that_does_not_match_its_digest():
    parts = [[b"h0", b"a"], [b"h1", b"b"], [b"h2", b"a"]]
    offers = [dedup.read_offer(dedup.offer(p)[0]) for p in parts]
    want = dedup.requests(offers)
    assert want == {1: [0]}  # rank 2's blob is rank 0's: never sent
    assert dedup.assemble(offers, [b"a"], want, {1: b"b"}) == parts
    with pytest.raises(ValueError, match="digest"):
        dedup.assemble(offers, [b"a"], want, {1: b"c"})
    with pytest.raises(ValueError, match="asked for"):
        dedup.assemble(offers, [b"a"], want, {1: b"bb"})
