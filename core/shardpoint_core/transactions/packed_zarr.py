"""Third-party readers' access to a packed checkpoint ([SP-PACK-3]): :func:`zarr_store`, a
read-only zarr-python 3 store that opens every tensor where the per-array layout would have
it, and :func:`packed_manifest`, the checkpoint's manifest and index for such adapters (the
TensorStore export too). Above :mod:`.resolve`, whose default backend is the packed one."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from shardpoint_core.arrays.packed import _join
from shardpoint_core.arrays.packed_base import BasedStore
from shardpoint_core.format.errors import InvalidOptionError
from shardpoint_core.format.manifest import Manifest, decode_manifest
from shardpoint_core.format.packed import PackedIndex
from shardpoint_core.transactions.backend import ZarrBackend
from shardpoint_core.transactions.packed import PackedBackend
from shardpoint_core.transactions.resolve import resolve

__all__ = ["packed_manifest", "zarr_store"]


def packed_manifest(
    checkpoint: str, backend: Optional[Any], what: str
) -> Tuple[str, ZarrBackend, Manifest, PackedIndex]:
    """The resolved path, the reading backend, the manifest and its index of packed checkpoint
    ``checkpoint``, for the third-party readers' adapters (``what``: the caller, named in
    errors); InvalidOptionError for a checkpoint in the per-array layout, whose arrays
    third-party readers open where they lie (zarr_compat.zarr_path)."""
    path, be = resolve(checkpoint, backend, what)
    be = be.zarr if isinstance(be, PackedBackend) else be
    m = decode_manifest(be.read_manifest(path))
    if m.packed is None:
        raise InvalidOptionError(
            f"{what}: {checkpoint} is in the per-array layout, not packed: third-party "
            "readers open its arrays where they lie (zarr_compat.zarr_path)"
        )
    return path, be, m, m.packed


def zarr_store(checkpoint: str, *, backend: Optional[ZarrBackend] = None) -> Any:
    """A read-only zarr-python 3 store over a packed checkpoint (issue 30 item 2): every
    tensor opens as a Zarr v3 array at its array name, its ``zarr.json`` the one the index
    implies ([SP-PACK-3]) and its chunks the records' bytes, read by range::

        from shardpoint_core.transactions.zarr_compat import register_zarr_dtypes
        register_zarr_dtypes()                         # bfloat16, float8_*
        z = zarr.open_array(zarr_store("/ckpt/step_10"), path="tensors/model/w", mode="r")

    zarr-python checks each chunk's crc32c; the index's own checks ran when the manifest was
    read here. Needs the ``zarr`` extra."""
    from zarr.abc.store import OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
    from zarr.core.buffer import default_buffer_prototype

    from shardpoint_core.arrays.identity import chunk_number as number_of
    from shardpoint_core.arrays.packed_read import layout_of

    path, be, m, index = packed_manifest(checkpoint, backend, "zarr_store")
    bstore, prefix = be.locate(path)
    if index.bases:  # (incremental) chunks of its bases, read beside it ([SP-PACK-9])
        bstore = BasedStore(bstore, prefix, path, index.bases, "zarr_store", {})
    meta: Dict[str, bytes] = {"zarr.json": b'{"zarr_format": 3, "node_type": "group"}'}
    arrays: Dict[str, Any] = {}
    for e in m.tensors.values():
        lay = layout_of(e.spec, e.packed, e.key)
        meta[e.array + "/zarr.json"] = lay.zarr_json()
        arrays[e.array] = (e.packed, lay)
        parts = e.array.split("/")
        for i in range(1, len(parts)):  # the groups on the way ([SP-LAYOUT-5])
            meta["/".join(parts[:i]) + "/zarr.json"] = meta["zarr.json"]

    def locate_chunk(key: str) -> Optional[Tuple[str, int, int]]:
        name, sep, rest = key.rpartition("/c")
        if key.endswith("/c"):
            name, rest = key[:-2], ""
        elif not sep or not (rest == "" or rest.startswith("/")):
            return None
        found = arrays.get(name)
        if found is None:
            return None
        part, lay = found
        try:
            cidx = tuple(int(x) for x in rest.split("/")[1:])
        except ValueError:
            return None
        if len(cidx) != len(lay.shape) or any(not 0 <= i < g for i, g in zip(cidx, lay.grid())):
            return None
        obj, off, n, _crc = part.chunk(number_of(cidx, lay.shape, lay.chunk))
        return _join(prefix, obj), off, n

    def read(key: str, byte_range: Any) -> Optional[bytes]:
        where = None if key in meta else locate_chunk(key)
        if key in meta:
            lo, hi = 0, len(meta[key])
        elif where is None:
            return None
        else:
            lo, hi = 0, where[2]
        if isinstance(byte_range, RangeByteRequest):
            lo, hi = byte_range.start, min(hi, byte_range.end)
        elif isinstance(byte_range, OffsetByteRequest):
            lo = byte_range.offset
        elif isinstance(byte_range, SuffixByteRequest):
            lo = max(0, hi - byte_range.suffix)
        if where is None:
            return meta[key][lo:hi]
        obj, off, _n = where
        got: bytes = bstore.get_range(obj, off + lo, max(0, hi - lo))
        return got

    class PackedZarrStore(Store):
        # zarr's own base class
        """Read-only: the keys of a packed checkpoint as a per-array Zarr hierarchy."""

        supports_writes = False
        supports_deletes = False
        supports_partial_writes = False
        supports_listing = True

        def __init__(self) -> None:
            super().__init__(read_only=True)

        def __eq__(self, other: object) -> bool:
            return other is self

        async def get(self, key: str, prototype: Any = None, byte_range: Any = None) -> Any:
            raw = read(key, byte_range)
            if raw is None:
                return None
            return (prototype or default_buffer_prototype()).buffer.from_bytes(raw)

        async def get_partial_values(self, prototype: Any, key_ranges: Any) -> list[Any]:
            return [await self.get(k, prototype, r) for k, r in key_ranges]

        async def exists(self, key: str) -> bool:
            return key in meta or locate_chunk(key) is not None

        async def set(self, key: str, value: Any) -> None:
            raise PermissionError("a packed checkpoint is read-only")

        async def delete(self, key: str) -> None:
            raise PermissionError("a packed checkpoint is read-only")

        async def list(self) -> Any:
            for k in meta:
                yield k

        async def list_prefix(self, prefix: str) -> Any:
            for k in meta:
                if k.startswith(prefix):
                    yield k

        async def list_dir(self, prefix: str) -> Any:
            base = prefix.rstrip("/") + "/" if prefix else ""
            seen = set()
            for k in meta:
                if k.startswith(base):
                    head = k[len(base) :].split("/", 1)[0]
                    if head not in seen:
                        seen.add(head)
                        yield head

    return PackedZarrStore()
