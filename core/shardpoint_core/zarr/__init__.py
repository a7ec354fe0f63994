"""The Zarr v3 format layer over a byte store (:class:`ZarrBackend`); ``TensorStoreBackend``
is its older name, kept for users and the README."""
from shardpoint_core.zarr.backend import TensorStoreBackend, ZarrBackend
from shardpoint_core.zarr.layout import codecs_for

__all__ = ["TensorStoreBackend", "ZarrBackend", "codecs_for"]
