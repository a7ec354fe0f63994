"""A read-only OCDBT database (TensorStore's ``ocdbt`` key-value store) whose values are
byte ranges of existing files: how TensorStore reads a packed checkpoint without a copy.

OCDBT is TensorStore's b-tree over a base key-value store (format in TensorStore's
``kvstore/ocdbt`` documentation). A leaf entry's value is either inline or an *indirect
reference* ``(data file, offset, length)``, and data files may have any path, so a small
database can name chunk bytes where they already lie: here the chunks of a packed
checkpoint's data objects. This module encodes such a database, uncompressed, one version
(generation 1): :func:`encode_tree` gives the b-tree nodes and the manifest's bytes for a
sorted list of entries. It knows nothing of checkpoints (:mod:`~shardpoint_core.transactions.
ts_export` maps one onto entries) and reads nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Sequence, Tuple, Union

import crc32c

MANIFEST_MAGIC = 0x0CDB3A2A
BTREE_MAGIC = 0x0CDB20DE
ARITY_LOG2 = 4  # version tree arity (TensorStore's default): one version needs no node
NODE_BYTES = 1 << 20  # a leaf is closed past this many encoded bytes
MAX_NODE_BYTES = 8 << 20  # the config's max_decoded_node_bytes (TensorStore's default)
_NONE = (1 << 64) - 1  # offset and length of "no node"


@dataclass(frozen=True)
class Ref:
    """A value stored out of line: ``length`` bytes at ``offset`` of data file ``path``
    (a key of the database's base store)."""

    path: str
    offset: int
    length: int


Value = Union[bytes, Ref]


def varint(n: int) -> bytes:
    """LEB128, as OCDBT's ``varint``."""
    if n < 0:
        raise ValueError(f"varint of {n}")
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _common(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _framed(magic: int, body: bytes) -> bytes:
    """Outer header (magic, length, version 0, uncompressed), body, crc32c footer."""
    head_len = 4 + 8 + 1 + 1
    total = head_len + len(body) + 4
    out = magic.to_bytes(4, "big") + total.to_bytes(8, "little") + b"\0\0" + body
    return out + crc32c.crc32c(out).to_bytes(4, "little")


def _file_table(paths: Sequence[str]) -> bytes:
    """Data file table: every base path empty, paths prefix-compressed."""
    enc = [p.encode() for p in paths]
    prefix = [_common(enc[i], enc[i + 1]) for i in range(len(enc) - 1)]
    suffix = [e[(prefix[i - 1] if i else 0) :] for i, e in enumerate(enc)]
    return b"".join(
        [varint(len(enc))]
        + [varint(p) for p in prefix]
        + [varint(len(s)) for s in suffix]
        + [varint(0) for _ in enc]
        + suffix
    )


def _keys(keys: Sequence[bytes]) -> Tuple[bytes, bytes, List[bytes]]:
    prefix = [_common(keys[i], keys[i + 1]) for i in range(len(keys) - 1)]
    suffix = [k[(prefix[i - 1] if i else 0) :] for i, k in enumerate(keys)]
    return (
        b"".join(varint(p) for p in prefix),
        b"".join(varint(len(s)) for s in suffix),
        suffix,
    )


def leaf_node(entries: Sequence[Tuple[bytes, Value]]) -> bytes:
    """A b-tree leaf (height 0) holding ``entries`` (sorted keys, full keys: the root's
    children carry no common prefix)."""
    files = sorted({v.path for _k, v in entries if isinstance(v, Ref)})
    fid = {p: i for i, p in enumerate(files)}
    pre, suf_len, suf = _keys([k for k, _v in entries])
    body = [b"\0", _file_table(files), varint(len(entries)), pre, suf_len, *suf]
    body += [varint(v.length if isinstance(v, Ref) else len(v)) for _k, v in entries]
    body += [varint(1 if isinstance(v, Ref) else 0) for _k, v in entries]
    refs = [v for _k, v in entries if isinstance(v, Ref)]
    body += [varint(fid[r.path]) for r in refs]
    body += [varint(r.offset) for r in refs]
    body += [v for _k, v in entries if not isinstance(v, Ref)]
    return _framed(BTREE_MAGIC, b"".join(body))


@dataclass(frozen=True)
class NodeRef:
    """Where an encoded node lies and what its subtree holds (the statistics OCDBT keeps)."""

    first_key: bytes
    path: str
    offset: int
    length: int
    height: int
    num_keys: int
    tree_bytes: int
    indirect_bytes: int


def interior_node(children: Sequence[NodeRef]) -> bytes:
    """A b-tree interior node over ``children`` (each keyed by its first key, no common
    subtree prefix)."""
    files = sorted({c.path for c in children})
    fid = {p: i for i, p in enumerate(files)}
    pre, suf_len, suf = _keys([c.first_key for c in children])
    body = [
        bytes([children[0].height + 1]),
        _file_table(files),
        varint(len(children)),
        pre,
        suf_len,
        b"".join(varint(0) for _ in children),  # subtree_common_prefix_length
        *suf,
    ]
    for field in ("fid", "offset", "length", "num_keys", "tree_bytes", "indirect_bytes"):
        body += [varint(fid[c.path] if field == "fid" else getattr(c, field)) for c in children]
    return _framed(BTREE_MAGIC, b"".join(body))


def manifest(root: NodeRef, *, uuid: bytes, commit_time_ns: int, max_inline: int) -> bytes:
    """``manifest.ocdbt``: the configuration and one version (generation 1) whose b-tree
    root is ``root``."""
    config = (
        uuid
        + varint(0)  # manifest kind: single
        + varint(max_inline)
        + varint(MAX_NODE_BYTES)
        + bytes([ARITY_LOG2])
        + varint(0)  # no compression
    )
    versions = b"".join(
        [
            varint(1),  # one version
            varint(1),  # generation 1
            bytes([root.height]),
            varint(0),  # data file 0 of the table
            varint(root.offset),
            varint(root.length),
            varint(root.num_keys),
            varint(root.tree_bytes),
            varint(root.indirect_bytes),
            commit_time_ns.to_bytes(8, "little"),
        ]
    )
    body = config + _file_table([root.path]) + versions + varint(0)  # no version nodes
    return _framed(MANIFEST_MAGIC, body)


def encode_tree(
    entries: Sequence[Tuple[bytes, Value]],
    node_path: str,
    *,
    commit_time_ns: int = 0,
    uuid: bytes = b"",
) -> Tuple[bytes, bytes]:
    """``(the b-tree nodes, back to back, to store at base key node_path; manifest.ocdbt)``
    for ``entries`` (keys sorted, distinct, at least one)."""
    if not entries:
        raise ValueError("an OCDBT export needs at least one key")
    keys = [k for k, _v in entries]
    if any(a >= b for a, b in zip(keys, keys[1:])):
        raise ValueError("OCDBT keys must be sorted and distinct")
    out = bytearray()
    level: List[NodeRef] = []
    max_inline = max([len(v) for _k, v in entries if not isinstance(v, Ref)] + [0])
    start = 0
    size = 0
    for i, (k, v) in enumerate(entries):
        size += len(k) + 24 + (0 if isinstance(v, Ref) else len(v))
        if size >= NODE_BYTES or i == len(entries) - 1:
            part = entries[start : i + 1]
            node = leaf_node(part)
            level.append(
                NodeRef(
                    part[0][0],
                    node_path,
                    len(out),
                    len(node),
                    0,
                    len(part),
                    len(node),
                    sum(v.length for _k, v in part if isinstance(v, Ref)),
                )
            )
            out += node
            start, size = i + 1, 0
    fan = 1 << 14  # children per interior node: well below MAX_NODE_BYTES
    while len(level) > 1:
        up: List[NodeRef] = []
        for j in range(0, len(level), fan):
            kids = level[j : j + fan]
            node = interior_node(kids)
            up.append(
                NodeRef(
                    kids[0].first_key,
                    node_path,
                    len(out),
                    len(node),
                    kids[0].height + 1,
                    sum(c.num_keys for c in kids),
                    len(node) + sum(c.tree_bytes for c in kids),
                    sum(c.indirect_bytes for c in kids),
                )
            )
            out += node
        level = up
    m = manifest(
        level[0],
        uuid=uuid or os.urandom(16),
        commit_time_ns=commit_time_ns,
        max_inline=max_inline,
    )
    return bytes(out), m
