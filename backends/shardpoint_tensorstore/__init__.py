"""TensorStore (Zarr v3) storage backend for shardpoint: the high-throughput default."""
from .backend import TensorStoreBackend, codecs_for

__all__ = ["TensorStoreBackend", "codecs_for"]
