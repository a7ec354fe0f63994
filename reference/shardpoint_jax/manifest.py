"""manifest.msgpack: the SHA-256 envelope and the body's checks (spec/format.md section 4,
versioning.md). Pure functions on bytes and dicts; reading the file is :mod:`.storage`'s job."""
from __future__ import annotations

import hashlib
import math
import re
import time
from typing import Any

import msgpack

from .dtypes import numpy_of
from .errors import CorruptCheckpointError, UnsupportedFormatError
from .keys import decode_component, encode_component
from .values import LIMITS, ext_hook, is_scalar_value, pack, unpack

FORMAT_VERSION = (1, 1)
WRITER = "shardpoint-jax/0.1.0"
MAX_MANIFEST_BYTES = 2 ** 30
TOP_FIELDS = {"format", "format_version", "writer", "created_unix", "save_world_size", "tree",
              "tensors", "objects", "extensions"}
TENSOR_FIELDS = {"array", "shape", "dtype", "chunk_shape"}
OBJECT_FIELDS = {"count", "values", "shape"}
PATH_COMPONENT = re.compile(r"[A-Za-z0-9_.~%-]+")


def corrupt(msg: str, sid: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(msg, spec_id=sid)


# -------------------------------------------------------------------------------- writing
def encode_manifest(tree: dict, tensors: dict, objects: dict, world: int) -> bytes:
    """The envelope bytes of a manifest body [SP-MAN-2] [SP-VER-1]."""
    body = {"format": "shardpoint", "format_version": list(FORMAT_VERSION), "writer": WRITER,
            "created_unix": time.time(), "save_world_size": world, "tree": tree,
            "tensors": tensors, "objects": objects}
    raw = pack(body)
    data = msgpack.packb({"sha256": hashlib.sha256(raw).digest(), "body": raw},
                         use_bin_type=True)
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"manifest would be {len(data)} bytes, over the 1 GiB "
                                     "limit; store big values as arrays", spec_id="SP-SEC-2")
    return data


# -------------------------------------------------------------------------------- reading
def decode_manifest(data: bytes) -> dict:
    """Check the envelope and the body; returns the body [SP-MAN-1..4] [SP-VER-2] [SP-VER-3]."""
    try:
        env = msgpack.unpackb(data, raw=False, strict_map_key=False, **LIMITS)
    except Exception as e:  # noqa: BLE001 - any decoding failure is damage
        raise corrupt(f"manifest envelope does not decode ({type(e).__name__}: {e})",
                      "SP-MAN-1") from None
    if (not isinstance(env, dict) or set(env) != {"sha256", "body"}
            or not isinstance(env["sha256"], bytes) or not isinstance(env["body"], bytes)
            or len(env["sha256"]) != 32):
        raise corrupt("manifest envelope must be a map of exactly 'sha256' (bin 32) and "
                      "'body' (bin)", "SP-MAN-1")
    if hashlib.sha256(env["body"]).digest() != env["sha256"]:
        raise corrupt("manifest body does not match its SHA-256 (damaged file)", "SP-MAN-1")
    try:
        body = msgpack.unpackb(env["body"], raw=False, strict_map_key=False,
                               ext_hook=_lazy_ext, **LIMITS)
    except CorruptCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        raise corrupt(f"manifest body does not decode ({type(e).__name__}: {e})",
                      "SP-MAN-1") from None
    check_body(body)
    return body


class LazyExt:
    """An ext value kept undecoded until known not to sit inside an ignorable field."""

    def __init__(self, code: int, payload: bytes) -> None:
        self.code, self.payload = code, payload


def _lazy_ext(code: int, payload: bytes) -> Any:
    return LazyExt(code, payload)


def resolve(v: Any, where: str) -> Any:
    """Decode the ext values inside ``v`` (values and object entries) [SP-VALUE-2]."""
    if isinstance(v, LazyExt):
        return ext_hook(v.code, v.payload)
    if isinstance(v, list):
        return [resolve(x, where) for x in v]
    if isinstance(v, dict):
        for k in v:
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise corrupt(f"{where}: map key {k!r} must be str or int", "SP-VALUE-2")
        return {k: resolve(x, where) for k, x in v.items()}
    return v


