"""What a save is asked to do (:class:`SaveOptions`, the writer's knobs) and what it reports
(:class:`SaveResult`): the records :func:`~shardpoint.api.saving.run_save` and its callers
exchange, apart from the pipeline that uses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from shardpoint_core.format import errors
from shardpoint.api.async_save import check_priority
from shardpoint.planning.planner import PlanOptions
from shardpoint_core.format.compression import check_compression


@dataclass
class SaveOptions:
    """Writer knobs for ``save`` (none of them changes what a reader must understand)."""

    plan: PlanOptions = field(default_factory=PlanOptions)
    exchange_budget_bytes: int = 256 << 20
    cache_plan: bool = True  # reuse the last plan when no rank's structure changed
    device_staging_bytes: int = 256 << 20  # pinned bytes in flight for CUDA tensors (sync)
    # crc32c every holding and refuse replicas whose data differ ([SP-REPL-1]); one pass over
    # the state and one gather per save (see shardpoint.api.replicas and its benchmark)
    check_replicas: bool = False
    # CPU priority of an async save's background part: "low" (nice 19), "idle", "normal"
    async_priority: str = "low"
    # (format 1.5) "zstd": every chunk one zstd frame (Zarr v3's zstd codec, which
    # zarr-python and TensorStore read); None: uncompressed. compression_level: zstd's level
    # (-7 to 22, default 3). Needs the zstandard package (the zstd extra) to write and read.
    compression: Optional[str] = None
    compression_level: Optional[int] = None

    def __post_init__(self) -> None:
        check_priority(self.async_priority)
        try:
            check_compression(self.compression, self.compression_level)
        except ValueError as e:
            raise errors.InvalidOptionError(f"SaveOptions: {e}") from None


@dataclass
class SaveResult:
    """What a save did, for logs and benchmarks (same on every rank except ``rank_*``).
    ``chunks`` counts stored chunks (a shard is one); the checkpoint holds ``files`` files
    (or objects) in all: in the packed layout its data objects and the manifest; in the
    per-array one a file per chunk, a ``zarr.json`` per tensor and per Zarr group
    ([SP-LAYOUT-5]) and the manifest. ``rank_chunk_files`` of the chunks are this rank's."""

    path: str
    world_size: int
    tensors: int
    unique_bytes: int
    exchange_bytes: int
    chunks: int
    rank_bytes_written: int
    timings: dict
    files: int = 0
    rank_chunk_files: int = 0
