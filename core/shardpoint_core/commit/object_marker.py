"""The commit marker's bytes on an object store ([SP-COMMIT-11]): a save's manifest with its
save prefix in front of every array path, encoded once (or, for bytes, rewritten), the check
that a marker names only its own save's objects, and the array paths read back from one.

Kept apart from :mod:`.object_store`, whose committer PUTs and deletes, so that what the
marker's bytes are is in one place.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import List, Tuple

import msgpack

from shardpoint_core.format.errors import CorruptCheckpointError
from shardpoint_core.format.manifest import Manifest, decode_manifest, encode_manifest

__all__ = [
    "SAVE_PREFIX",
    "_array_dirs",
    "_check_marker",
    "_join",
    "_rewrite_array_paths",
    "encode_marker",
    "save_dir_of",
]

SAVE_PREFIX = "save-"  # a save's own prefix below its target: save-<token>


def _join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


def _rewrite_array_paths(envelope: bytes, save_dir: str, where: str) -> bytes:
    """The staged manifest with every array path moved below ``save_dir`` ([SP-COMMIT-11]).

    Works on the msgpack map itself, not on a decoded :class:`Manifest`, so that fields this
    implementation does not know (ignorable ones, extensions) travel unchanged."""
    try:
        env = msgpack.unpackb(envelope, raw=False, strict_map_key=False)
        body = env["body"]
        if hashlib.sha256(body).digest() != env["sha256"]:
            raise ValueError("sha256 mismatch")
        m = msgpack.unpackb(body, raw=False, strict_map_key=False)
        for entry in m["tensors"].values():
            entry["array"] = f"{save_dir}/{entry['array']}"
        packed = m.get("packed")  # (1.4) the data objects too ([SP-PACK-8])
        if isinstance(packed, dict):
            for obj in packed.get("objects", []) + packed.get("arrays", []):
                if len(obj) == 2:  # [path, size, base]: a base's object stays ([SP-PACK-9])
                    obj[0] = f"{save_dir}/{obj[0]}"
    except (ValueError, KeyError, TypeError, msgpack.ExtraData) as e:
        raise CorruptCheckpointError(
            f"staged manifest {where} is not a valid manifest ({e}); nothing was committed",
            spec_id="SP-MAN-1",
        ) from e
    new_body = msgpack.packb(m, use_bin_type=True)
    out: bytes = msgpack.packb(
        {"sha256": hashlib.sha256(new_body).digest(), "body": new_body}, use_bin_type=True
    )
    return out


def save_dir_of(staging: str) -> str:
    """The save prefix's own name (``save-<token>``) of the staging key ``staging``."""
    return _join(staging).rpartition("/")[2]


def encode_marker(m: Manifest, save_dir: str) -> bytes:
    """The commit marker of a save whose prefix is ``save_dir`` (``save-<token>``), encoded
    once: the manifest ``m`` (array paths relative to the save prefix) with ``save_dir/`` in
    front of every array path ([SP-COMMIT-11]). The bytes are those the 1.2 path (encode the
    manifest, then rewrite its array paths) gives for the same manifest."""
    tensors = {
        k: dataclasses.replace(e, array=f"{save_dir}/{e.array}") for k, e in m.tensors.items()
    }
    packed = m.packed
    if packed is not None:  # (1.4) its data objects and array names too ([SP-PACK-8])
        packed = dataclasses.replace(
            packed,
            objects=[  # a base's objects stay where its own marker put them ([SP-PACK-9])
                (p if packed.base_of(i) is not None else f"{save_dir}/{p}", s)
                for i, (p, s) in enumerate(packed.objects)
            ],
            arrays=[(f"{save_dir}/{n}", i) for n, i in packed.arrays],
        )
    return encode_manifest(dataclasses.replace(m, tensors=tensors, packed=packed))


def _array_dirs(envelope: bytes) -> Tuple[List[str], bool]:
    """The array paths a committed manifest names (what removing it must delete), and
    whether it is packed (1.4: its data objects lie below ``packed/`` of its save prefix)."""
    env = msgpack.unpackb(envelope, raw=False, strict_map_key=False)
    m = msgpack.unpackb(env["body"], raw=False, strict_map_key=False)
    return [e["array"] for e in m.get("tensors", {}).values()], "packed" in m


def _check_marker(marker: bytes, save_dir: str, target_url: str) -> None:
    """Every reader check passes before anything is visible, and the marker names only
    this save's objects ([SP-COMMIT-11]): one that named another prefix would make a
    later replacement delete that save's data. ``target_url``: the target, for the error."""
    m = decode_manifest(marker)
    stray = [e.array for e in m.tensors.values() if not e.array.startswith(save_dir + "/")]
    if m.packed is not None:  # its own data objects too; a base's lie in the base
        stray += [
            p
            for i, (p, _s) in enumerate(m.packed.objects)
            if m.packed.base_of(i) is None and not p.startswith(save_dir + "/")
        ]
    if stray:
        raise CorruptCheckpointError(
            f"{target_url}: the marker of {save_dir} names {stray[0]!r}, "
            f"not below {save_dir}/; nothing was committed",
            spec_id="SP-COMMIT-11",
        )
