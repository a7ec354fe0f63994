"""The manifest: the msgpack document that describes a checkpoint and commits it.

On disk (``manifest.msgpack``) it is an *envelope*, a msgpack map
``{"sha256": <32 bytes>, "body": <bytes>}`` where ``body`` is the msgpack-encoded manifest map
and ``sha256`` its SHA-256 ([SP-MAN-1]). The manifest map is described field by field in
spec/format.md and spec/schema/manifest.schema.json. Pure: bytes in, bytes out, no I/O.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence, TypeGuard

import msgpack
import numpy as np

from shardpoint_core.format import dtypes, values
from shardpoint_core.format.errors import (
    CorruptCheckpointError,
    InvalidKeyError,
    UnsupportedFormatError,
    UnsupportedValueError,
)
from shardpoint_core.format.keys import decode_key, encode_key
from shardpoint_core.format.packed import FIELD as PACKED, decode_packed, encode_packed
from shardpoint_core.format.statetree import typed_tree
from shardpoint_core.format.spec import ArraySpec


class ObjectValues(list[Any]):
    """The values of a sharded object in row-major grid order, with the grid's ``shape``
    (``(len(values),)`` for the 1-D grid every 1.0 checkpoint has)."""

    def __init__(self, values: Sequence[Any] = (), shape: Optional[Sequence[int]] = None) -> None:
        super().__init__(values)
        self.shape = tuple(shape) if shape is not None else (len(self),)

    def nested(self) -> list[Any]:
        """The values as nested lists following the grid (a flat list for a 1-D grid)."""
        return _nest(list(self), self.shape)


def _nest(flat: list[Any], shape: tuple[int, ...]) -> list[Any]:
    """``flat`` as nested lists of ``shape`` (module level, not a closure: no cycle)."""
    if len(shape) == 1:
        return list(flat)
    step = len(flat) // shape[0]
    return [_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def object_grid(values: Sequence[Any]) -> tuple[Any, ...]:
    """Grid shape of a sharded object's stored values (a plain list is a 1-D grid)."""
    return getattr(values, "shape", (len(values),))


