"""TensorStore over a packed checkpoint (format 1.4, spec/format.md section 13), without a
copy of its bytes: :func:`export_tensorstore` writes a small OCDBT database
(:mod:`~shardpoint_core.arrays.ocdbt`) in a directory of its own whose keys are the
checkpoint as a per-array Zarr v3 hierarchy (each array's ``zarr.json`` the one the index
implies, [SP-PACK-3], and each chunk key an indirect reference to the chunk's bytes in its
data object), and the TensorStore kvstore spec that opens it: an ``ocdbt`` store over a
``kvstack`` whose first layer is the export directory and whose second maps ``c/`` onto the
checkpoint's root. The checkpoint is not touched, and the export is a few bytes per chunk.

Why not at commit: the packed layout names only the manifest and its data objects as the
checkpoint ([SP-PACK-8]), and OCDBT is TensorStore's format, marked experimental there; an
export the user asks for (``shardpoint export-tensorstore``) keeps both out of the format.
TensorStore checks each chunk's crc32c as it reads; the index's own checks run here, when the
manifest is decoded.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from shardpoint_core.arrays.array import chunk_key
from shardpoint_core.arrays.groups import GROUP_JSON
from shardpoint_core.arrays.ocdbt import Ref, Value, encode_tree
from shardpoint_core.arrays.packed_read import layout_of
from shardpoint_core.format.errors import CheckpointExistsError, InvalidOptionError
from shardpoint_core.stores.base import ByteStore

SPEC_NAME = "kvstore.json"  # the export's TensorStore kvstore spec, beside manifest.ocdbt
_DATA = "c/"  # the kvstack prefix that maps onto the checkpoint's root
_BASES = "b/"  # b/<name>/: onto the root of base checkpoint <name>, the checkpoint's sibling


def _ts_url(path: str) -> Tuple[str, Any]:
    """``(URL TensorStore's drivers reach, its kvstore spec with a trailing '/')`` of a
    local path or an ``s3://``/``gs://`` URL (``tensorstore+`` prefixes dropped)."""
    from shardpoint_core.stores.registry import is_local, local_path
    from shardpoint_core.stores.tensorstore import TensorStoreStore, parse_url

    url = os.path.abspath(local_path(path, "export_tensorstore")) if is_local(path) else path
    driver = parse_url(url)[0]
    if driver not in ("file", "s3", "gcs"):
        raise InvalidOptionError(
            f"{path}: TensorStore reaches files, s3:// and gs://, not {driver}:// stores"
        )
    spec = dict(TensorStoreStore(url).kvstore_spec())
    spec.pop("use_conditional_write", None)  # read-only use
    spec["path"] = spec["path"].rstrip("/") + "/" if spec.get("path") else ""
    return url, spec


def _data_key(path: str) -> str:
    """The export's key of a data object: ``c/<path>`` below the checkpoint's root, or
    ``b/<base>/<path>`` for an object of a base checkpoint (an incremental one names it
    ``../<base>/<path>``, beside the checkpoint)."""
    if path.startswith("../"):
        return _BASES + path[3:]
    return _DATA + path


def _base_names(m: Any) -> List[str]:
    """The checkpoints this one builds on ([SP-PACK-9]), each a sibling by name."""
    return sorted(name for name, _identity in m.packed.bases)


def _entries(m: Any) -> List[Tuple[bytes, Value]]:
    """Every key of the hierarchy: groups, arrays' zarr.json, chunks as references."""
    out: Dict[bytes, Value] = {b"zarr.json": GROUP_JSON}
    for e in m.tensors.values():
        lay = layout_of(e.spec, e.packed, e.key)
        parts = e.array.split("/")
        for i in range(1, len(parts)):  # the groups on the way ([SP-LAYOUT-5])
            out["/".join(parts[:i]).encode() + b"/zarr.json"] = GROUP_JSON
        out[e.array.encode() + b"/zarr.json"] = lay.zarr_json()
        rec = e.packed.records
        grid = lay.grid()
        objects = [_data_key(p) for p, _size in e.packed.objects]
        cidxs = np.ndindex(*grid) if lay.shape else iter([()])
        for c, cidx in enumerate(cidxs):
            r = rec[c]
            out[chunk_key(e.array, cidx).encode()] = Ref(
                objects[int(r["object"])], int(r["offset"]), int(r["length"])
            )
    return sorted(out.items())


def export_tensorstore(
    checkpoint: str, out: str, *, backend: Optional[Any] = None, overwrite: bool = False
) -> dict[str, Any]:
    """Write the OCDBT export of packed checkpoint ``checkpoint`` into directory ``out``
    (local, ``s3://`` or ``gs://``) and return the TensorStore kvstore spec that opens it
    (also written to ``out/kvstore.json``)::

        kv = export_tensorstore("ckpt/step_10", "ckpt/step_10.ts")
        t = ts.open({"driver": "zarr3", "kvstore": {**kv, "path": "tensors/model/w/"}})

    An export already at ``out`` is replaced only with ``overwrite=True``
    (CheckpointExistsError otherwise); a checkpoint in the per-array layout needs none (its
    arrays open as they are: InvalidOptionError)."""
    from shardpoint_core.stores.registry import bucket_store, is_local, local_path
    from shardpoint_core.stores.files import FileStore
    from shardpoint_core.transactions.packed_zarr import packed_manifest

    path, _be, m, _index = packed_manifest(checkpoint, backend, "export_tensorstore")
    _url, ckpt_spec = _ts_url(path)
    _out_url, out_spec = _ts_url(out)
    store: ByteStore
    if is_local(out):
        root = local_path(out, "export_tensorstore")
        os.makedirs(root, exist_ok=True)
        store, key = FileStore(str(root)), ""
    else:
        store, key = bucket_store(out, "export_tensorstore")
    at = (key + "/") if key else ""
    if store.head(at + "manifest.ocdbt") is not None and not overwrite:
        raise CheckpointExistsError(
            f"{out}: an OCDBT export is there already (overwrite=True replaces it)"
        )
    node = "d/shardpoint"  # one name: an overwrite replaces it, never leaves an old one
    nodes, manifest = encode_tree(_entries(m), node, commit_time_ns=time.time_ns())
    layers = [{"base": out_spec}, {"base": ckpt_spec, "prefix": _DATA}]
    parent = path.rstrip("/").rsplit("/", 1)[0] if "/" in path.rstrip("/") else "."
    for name in _base_names(m):
        layers.append({"base": _ts_url(f"{parent}/{name}")[1], "prefix": f"{_BASES}{name}/"})
    spec = {"driver": "ocdbt", "base": {"driver": "kvstack", "layers": layers}}
    store.put(at + node, nodes)
    store.put(at + SPEC_NAME, json.dumps(spec, indent=1, sort_keys=True).encode())
    store.put(at + "manifest.ocdbt", manifest)  # last: the export exists once it is there
    return spec
