"""manifest.msgpack: the SHA-256 envelope and the body's checks (spec/format.md section 4,
versioning.md). Pure functions on bytes and dicts; reading the file is :mod:`.storage`'s job."""
from __future__ import annotations

import hashlib
import math
import re
import time
from typing import Any

import msgpack

from shardpoint_jax.dtypes import numpy_of
from shardpoint_jax.errors import (CorruptCheckpointError, UnsupportedFormatError,
                                   UnsupportedValueError)
from shardpoint_jax.keys import decode_component, encode_component
from shardpoint_jax.errors import InvalidKeyError
from shardpoint_jax.values import LIMITS, depth, is_scalar_value, pack, unpack

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
    if depth(body) > MAX_DEPTH:
        raise UnsupportedValueError(f"the tree nests deeper than the format's {MAX_DEPTH} "
                                    "levels (about 80 dicts)", spec_id="SP-MAN-5")
    raw = pack(body)
    data = msgpack.packb({"sha256": hashlib.sha256(raw).digest(), "body": raw},
                         use_bin_type=True)
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"manifest would be {len(data)} bytes, over the 1 GiB "
                                     "limit; store big values as arrays", spec_id="SP-SEC-2")
    return data


# -------------------------------------------------------------------------------- reading
MAX_DEPTH = 256


def decode_manifest(data: bytes) -> dict:
    """Check the envelope and the body, in the order of [SP-ERR-2]; returns the body with
    values decoded [SP-MAN-1..5] [SP-VER-2] [SP-VER-3]."""
    try:
        env = msgpack.unpackb(data, raw=False, strict_map_key=False, **LIMITS)
    except Exception as e:  # noqa: BLE001 - any decoding failure is damage
        raise corrupt(f"manifest envelope does not decode ({type(e).__name__}: {e})",
                      "SP-MAN-1") from None
    if (not isinstance(env, dict) or set(env) != {"sha256", "body"} or len(env) != 2
            or not isinstance(env["sha256"], bytes) or not isinstance(env["body"], bytes)
            or len(env["sha256"]) != 32):
        raise corrupt("manifest envelope must be a map of exactly 'sha256' (bin 32) and "
                      "'body' (bin)", "SP-MAN-1")
    if hashlib.sha256(env["body"]).digest() != env["sha256"]:
        raise corrupt("manifest body does not match its SHA-256 (damaged file)", "SP-MAN-1")
    try:
        body = unpack(env["body"])
    except CorruptCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        raise corrupt(f"manifest body does not decode ({type(e).__name__}: {e})",
                      "SP-MAN-1") from None
    if depth(body) > MAX_DEPTH:
        raise corrupt(f"manifest body nests deeper than {MAX_DEPTH} levels", "SP-MAN-5")
    check_body(body)
    return body


def resolve(v: Any, where: str) -> Any:
    """Object values are decoded with the body; kept for callers that want a hook."""
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
    for f in ("tree", "tensors", "objects"):
        if not isinstance(body.get(f), dict):
            raise corrupt(f"manifest field {f!r} is missing or not a map", "SP-MAN-2")
    for key, t in body["tensors"].items():
        _check_tensor(key, t)
    _check_paths_distinct(body["tensors"])
    for key, o in body["objects"].items():
        _check_object(key, o)
    _check_tree(body)


def _ints(v: Any, least: int) -> bool:
    return isinstance(v, list) and all(type(x) is int and x >= least for x in v)


def _check_paths_distinct(tensors: dict) -> None:
    """[SP-LAYOUT-2]: array paths distinct, none inside another's directory."""
    paths = sorted(t["array"] for t in tensors.values())
    for a, b in zip(paths, paths[1:]):
        if a == b or b.startswith(a + "/"):
            raise corrupt(f"array paths {a!r} and {b!r} would share files", "SP-LAYOUT-2")


def _check_tensor(key: Any, t: Any) -> None:
    if not isinstance(key, str) or not isinstance(t, dict):
        raise corrupt(f"tensor entry {key!r} is not a map under a str key", "SP-MAN-3")
    decode_key_checked(key)
    missing = TENSOR_FIELDS - set(t)
    if missing:
        raise corrupt(f"tensor {key!r}: missing {sorted(missing)}", "SP-MAN-3")
    for f, v in t.items():
        if f not in TENSOR_FIELDS:
            _ignorable(f, v, f"tensor {key!r}")
    if not _ints(t["shape"], 0) or not _ints(t["chunk_shape"], 1) or \
            len(t["shape"]) != len(t["chunk_shape"]):
        raise corrupt(f"tensor {key!r}: shape {t['shape']!r} / chunk_shape "
                      f"{t['chunk_shape']!r} malformed", "SP-MAN-3")
    numpy_of(t["dtype"], f"tensor {key!r}")
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
    decode_key_checked(key)
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
            if not is_scalar_value(v):
                raise corrupt(f"value leaf at {path} is not a scalar (only numpy scalars may "
                              "be ext values)", "SP-MAN-4")
        else:
            table, seen = ((body["tensors"], seen_t) if kind == "tensor"
                           else (body["objects"], seen_o))
            key = tree_key(path)
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
            if k not in seen:
                raise corrupt(f"{kind} {k!r} is not in the tree", "SP-MAN-4")


def decode_key_checked(key: str) -> list:
    """The path of a stored key: [SP-KEY-2] before [SP-KEY-3], both *corrupt*."""
    parts = key.split("/")
    if any(c in ("", ".", "..") for c in parts):
        raise corrupt(f"key {key!r} has an empty, '.' or '..' component", "SP-KEY-2")
    if len(key.encode()) > 4096:
        raise corrupt(f"key {key[:60]!r}... exceeds 4096 bytes", "SP-KEY-4")
    try:
        return [decode_component(c) for c in parts]
    except InvalidKeyError as e:
        raise corrupt(str(e).split("] ", 1)[-1], e.spec_id or "SP-KEY-3") from None


def tree_key(path: list) -> str:
    """The key of a tree path, stored dict keys being untrusted [SP-KEY-1] [SP-KEY-2]."""
    try:
        return "/".join(encode_component(c) for c in path)
    except InvalidKeyError as e:
        raise corrupt(f"tree path {path}: {str(e).split('] ', 1)[-1]}",
                      e.spec_id or "SP-KEY-2") from None


