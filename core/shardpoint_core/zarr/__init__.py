"""TensorStore (Zarr v3) storage backend for shardpoint: the high-throughput default."""
from shardpoint_core.zarr.backend import TensorStoreBackend
from shardpoint_core.zarr.layout import codecs_for

__all__ = ["TensorStoreBackend", "codecs_for"]
