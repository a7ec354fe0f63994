"""Zarr v3 group metadata of a checkpoint ([SP-LAYOUT-5]): a group ``zarr.json`` at the root
the manifest's array paths are relative to and at every directory between it and an array,
so that a generic Zarr reader (``zarr.open_group``) browses a checkpoint as a tree of groups.
Readers of the format never need them (they follow the manifest); writers write them last,
before the manifest, from the array paths the manifest records.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Optional

#: The bytes of every group's zarr.json (no attributes: nothing a reader needs lives here).
GROUP_JSON = b'{"zarr_format": 3, "node_type": "group"}\n'


def group_paths(array_paths: Iterable[str]) -> List[str]:
    """The groups of a checkpoint whose arrays lie at ``array_paths`` (relative, ``/``
    separated): ``""`` (the root) and every proper ancestor directory of an array, sorted."""
    out = {""}
    for a in array_paths:
        parts = a.split("/")
        out.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return sorted(out)


def group_keys(prefix: str, array_paths: Iterable[str]) -> List[str]:
    """The store keys of the group zarr.json files below ``prefix`` (``""``: the store's
    root)."""
    return ["/".join(p for p in (prefix, g, "zarr.json") if p) for g in group_paths(array_paths)]


def start_groups(store: Any, prefix: str, array_paths: Iterable[str], submit: Any) -> list[Any]:
    """Start the PUTs of every group zarr.json of a save below ``prefix`` (``submit``: a
    pool's ``submit``); the futures to wait for. On an object store they go in flight with
    the staged manifest, so they add no round trip; wait for them before the commit marker."""
    return [submit(store.put, k, GROUP_JSON) for k in group_keys(prefix, array_paths)]


def write_groups(store: Any, prefix: str, array_paths: Iterable[str], submit: Any = None) -> None:
    """Write every group zarr.json of a save below ``prefix`` of ``store`` (``submit``: a
    pool's ``submit`` to send them concurrently), then make them durable where the store needs
    that (local files: one ``syncfs`` or parallel fsyncs, [SP-COMMIT-1])."""
    keys = group_keys(prefix, array_paths)
    if submit is None:
        for k in keys:
            store.put(k, GROUP_JSON)
    else:
        for f in [submit(store.put, k, GROUP_JSON) for k in keys]:
            f.result()
    durable = getattr(store, "make_durable", None)
    if durable is not None and getattr(store.capabilities, "local_path", False):
        durable(keys)


def array_paths_of(manifest: bytes) -> Optional[List[str]]:
    """The array paths recorded by the manifest a writer is about to write (its own bytes,
    so unpacked without the reader's checks: a fraction of a full decode's time); None for
    bytes that are no manifest (nothing to write groups for)."""
    import msgpack

    try:
        body = msgpack.unpackb(
            msgpack.unpackb(manifest, raw=False)["body"],
            raw=False,
            strict_map_key=False,
            ext_hook=lambda code, data: None,
        )
        return [e["array"] for e in body["tensors"].values()]
    except Exception:  # noqa: BLE001 - not a manifest: the writer's error comes later
        return None