def _ignorable(field: str, v: Any, where: str) -> None:
    if not (isinstance(v, dict) and v.get("must_understand") is False):
        raise UnsupportedFormatError(f"{where}: unknown field {field!r} is not marked "
                                     "'must_understand': false; this reader (format "
                                     f"{FORMAT_VERSION[0]}.{FORMAT_VERSION[1]}) cannot read it",
                                     spec_id="SP-VER-3")


def check_body(body: Any) -> None:
    if not isinstance(body, dict) or body.get("format") != "shardpoint":
        raise corrupt("manifest body is not a map with format 'shardpoint'", "SP-MAN-2")
    ver = body.get("format_version")
    if (not isinstance(ver, list) or len(ver) != 2
            or not all(type(x) is int and x >= 0 for x in ver)):
        raise corrupt(f"format_version {ver!r} is not [major, minor]", "SP-MAN-2")
    if ver[0] != FORMAT_VERSION[0]:
        raise UnsupportedFormatError(f"checkpoint format {ver[0]}.{ver[1]}; this reader "
                                     f"implements {FORMAT_VERSION[0]}.x", spec_id="SP-VER-2")
    for f in ("tree", "tensors", "objects"):
        if not isinstance(body.get(f), dict):
            raise corrupt(f"manifest field {f!r} is missing or not a map", "SP-MAN-2")
    types = {"writer": (str,), "created_unix": (float, int), "save_world_size": (int,),
             "extensions": (dict,)}
    for f, v in body.items():
        if not isinstance(f, str):
            raise corrupt(f"manifest field name {f!r} is not a str", "SP-MAN-2")
        if f in types and (not isinstance(v, types[f]) or isinstance(v, bool)
                           or (f == "save_world_size" and v < 1)):
            raise corrupt(f"manifest field {f!r} has the wrong type ({v!r})", "SP-MAN-2")
        if f not in TOP_FIELDS:
            _ignorable(f, v, "manifest")
    for name, ext in body.get("extensions", {}).items():
        _ignorable(name, ext, "extensions")
    for key, t in body["tensors"].items():
        _check_tensor(key, t)
    for key, o in body["objects"].items():
        _check_object(key, o)
    _check_tree(body)


def _ints(v: Any, least: int) -> bool:
    return isinstance(v, list) and all(type(x) is int and x >= least for x in v)


def _check_tensor(key: Any, t: Any) -> None:
    if not isinstance(key, str) or not isinstance(t, dict):
        raise corrupt(f"tensor entry {key!r} is not a map under a str key", "SP-MAN-3")
    missing = TENSOR_FIELDS - set(t)
    if missing:
        raise corrupt(f"tensor {key!r}: missing {sorted(missing)}", "SP-MAN-3")
    for f, v in t.items():
        if f not in TENSOR_FIELDS:
            _ignorable(f, v, f"tensor {key!r}")
    numpy_of(t["dtype"], f"tensor {key!r}")
    if not _ints(t["shape"], 0) or not _ints(t["chunk_shape"], 1) or \
            len(t["shape"]) != len(t["chunk_shape"]):
        raise corrupt(f"tensor {key!r}: shape {t['shape']!r} / chunk_shape "
                      f"{t['chunk_shape']!r} malformed", "SP-MAN-3")
    check_array_path(key, t["array"])


def check_array_path(key: str, path: Any) -> None:
    """[SP-SEC-1]: relative, safe components only, checked before any file is opened."""
    if not isinstance(path, str) or not path or not all(
            PATH_COMPONENT.fullmatch(c) and c not in (".", "..") for c in path.split("/")):
        raise corrupt(f"tensor {key!r}: unsafe array path {path!r}", "SP-SEC-1")


def object_grid(key: str, o: dict) -> tuple:
    """The grid shape of an object entry: ``shape`` or ``(count,)`` [SP-OBJ-4]."""
    return tuple(o["shape"]) if "shape" in o else (o["count"],)


