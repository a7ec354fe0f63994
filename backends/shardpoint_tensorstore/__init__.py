"""TensorStore (Zarr v3) storage backend for shardpoint: the high-throughput default."""
from .backend import TensorStoreBackend
from .chunk_layout import codecs_for

__all__ = ["TensorStoreBackend", "codecs_for"]
