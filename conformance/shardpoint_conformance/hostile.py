"""Hostile checkpoints built byte by byte, and a memory-bounded subprocess to read them in.

What an attacker (or a bad disk) hands a reader: values nested past the decoder's stack, a
``zarr.json`` nested past the JSON parser's, a small shard declaring gigabytes. Used by the
tests, the fuzzer (:mod:`.fuzz`) and the spec's 1.2 vectors. Only msgpack, crc32c and the
standard library: the bytes are spelled out here, not produced by the core under test.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import uuid
from typing import Any, Callable, Optional

import crc32c
import msgpack

MANIFEST = "manifest.msgpack"
EMPTY = 2**64 - 1


def read_body(root: str) -> dict:
    """The manifest body of the checkpoint at ``root`` as plain msgpack data (ext types kept
    as :class:`msgpack.ExtType`)."""
    env = msgpack.unpackb(open(os.path.join(root, MANIFEST), "rb").read())
    return msgpack.unpackb(env["body"], strict_map_key=False)


def write_body(root: str, body: Any, raw: Optional[bytes] = None) -> None:
    """Seal ``body`` (or the ready msgpack bytes ``raw``) into the envelope with the right
    SHA-256, so only the rule under test can refuse it."""
    raw = raw if raw is not None else msgpack.packb(body, use_bin_type=True)
    with open(os.path.join(root, MANIFEST), "wb") as f:
        f.write(
            msgpack.packb({"sha256": hashlib.sha256(raw).digest(), "body": raw}, use_bin_type=True)
        )


def nested_tuples(depth: int) -> msgpack.ExtType:
    """A nil inside ``depth`` ext 2 tuples of one element each (2 bytes a level)."""
    x = msgpack.packb(None)
    for _ in range(depth - 1):
        x = msgpack.packb(msgpack.ExtType(2, b"\x91" + x))
    return msgpack.ExtType(2, b"\x91" + x)


def add_deep_value(root: str, depth: int = 300, tuples: bool = True) -> None:
    """Give the tree a value leaf ``deep`` nesting ``depth`` tuples (or plain arrays)."""
    body = read_body(root)
    value: Any = nested_tuples(depth) if tuples else None
    if not tuples:  # msgpack's packer stops at 512 levels
        for _ in range(min(depth, 500)):
            value = [value]
    body["tree"].setdefault("dict", []).append(["deep", {"value": value}])
    write_body(root, body)


def add_deep_field(root: str, depth: int, tuples: bool = True) -> None:
    """Give the body an ignorable field ``note`` whose ``payload`` nests ``depth`` tuples (or
    plain arrays): the body is level 1, ``note`` level 2, the outer tuple level 3."""
    body = read_body(root)
    mark = msgpack.ExtType(99, b"deep-payload-mark")
    body["note"] = {"must_understand": False, "payload": nested_tuples(depth) if tuples else mark}
    raw = msgpack.packb(body, use_bin_type=True)
    if not tuples:  # spelled out: msgpack's packer stops at 512 levels
        raw = raw.replace(msgpack.packb(mark), b"\x91" * depth + b"\xc0")
    write_body(root, body, raw)


def deep_zarr_json(root: str, array_path: str, depth: int = 100_000) -> None:
    """Put ``depth`` nested arrays into the ``attributes`` of one array's zarr.json."""
    p = os.path.join(root, array_path, "zarr.json")
    text = open(p).read()
    deep = "[" * depth + "]" * depth
    with open(p, "w") as f:
        f.write(text[:-1] + f',"attributes":{{"x":{deep}}}}}')