def iter_tree_leaves(tree: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Yield ``(path, node)`` for every leaf node of a tree in its wire encoding (a plan's,
    or ``Manifest.wire_tree``); readers of a checkpoint walk ``Manifest.tree`` instead."""
    if "dict" in tree:
        for k, v in tree["dict"]:
            yield from iter_tree_leaves(v, path + (k,))
    elif "list" in tree or "tuple" in tree:
        for i, v in enumerate(tree.get("list", tree.get("tuple"))):
            yield from iter_tree_leaves(v, path + (i,))
    else:
        yield path, tree


FORMAT_NAME = "shardpoint"
FORMAT_VERSION = (1, 1)
#: What a writer writes when its manifest holds a 1.3 construct (a chunk table, [SP-MAN-7]);
#: without one the bytes are 1.1 bytes and say so ([SP-VER-1]).
FORMAT_VERSION_1_3 = (1, 3)
CHUNK_TABLE = "chunk_crc32c"  # the tensor-entry field of [SP-MAN-7] (1.3)
TENSOR_DIR = "tensors"
_TOP_FIELDS = {
    "format",
    "format_version",
    "writer",
    "created_unix",
    "save_world_size",
    "tree",
    "tensors",
    "objects",
    "extensions",
    PACKED,
}
_TENSOR_FIELDS = {"array", "shape", "dtype", "chunk_shape"}
_OBJECT_FIELDS = {"count", "values", "shape"}
_PATH_COMPONENT = re.compile(r"[A-Za-z0-9_.~%\-]+\Z")
_TREE_KINDS = {"dict", "list", "tuple", "tensor", "object", "value"}
TENSOR_ORIGINS = ("torch", "numpy")  # the closed set of a tensor leaf's origin ([SP-MAN-6])
MAX_MANIFEST_BYTES = 1 << 30  # manifest.msgpack's size cap ([SP-SEC-2])


@dataclass
class TensorEntry:
    key: str
    array: str  # path of the Zarr v3 array, relative to the checkpoint root
    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]
    #: (1.3) every stored unit's crc32c, 4 little-endian bytes each, units in grid order
    #: ([SP-MAN-7]); None when the writer recorded none
    chunk_crc32c: Optional[bytes] = None
    #: (1.4) the array's part of the packed index ([SP-PACK-*]); None in the per-array layout
    packed: Optional[Any] = None

    @property
    def spec(self) -> ArraySpec:
        return ArraySpec(self.shape, self.dtype, self.chunk_shape, self.chunk_crc32c, self.packed)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * dtypes.from_name(self.dtype).itemsize


@dataclass
class Manifest:
    """A decoded manifest. ``tree`` is the saved state's tree as users see it (typed leaves,
    :mod:`shardpoint_core.format.statetree`); ``wire_tree`` is the same tree in its wire encoding
    (``{"dict": [[k, node]]}``, [SP-MAN-4]), what writers build and the codec stores."""

    wire_tree: Any  # the tree in its wire encoding ([SP-MAN-4])
    tensors: dict[str, Any]  # key -> TensorEntry
    objects: dict[str, Any]  # key -> ObjectValues (row-major grid order)
    format_version: tuple[Any, ...] = FORMAT_VERSION
    writer: str = ""
    created_unix: float = 0.0
    save_world_size: int = 1
    extensions: dict[str, Any] = field(default_factory=dict)
    #: (1.4) the packed layout's index (:class:`~shardpoint_core.format.packed.PackedIndex`)
    packed: Optional[Any] = None
    _typed: Any = field(default=None, init=False, repr=False, compare=False)

    @property
    def tree(self) -> Any:
        """The tree of the saved state: nested dicts, lists and tuples whose leaves are
        :class:`~shardpoint_core.format.statetree.TensorLeaf`, ``ObjectLeaf`` and ``ValueLeaf``;
        walk it with :func:`~shardpoint_core.format.statetree.iter_leaves`. Built from
        ``wire_tree`` on first use and kept (decoding stays one pass), rebuilt if
        ``wire_tree`` is replaced."""
        cached = self._typed
        if cached is None or cached[0] is not self.wire_tree:
            cached = self._typed = (
                self.wire_tree,
                typed_tree(self.wire_tree, self.tensors, self.objects),
            )
        return cached[1]

    @property
    def state_tree(self) -> Any:
        """Alias of :attr:`tree` (its name before the typed tree became ``tree``)."""
        return self.tree


_WINDOWS_RESERVED = re.compile(r"(CON|PRN|AUX|NUL|COM[0-9]|LPT[0-9])\Z", re.I)
_ESCAPE = re.compile(r"%[0-9A-F]{2}")
MAX_PATH_COMPONENT = 255
MAX_ARRAY_PATH = 1024


def _case_marked(component: str) -> str:
    """``component`` + ``~<hex mask of its upper-case letters>`` when it has any ([SP-LAYOUT-4])."""
    letters = [c for c in _ESCAPE.sub("", component) if c.isascii() and c.isalpha()]
    mask = sum(1 << i for i, c in enumerate(letters) if c.isupper())
    return f"{component}~{mask:x}" if mask else component


def array_path_for(key: str) -> str:
    """Where a writer puts the array of ``key`` ([SP-LAYOUT-2], [SP-LAYOUT-4]).

    ``tensors/<key>``, with a case mark on components holding upper-case letters (so keys
    differing only in case stay apart on case-insensitive file systems), or
    ``tensors/~h/<sha256 of key>`` when a component would be over 255 bytes, end with ``.``
    or be a reserved Windows name, or the path would exceed 1024 bytes. Computed from the key
    alone, so every rank derives the same path; readers follow the manifest, never this.
    """
    parts = [_case_marked(c) for c in key.split("/")]
    path = "/".join([TENSOR_DIR] + parts)
    if len(path) > MAX_ARRAY_PATH or any(
        len(c) > MAX_PATH_COMPONENT or c.endswith(".") or _WINDOWS_RESERVED.match(c.split(".")[0])
        for c in parts
    ):
        return f"{TENSOR_DIR}/~h/{hashlib.sha256(key.encode()).hexdigest()}"
    return path


def key_of_array_path(path: str) -> Optional[str]:
    """The key whose array :func:`array_path_for` puts at ``path``, None where the path does
    not say it (a hashed path, or one not under ``tensors/``). For messages about an array
    being written, before any manifest names its key; readers follow the manifest."""
    parts = path.split("/")
    if len(parts) < 2 or parts[0] != TENSOR_DIR or parts[1] == "~h":
        return None
    return "/".join(re.sub(r"~[0-9a-f]+\Z", "", c) for c in parts[1:])


def check_array_path(p: Any, key: str) -> None:
    """Reject array paths that could leave the checkpoint directory ([SP-SEC-1])."""
    parts = p.split("/") if isinstance(p, str) else None
    if not parts or any(c in ("", ".", "..") or not _PATH_COMPONENT.match(c) for c in parts):
        raise CorruptCheckpointError(
            f"tensor {key!r}: array path {p!r} is not a safe relative "
            "path (components of [A-Za-z0-9_.~%-], no '.', '..' or "
            "empty parts)",
            spec_id="SP-SEC-1",
        )


def encode_manifest(m: Manifest) -> bytes:
    """Envelope bytes of a manifest ready to be written as the commit marker."""
    from shardpoint_core import __version__

    body = {
        "format": FORMAT_NAME,
        "format_version": list(m.format_version),
        "writer": m.writer or f"shardpoint-py/{__version__}",
        "created_unix": m.created_unix or time.time(),
        "save_world_size": m.save_world_size,
        "tree": m.wire_tree,
        "tensors": {k: _tensor_entry(e) for k, e in m.tensors.items()},
        "objects": {k: _object_entry(v) for k, v in m.objects.items()},
        "extensions": m.extensions,
    }
    if m.packed is not None:  # (1.4) the packed layout ([SP-PACK-2])
        body[PACKED] = encode_packed(m.packed, {e.array: e for e in m.tensors.values()})
    deep = values.nesting_depth_error(body)
    if deep:
        raise UnsupportedValueError(
            f"the state nests too deeply to be stored: the manifest "
            f"would exceed {values.MAX_DEPTH} levels at {deep}; "
            "flatten the tree",
            spec_id="SP-MAN-5",
        )
    raw = values.pack(body)
    data: bytes = msgpack.packb(
        {"sha256": hashlib.sha256(raw).digest(), "body": raw}, use_bin_type=True
    )
    if len(data) > MAX_MANIFEST_BYTES:  # no reader would open it
        raise UnsupportedValueError(
            f"the manifest would be {len(data)} bytes, over the "
            f"{MAX_MANIFEST_BYTES}-byte cap; store big values as "
            "arrays (tensors) instead",
            spec_id="SP-SEC-2",
        )
    return data


def _tensor_entry(e: TensorEntry) -> dict[str, Any]:
    """A tensor's manifest entry; the chunk table ([SP-MAN-7]) only where the writer has one,
    marked ignorable so that 1.1 and 1.2 readers read the entry as before ([SP-VER-3])."""
    entry: dict[str, Any] = {
        "array": e.array,
        "shape": list(e.shape),
        "dtype": e.dtype,
        "chunk_shape": list(e.chunk_shape),
    }
    if e.chunk_crc32c is not None:
        entry[CHUNK_TABLE] = {"must_understand": False, "crc32c": bytes(e.chunk_crc32c)}
    return entry


def chunk_table_of(key: str, v: Any) -> bytes:
    """The table of a tensor entry's ``chunk_crc32c`` field, checked ([SP-MAN-7]): exactly
    ``{"must_understand": false, "crc32c": <bin of 4 bytes per unit>}``."""
    if not (
        isinstance(v, dict)
        and set(v) == {"must_understand", "crc32c"}
        and v["must_understand"] is False
        and isinstance(v["crc32c"], bytes)
        and len(v["crc32c"]) % 4 == 0
    ):
        raise _bad(
            f"tensor {key!r}: field {CHUNK_TABLE!r} must be exactly "
            "{'must_understand': false, 'crc32c': <bin, 4 bytes per stored unit>}",
            "SP-MAN-7",
        )
    return v["crc32c"]


def _object_entry(v: list[Any]) -> dict[str, Any]:
    """A sharded object's manifest entry; ``shape`` only for a grid of 2+ dimensions, so a
    1-D object reads the same as in format 1.0 ([SP-OBJ-4])."""
    grid = object_grid(v)
    entry = {"count": len(v), "values": list(v)}
    if len(grid) != 1:
        entry["shape"] = list(grid)
    return entry


def _bad(msg: str, sid: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"manifest: {msg}", spec_id=sid)


def _ints(x: Any, minimum: int) -> TypeGuard[list[int]]:
    return isinstance(x, list) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= minimum for i in x
    )


def _unknown(fields: dict[str, Any], known: set[Any], where: str) -> None:
    for k, v in fields.items():
        if k in known:
            continue
        if isinstance(v, dict) and v.get("must_understand") is False:
            continue
        raise UnsupportedFormatError(
            f"manifest {where} has field {k!r} this reader does not "
            "understand (and it is not marked must_understand: false)",
            spec_id="SP-VER-3",
        )


ENVELOPE_HEAD = 32  # enough for a map header, a fixstr key and a bin header


def _bin_entry(b: bytes, pos: int) -> Optional[tuple[Any, ...]]:
    """(offset after a fixstr key and its bin value starting at ``pos``, the value's size)."""
    if pos >= len(b) or not 0xA0 <= b[pos] <= 0xBF:
        return None
    pos += 1 + (b[pos] & 0x1F)
    if pos >= len(b):
        return None
    width = {0xC4: 1, 0xC5: 2, 0xC6: 4}.get(b[pos])
    if width is None or pos + 1 + width > len(b):
        return None
    n = int.from_bytes(b[pos + 1 : pos + 1 + width], "big")
    return pos + 1 + width + n, n


def check_envelope_size(read_at: Any, size: int, where: str) -> None:
    """Refuse ([SP-MAN-1]) a manifest file of ``size`` bytes that is not exactly its
    envelope (trailing bytes, or cut short), from its headers alone, before the whole file
    is read (a 1 GiB file of one small envelope and garbage, sparse or not, costs a read of
    a few bytes). ``read_at(offset, n)`` reads the file. Unusual layouts pass: the decoder
    reports them."""
    head = read_at(0, ENVELOPE_HEAD)
    first = _bin_entry(head, 1) if head[:1] == b"\x82" else None
    if first is None:
        return
    second = _bin_entry(read_at(first[0], ENVELOPE_HEAD), 0)
    if second is None:
        return
    total = first[0] + second[0]
    if total != size:
        raise _bad(
            f"{where}: the envelope is {total} bytes but the file holds {size} "
            f"({'trailing bytes after it' if size > total else 'cut short'})",
            "SP-MAN-1",
        )


def decode_manifest(data: bytes) -> Manifest:
    """Parse and validate manifest bytes; raise the documented error for the first problem."""
    mv = memoryview(data)
    check_envelope_size(lambda at, n: bytes(mv[at : at + n]), len(data), "manifest")
    try:
        env = msgpack.unpackb(
            data, raw=False, object_pairs_hook=values.strict_pairs, **values.UNPACK_LIMITS
        )
    except Exception as e:
        if "exceeds max_" in str(e):
            raise _bad(f"a length exceeds the decoding caps ({e})", "SP-SEC-2") from e
        raise _bad(
            f"not a msgpack envelope ({type(e).__name__}: {e or 'no detail'}); "
            "truncated, nested too deeply or not a "
            "shardpoint manifest",
            "SP-MAN-1",
        ) from e
    if not (
        isinstance(env, dict)
        and set(env) == {"sha256", "body"}
        and isinstance(env["body"], bytes)
        and isinstance(env["sha256"], bytes)
        and len(env["sha256"]) == 32
    ):
        raise _bad(
            "envelope must be a map of exactly 'sha256' (32 bytes) and 'body' (bytes)", "SP-MAN-1"
        )
    if hashlib.sha256(env["body"]).digest() != env["sha256"]:
        raise _bad("SHA-256 of the body does not match the envelope (corrupted)", "SP-MAN-1")
    try:
        m = values.unpack(env["body"])
    except CorruptCheckpointError:
        raise
    except Exception as e:
        if "exceeds max_" in str(e):
            raise _bad(f"a length exceeds the decoding caps ({e})", "SP-SEC-2") from e
        raise _bad(
            f"body is not valid msgpack ({type(e).__name__}: {e or 'no detail'})", "SP-MAN-1"
        ) from e
    deep = values.nesting_depth_error(m)
    if deep:
        raise _bad(f"body nests deeper than {values.MAX_DEPTH} levels at {deep}", "SP-MAN-5")
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        raise _bad(f"'format' must be {FORMAT_NAME!r}", "SP-MAN-2")
    ver = m.get("format_version")
    if not (_ints(ver, 0) and len(ver) == 2):
        raise _bad(f"'format_version' must be [major, minor], got {ver!r}", "SP-MAN-2")
    if ver[0] != FORMAT_VERSION[0]:
        raise UnsupportedFormatError(
            f"checkpoint has format version {ver[0]}.{ver[1]}; this reader implements major "
            f"version {FORMAT_VERSION[0]}",
            spec_id="SP-VER-2",
        )
    _unknown(m, _TOP_FIELDS, "top level")
    for f, t in (("tree", dict), ("tensors", dict), ("objects", dict)):
        if not isinstance(m.get(f), t):
            raise _bad(f"field {f!r} is missing or not a map", "SP-MAN-2")
    exts = m.get("extensions", {})
    if not isinstance(exts, dict):
        raise _bad("'extensions' must be a map", "SP-MAN-2")
    _unknown(exts, set(), "extensions")
    for f, types in (
        ("writer", (str,)),
        ("created_unix", (int, float)),
        ("save_world_size", (int,)),
    ):
        if f in m and (
            isinstance(m[f], bool)
            or not isinstance(m[f], types)
            or (f == "save_world_size" and m[f] < 1)
        ):
            raise _bad(f"field {f!r} has the wrong type or value ({m[f]!r})", "SP-MAN-2")
    tensors = {}
    for key, ent in m["tensors"].items():
        try:
            decode_key(key)
        except InvalidKeyError as err:
            raise _bad(f"tensor key {key!r} is invalid: {err}", err.spec_id or "SP-KEY-3") from err
        if not isinstance(ent, dict):
            raise _bad(f"tensor {key!r}: entry must be a map", "SP-MAN-3")
        missing = sorted(_TENSOR_FIELDS - set(ent))
        if missing:
            raise _bad(f"tensor {key!r}: entry lacks {missing}", "SP-MAN-3")
        _unknown(ent, _TENSOR_FIELDS | {CHUNK_TABLE}, f"tensor {key!r}")
        shape, chunk, dt = ent.get("shape"), ent.get("chunk_shape"), ent.get("dtype")
        if not _ints(shape, 0) or not _ints(chunk, 1) or len(chunk) != len(shape):
            raise _bad(
                f"tensor {key!r}: shape {shape!r} / chunk_shape {chunk!r} invalid "
                "(non-negative ints; chunk entries >= 1, same rank)",
                "SP-MAN-3",
            )
        if len(shape) > values.MAX_RANK or any(n >= 1 << 63 for n in shape + chunk):
            raise _bad(
                f"tensor {key!r}: {len(shape)} dimensions or a dimension of 2^63 or "
                f"more (limits: {values.MAX_RANK} dimensions, each below 2^63)",
                "SP-SEC-2",
            )
        if not isinstance(dt, str):  # a malformed field, not an unknown dtype (1.3)
            raise _bad(f"tensor {key!r}: dtype {dt!r} is not a string", "SP-MAN-3")
        if dt not in dtypes.DTYPES:
            raise UnsupportedFormatError(
                f"tensor {key!r} has dtype {dt!r}, not in the spec's dtype table",
                spec_id="SP-DTYPE-1",
            )
        size = dtypes.from_name(dt).itemsize
        if math.prod(shape) * size >= 1 << 63 or math.prod(chunk) * size >= 1 << 63:
            raise _bad(
                f"tensor {key!r}: shape {shape} / chunk_shape {chunk} of {dt} hold "
                "2^63 bytes or more (1.2: a tensor's and a chunk's byte size are "
                "below 2^63)",
                "SP-SEC-2",
            )
        check_array_path(ent.get("array"), key)
        table = chunk_table_of(key, ent[CHUNK_TABLE]) if CHUNK_TABLE in ent else None
        tensors[key] = TensorEntry(key, ent["array"], tuple(shape), dt, tuple(chunk), table)
    objects = {}
    for key, o in m["objects"].items():
        try:
            decode_key(key)
        except InvalidKeyError as err:
            raise _bad(
                f"sharded object key {key!r} is invalid: {err}", err.spec_id or "SP-KEY-3"
            ) from err
        if not (
            isinstance(o, dict)
            and type(o.get("count")) is int
            and isinstance(o.get("values"), list)
            and o["count"] == len(o["values"])
            and o["count"] >= 1
        ):
            raise _bad(f"sharded object {key!r}: needs count >= 1 and as many values", "SP-MAN-3")
        _unknown(o, _OBJECT_FIELDS, f"sharded object {key!r}")
        grid = o.get("shape", [o["count"]])
        if not (_ints(grid, 1) and grid and math.prod(grid) == o["count"]):
            raise _bad(
                f"sharded object {key!r}: grid shape {grid!r} must be a non-empty list "
                f"of ints >= 1 whose product is count {o['count']}",
                "SP-OBJ-4",
            )
        objects[key] = ObjectValues(o["values"], grid)
    _check_distinct_arrays(tensors)
    _check_tree(m["tree"], tensors, objects)
    packed = None
    if PACKED in m:  # (1.4) the packed layout, checked after the tree
        packed = decode_packed(m[PACKED], {e.array: e for e in tensors.values()})
        for entry in tensors.values():
            entry.packed = packed.array(entry.array)
    return Manifest(
        m["tree"],
        tensors,
        objects,
        tuple(ver),
        m.get("writer", ""),
        m.get("created_unix", 0.0),
        m.get("save_world_size", 1),
        exts,
        packed,
    )


def _check_distinct_arrays(tensors: dict[str, Any]) -> None:
    """No two tensors share an array, and none lies inside another's ([SP-LAYOUT-2])."""
    paths = sorted((e.array + "/", k) for k, e in tensors.items())
    for (a, ka), (b, kb) in zip(paths, paths[1:]):
        if b.startswith(a):
            raise _bad(
                f"tensors {ka!r} and {kb!r} have array paths {a[:-1]!r} and "
                f"{b[:-1]!r}: one array inside or equal to another",
                "SP-LAYOUT-2",
            )


def _check_node(
    node: Any,
    path: tuple[Any, ...],
    tensors: dict[str, Any],
    objects: dict[str, Any],
    seen_t: set[Any],
    seen_o: set[Any],
) -> None:
    """One tree node for :func:`_check_tree` (a module-level function, not a closure, so a
    check leaves no reference cycle behind)."""
    if not isinstance(node, dict) or len(node) < 1:
        raise _bad(f"tree node at {path!r} is not a map", "SP-MAN-4")
    kinds = _TREE_KINDS.intersection(node)
    extra = set(node) - kinds - ({"origin"} if kinds == {"tensor"} else set())
    if len(kinds) != 1 or extra:
        raise _bad(
            f"tree node at {path!r} has entries {sorted(map(str, node))!r}; a node "
            "is exactly one of dict, list, tuple, tensor (with an optional origin), "
            "object, value",
            "SP-MAN-4",
        )
    if "origin" in node and node["origin"] not in TENSOR_ORIGINS:
        raise _bad(
            f"tensor leaf at {path!r} has origin {node['origin']!r}; the origins "
            f"are {', '.join(TENSOR_ORIGINS)} or none",
            "SP-MAN-4",
        )
    if "dict" in node:
        if not isinstance(node["dict"], list):
            raise _bad(f"tree dict at {path!r} must be a list of [key, node]", "SP-MAN-4")
        seen_keys: set[Any] = set()
        for item in node["dict"]:
            if not (
                isinstance(item, list)
                and len(item) == 2
                and isinstance(item[0], (str, int))
                and not isinstance(item[0], bool)
            ):
                raise _bad(f"tree dict at {path!r} has a malformed entry", "SP-MAN-4")
            if (type(item[0]), item[0]) in seen_keys:
                raise _bad(f"tree dict at {path!r} repeats key {item[0]!r}", "SP-MAN-4")
            seen_keys.add((type(item[0]), item[0]))
            _check_node(item[1], path + (item[0],), tensors, objects, seen_t, seen_o)
        return
    for kind in ("list", "tuple"):
        if kind in node:
            if not isinstance(node[kind], list):
                raise _bad(f"tree {kind} at {path!r} must be a list", "SP-MAN-4")
            for i, c in enumerate(node[kind]):
                _check_node(c, path + (i,), tensors, objects, seen_t, seen_o)
            return
    if "value" in node:
        try:  # a value's path is a key too ([SP-KEY-2]: "wherever a key appears")
            encode_key(path)
        except InvalidKeyError as e:
            raise _bad(f"tree path {path!r} cannot be a key: {e}", e.spec_id or "SP-KEY-2") from e
        v = node["value"]
        if not (
            v is None or isinstance(v, (bool, int, float, str, bytes)) or isinstance(v, np.generic)
        ):  # ext 1 only as a numpy scalar
            raise _bad(f"value leaf at {path!r} is a {type(v).__name__}, not a scalar", "SP-MAN-4")
        return
    for kind, table, seen in (("tensor", tensors, seen_t), ("object", objects, seen_o)):
        if kind in node:
            try:
                want = encode_key(path)
            except InvalidKeyError as e:
                raise _bad(
                    f"tree path {path!r} cannot be a key: {e}", e.spec_id or "SP-KEY-2"
                ) from e
            if node[kind] != want or want not in table:
                raise _bad(
                    f"tree leaf at {want!r} refers to {kind} {node[kind]!r}, which "
                    f"is not the {kind} entry for its path",
                    "SP-MAN-4",
                )
            if want in seen:
                raise _bad(f"{kind} {want!r} appears twice in the tree", "SP-MAN-4")
            seen.add(want)
            return
    raise _bad(f"tree node at {path!r} has unknown kind {sorted(node)!r}", "SP-MAN-4")


def _check_tree(tree: Any, tensors: dict[str, Any], objects: dict[str, Any]) -> None:
    """Every leaf names its own path's key, and every tensor/object is in the tree once."""
    seen_t: set[str] = set()
    seen_o: set[str] = set()
    if "dict" not in tree and "list" not in tree and "tuple" not in tree:
        # [SP-MAN-4], checked first: a leaf root also has an empty key ([SP-KEY-2]) (1.3)
        raise _bad("the tree root must be a dict, list or tuple", "SP-MAN-4")
    _check_node(tree, (), tensors, objects, seen_t, seen_o)
    for kind, table, seen in (("tensor", tensors, seen_t), ("object", objects, seen_o)):
        extra = set(table) - seen
        if extra:
            raise _bad(f"{kind} entries {sorted(extra)[:5]} are not in the tree", "SP-MAN-4")