def _check_object(key: Any, o: Any) -> None:
    if not isinstance(key, str) or not isinstance(o, dict) or not {"count", "values"} <= set(o):
        raise corrupt(f"object entry {key!r} needs 'count' and 'values'", "SP-MAN-3")
    for f, v in o.items():
        if f not in OBJECT_FIELDS:
            _ignorable(f, v, f"object {key!r}")
    n, vals = o["count"], o["values"]
    if type(n) is not int or n < 1 or not isinstance(vals, list) or len(vals) != n:
        raise corrupt(f"object {key!r}: count {n!r} with {len(vals) if isinstance(vals, list) else vals!r} "
                      "values", "SP-MAN-3")
    if "shape" in o and (not _ints(o["shape"], 1) or not o["shape"]
                         or math.prod(o["shape"]) != n):
        raise corrupt(f"object {key!r}: grid shape {o['shape']!r} does not multiply to count "
                      f"{n}", "SP-OBJ-4")


def _check_tree(body: dict) -> None:
    root = body["tree"]
    if not (len(root) == 1 and next(iter(root)) in ("dict", "list", "tuple")):
        raise corrupt("tree root must be a dict, list or tuple node", "SP-MAN-4")
    seen_t, seen_o = set(), set()

    def walk(node: Any, path: list) -> None:
        if not isinstance(node, dict):
            raise corrupt(f"tree node at {path} is not a map", "SP-MAN-4")
        kinds = set(node) & {"dict", "list", "tuple", "tensor", "object", "value"}
        extra = set(node) - kinds - ({"origin"} if "tensor" in node else set())
        if len(kinds) != 1 or extra:
            raise corrupt(f"tree node at {path} has entries {sorted(map(str, node))}",
                          "SP-MAN-4")
        kind = kinds.pop()
        v = node[kind]
        if kind == "dict":
            if not isinstance(v, list):
                raise corrupt(f"dict node at {path} is not a list of pairs", "SP-MAN-4")
            ks = set()
            for pair in v:
                if (not isinstance(pair, list) or len(pair) != 2 or isinstance(pair[0], bool)
                        or not isinstance(pair[0], (str, int)) or pair[0] in ks):
                    raise corrupt(f"dict node at {path}: bad or repeated entry", "SP-MAN-4")
                ks.add(pair[0])
                walk(pair[1], path + [pair[0]])
        elif kind in ("list", "tuple"):
            if not isinstance(v, list):
                raise corrupt(f"{kind} node at {path} is not an array", "SP-MAN-4")
            for i, x in enumerate(v):
                walk(x, path + [i])
        elif kind == "value":
            if not (isinstance(v, LazyExt) or is_scalar_value(v)):
                raise corrupt(f"value leaf at {path} is not a scalar", "SP-MAN-4")
            if isinstance(v, LazyExt):
                val = ext_hook(v.code, v.payload)
                if not hasattr(val, "dtype") or getattr(val, "shape", None) != ():
                    raise corrupt(f"value leaf at {path}: only numpy scalars may be ext "
                                  "values", "SP-MAN-4")
                node["value"] = val
        else:
            table, seen = ((body["tensors"], seen_t) if kind == "tensor"
                           else (body["objects"], seen_o))
            key = "/".join(encode_component(c) for c in path) if path else ""
            for c in (key.split("/") if key else []):
                decode_component(c)
            if v != key or v not in table or v in seen:
                raise corrupt(f"{kind} leaf at {path} names {v!r}; expected its own key "
                              f"{key!r}, listed once in {kind}s", "SP-MAN-4")
            if kind == "tensor" and node.get("origin", "torch") not in ("torch", "numpy"):
                raise corrupt(f"tensor leaf {v!r}: origin {node['origin']!r}", "SP-MAN-4")
            seen.add(v)

    walk(root, [])
    for table, seen, kind in ((body["tensors"], seen_t, "tensor"),
                              (body["objects"], seen_o, "object")):
        for k in table:
            decode_key_checked(k)
            if k not in seen:
                raise corrupt(f"{kind} {k!r} is not in the tree", "SP-MAN-4")


def decode_key_checked(key: str) -> list:
    """The path of a stored key, refusing non-canonical ones [SP-KEY-3]."""
    if not key:
        raise corrupt("empty key", "SP-KEY-3")
    return [decode_component(c) for c in key.split("/")]


__all__ = ["encode_manifest", "decode_manifest", "resolve", "object_grid", "unpack"]
