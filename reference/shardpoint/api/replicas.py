"""The replica check of a save ([SP-REPL-1]): holdings of one region MUST hold equal data.

Each rank sends the crc32c of every holding it has (key, region, checksum: a few dozen bytes
each); the coordinator groups them by region and refuses, on every rank and before any byte
is written, a region whose replicas differ, naming the key, the region and the ranks. Costs
one pass over the state's bytes per rank (crc32c, hardware-accelerated) and one gather:
opt-in through ``SaveOptions(check_replicas=True)`` (``benchmarks/bench_replica_check.py``
measures it against the save).
"""

from __future__ import annotations


import crc32c
import msgpack
import torch

from shardpoint_core.format import errors
from shardpoint.exchange.comm import Comm, run_collectively


def holding_crc(data: torch.Tensor) -> int:
    """crc32c of a holding's bytes in row-major order (a CUDA tensor is copied to host)."""
    t = data.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return 0
    return crc32c.crc32c(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def check_replicas(comm: Comm, tensors: list) -> None:
    """Collective: refuse replicas with different data (``tensors``: this rank's
    :class:`~shardpoint.tree.model.LocalTensor` list)."""

    def local() -> bytes:
        return msgpack.packb(
            [
                [
                    lt.holding.key,
                    list(lt.holding.offset),
                    list(lt.holding.shape),
                    list(lt.holding.flat) if lt.holding.flat else None,
                    holding_crc(lt.data),
                ]
                for lt in tensors
            ]
        )

    def decide(payloads: list) -> list:
        seen: dict = {}
        for rank, p in enumerate(payloads):
            for key, off, shape, flat, crc in msgpack.unpackb(p):
                region = (key, tuple(off), tuple(shape), tuple(flat) if flat else None)
                seen.setdefault(region, {}).setdefault(crc, []).append(rank)
        for (key, off, shape, flat), crcs in seen.items():
            if len(crcs) > 1:
                groups = "; ".join(f"ranks {r[:4]} hold crc32c {c:08x}" for c, r in crcs.items())
                raise errors.InvalidShardingError(
                    f"tensor {key!r}: the replicas of region offset {list(off)} shape "
                    f"{list(shape)}{f' flat {list(flat)}' if flat else ''} differ ({groups}); "
                    "replicas must be equal: a diverged data-parallel rank, or a holding "
                    "marked as a replica that is not one",
                    spec_id="SP-REPL-1",
                )
        return [b""] * len(payloads)

    run_collectively(comm, local, decide, errors.InvalidShardingError)


__all__ = ["check_replicas", "holding_crc"]