def memory_bomb(
    root: str, *, entries: int = 2048, inner_elems: int = 1 << 19, alias: bool = True
) -> int:
    """A checkpoint of one float32 tensor ``w`` of ``entries * inner_elems`` elements (4 GiB
    by default) stored as one shard holding ONE inner chunk, with every index entry pointing
    at it (``alias``; else a sound shard: every inner chunk stored, each entry its own). The
    aliasing files take ``inner_elems * 4`` bytes plus the index (2.1 MB by default).
    Returns the declared size in bytes."""
    n = entries * inner_elems
    arr = os.path.join(root, "tensors", "w")
    os.makedirs(os.path.join(arr, "c"))
    meta = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [n],
        "data_type": "float32",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [n]}},
        "chunk_key_encoding": {"name": "default"},
        "fill_value": 0.0,
        "codecs": [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": [inner_elems],
                    "codecs": [
                        {"name": "bytes", "configuration": {"endian": "little"}},
                        {"name": "crc32c"},
                    ],
                    "index_codecs": [
                        {"name": "bytes", "configuration": {"endian": "little"}},
                        {"name": "crc32c"},
                    ],
                },
            }
        ],
    }
    with open(os.path.join(arr, "zarr.json"), "w") as f:
        json.dump(meta, f)
    data = bytes(inner_elems * 4)
    inner = data + crc32c.crc32c(data).to_bytes(4, "little")
    index = b"".join(
        (0 if alias else i * len(inner)).to_bytes(8, "little") + len(inner).to_bytes(8, "little")
        for i in range(entries)
    )
    with open(os.path.join(arr, "c", "0"), "wb") as f:
        f.write(
            inner * (1 if alias else entries) + index + crc32c.crc32c(index).to_bytes(4, "little")
        )
    body = {
        "format": "shardpoint",
        "format_version": [1, 1],
        "writer": "hostile",
        "created_unix": 0,
        "save_world_size": 1,
        "tree": {"dict": [["w", {"tensor": "w"}]]},
        "tensors": {
            "w": {"array": "tensors/w", "shape": [n], "dtype": "float32", "chunk_shape": [n]}
        },
        "objects": {},
        "extensions": {},
    }
    write_body(root, body)
    return n * 4


# -------------------------------------------------------------------- bounded subprocesses
def _memory_cgroup() -> Optional[Callable[[int], tuple]]:
    """A way to make a memory-limited cgroup here (v2, else v1), or None."""
    v2 = "/sys/fs/cgroup"
    if (
        os.path.isfile(f"{v2}/cgroup.controllers")
        and "memory" in open(f"{v2}/cgroup.controllers").read()
        and os.access(v2, os.W_OK)
    ):
        return lambda limit: (v2, "memory.max", "memory.swap.max")
    v1 = "/sys/fs/cgroup/memory"
    if os.path.isdir(v1) and os.access(v1, os.W_OK):
        return lambda limit: (v1, "memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
    return None


def supports_memory_cgroup() -> bool:
    """Whether :func:`run_bounded` can put a child in a memory cgroup here (root, cgroup
    v1 or v2 with the memory controller)."""
    return _memory_cgroup() is not None


def run_bounded(
    code: str,
    *,
    memory_bytes: int,
    timeout: float = 120.0,
    env: Optional[dict] = None,
    forked: bool = False,
) -> Any:
    """Run ``python -c code`` in a fresh memory cgroup of ``memory_bytes`` (the kernel kills
    it, rc -9, if it goes over); returns its exit code, stdout and stderr. Raises RuntimeError
    when no cgroup can be made here. With ``forked``, in a process forked from the launcher's
    fork server (torch and shardpoint imported, those pages charged outside the cgroup)
    instead of a fresh interpreter."""
    make = _memory_cgroup()
    if make is None:
        raise RuntimeError("no writable memory cgroup (needs root and cgroup v1/v2)")
    base, limit_file, swap_file = make(memory_bytes)
    cg = os.path.join(base, f"shardpoint_bounded_{uuid.uuid4().hex[:12]}")
    os.mkdir(cg)
    try:
        with open(os.path.join(cg, limit_file), "w") as f:
            f.write(str(memory_bytes))
        if os.path.exists(os.path.join(cg, swap_file)):
            try:
                with open(os.path.join(cg, swap_file), "w") as f:
                    f.write("0" if swap_file == "memory.swap.max" else str(memory_bytes))
            except OSError:
                pass
        wrapper = (
            f"import os; open({os.path.join(cg, 'cgroup.procs')!r}, 'w')"
            f".write(str(os.getpid())); exec(compile({code!r}, '<bounded>', 'exec'))"
        )
        if forked:
            from shardpoint_testing.launch import run_code

            return run_code(wrapper, env=env, timeout=timeout)
        return subprocess.run(
            [sys.executable, "-c", wrapper],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    finally:
        try:
            os.rmdir(cg)
        except OSError:
            pass
