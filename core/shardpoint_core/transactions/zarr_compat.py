"""Reading shardpoint checkpoints with zarr-python: the spec's extension data types and where
an array lives.

zarr-python 3 knows the core Zarr v3 data types; ``bfloat16``, ``float8_e4m3fn`` and
``float8_e5m2`` are extension data types (spec/format.md section 7, "Data types and Zarr")
that :func:`register_zarr_dtypes` teaches it, so every dtype of the spec's table opens.
:func:`zarr_path` resolves a tensor key to its array's location through the manifest, since
readers follow the manifest's array path ([SP-LAYOUT-2]): on object stores that path lies
below the save's prefix ``save-<token>/`` ([SP-LAYOUT-4]), and :func:`zarr_group_path` finds the
root group there ([SP-LAYOUT-5]). zarr-python is imported only by
:func:`register_zarr_dtypes` (the ``zarr`` extra)::

    import zarr
    from shardpoint_core.transactions.zarr_compat import register_zarr_dtypes, zarr_group_path, zarr_path
    register_zarr_dtypes()
    arr = zarr.open_array(zarr_path("s3://bucket/ckpt", "model/w"), mode="r")
    root = zarr.open_group(zarr_group_path("s3://bucket/ckpt"), mode="r")   # its groups
"""

from __future__ import annotations

from typing import Any, Dict

from shardpoint_core.format.dtypes import DTYPES

#: The dtypes of the spec's table that are not core Zarr v3 data types.
EXTENSION_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
_registered: Dict[str, Any] = {}


def _constant_property(n: int) -> property:
    """A read-only property whose value is ``n`` (a dtype class's ``item_size``)."""

    def get(self: Any) -> int:
        return n

    return property(get)


def register_zarr_dtypes() -> None:
    """Register the spec's extension data types with zarr-python 3 (idempotent): each reads
    and writes its little-endian bytes as the ml_dtypes scalar type of section 5."""
    from dataclasses import dataclass

    from zarr.core.dtype import data_type_registry
    from zarr.core.dtype.npy.float import BaseFloat

    for name in EXTENSION_DTYPES:
        cls = _registered.get(name)
        if cls is None:
            np_dt = DTYPES[name].numpy
            cls = dataclass(frozen=True, kw_only=True)(
                type(
                    f"ShardpointZarr_{name}",
                    (BaseFloat,),
                    {
                        "dtype_cls": type(np_dt),
                        "_zarr_v3_name": name,
                        "_zarr_v2_names": (),
                        "item_size": _constant_property(np_dt.itemsize),
                        "__doc__": f"The spec's {name} (spec/format.md section 5) for zarr-python.",
                    },
                )
            )
            _registered[name] = cls
        data_type_registry.register(name, cls)


def zarr_group_path(checkpoint: str) -> str:
    """The location of the checkpoint's root Zarr group ([SP-LAYOUT-5]), for
    ``zarr.open_group``: the checkpoint itself on files, its committed save's prefix
    ``<checkpoint>/save-<token>`` on object stores (read from the manifest)."""
    from shardpoint_core.format.manifest import decode_manifest
    from shardpoint_core.transactions.backend import ZarrBackend

    m = decode_manifest(ZarrBackend().read_manifest(checkpoint))
    heads = {e.array.split("/", 1)[0] for e in m.tensors.values()}
    if len(heads) == 1 and next(iter(heads)).startswith("save-"):
        return f"{checkpoint.rstrip('/')}/{heads.pop()}"
    return checkpoint


def zarr_path(checkpoint: str, key: str) -> str:
    """The location (path or URL) of tensor ``key``'s Zarr array in ``checkpoint``, as its
    manifest records it ([SP-LAYOUT-2]): ``<checkpoint>/tensors/...`` on files,
    ``<checkpoint>/save-<token>/tensors/...`` on object stores. Raises ``KeyError`` for a key
    the checkpoint does not hold."""
    from shardpoint_core.format.manifest import decode_manifest
    from shardpoint_core.stores.registry import is_local
    from shardpoint_core.transactions.backend import ZarrBackend

    m = decode_manifest(ZarrBackend().read_manifest(checkpoint))
    try:
        array = m.tensors[key].array
    except KeyError:
        raise KeyError(f"{checkpoint} holds no tensor {key!r}") from None
    if is_local(checkpoint):
        import os

        return os.path.join(checkpoint, *array.split("/"))
    return f"{checkpoint.rstrip('/')}/{array}"
