"""The valid golden vectors: what each one holds and how it is written.

Most are written by ``shardpoint.save`` from a fixed-seed state; ``edge_chunks`` is written
through the core's checkpoint writer directly, to pin chunk and inner-chunk shapes that a
one-process save would not choose. Each case may edit the manifest (to stand for a
multi-rank save) and then the files (to exercise spellings other writers use).
"""

from __future__ import annotations

import json
import os
from typing import Any

import msgpack
import numpy as np


def _specials(name: str, bits: int) -> list:
    """Five bit patterns that a lossy reader would get wrong: for floats -0.0, a NaN with a
    payload, -inf (e4m3fn has none: a negative NaN), the smallest subnormal, the largest
    finite; for integers the extremes, 0, all ones and 1; for bool 0 and 1."""
    table = {
        "float16": [0x8000, 0x7E01, 0xFC00, 0x0001, 0x7BFF],
        "bfloat16": [0x8000, 0x7FC1, 0xFF80, 0x0001, 0x7F7F],
        "float32": [0x80000000, 0x7FC00001, 0xFF800000, 0x00000001, 0x7F7FFFFF],
        "float64": [1 << 63, 0x7FF8000000000001, 0xFFF0000000000000, 1, 0x7FEFFFFFFFFFFFFF],
        "float8_e4m3fn": [0x80, 0x7F, 0xFF, 0x01, 0x7E],
        "float8_e5m2": [0x80, 0x7D, 0xFC, 0x01, 0x7B],
        "bool": [0, 1, 1, 0, 1],
    }
    if name in table:
        return [v.to_bytes(bits // 8, "little") for v in table[name]]
    if name.startswith("complex"):
        part = _specials("float32" if name == "complex64" else "float64", bits // 2)
        return [part[i] + part[(i + 1) % 5] for i in range(5)]  # real, then imaginary
    return [
        v.to_bytes(bits // 8, "little")
        for v in (1 << (bits - 1), (1 << (bits - 1)) - 1, 0, (1 << bits) - 1, 1)
    ]


def bits(dtype_name: str, shape: tuple, seed: int, specials: bool = False):
    """A tensor of random bits from ``seed`` (bool: 0/1), optionally starting with the
    dtype's special bit patterns; built from little-endian bytes, never from values."""
    from shardpoint.tree import dtypes

    d = dtypes.from_name(dtype_name)
    n = int(np.prod(shape, dtype=np.int64)) * d.itemsize
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    if dtype_name == "bool":
        raw &= 1
    if specials:
        head = b"".join(_specials(dtype_name, d.itemsize * 8))
        raw[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    return dtypes.numpy_to_torch(raw.view(d.numpy).reshape(shape).copy())  # little-endian host


def _obj_value(i: int) -> dict:
    """Entry ``i`` of the nested_tree sharded object: every kind of object value."""
    import torch

    return {
        "seed": 42 + i,
        "state": bits("uint8", (16,), 103 + i),
        "pos": (i, "epoch"),
        "np": np.arange(3, dtype=np.float64) * i,
        5: [None, True, 2.5, b"\x01"],
        "t": torch.tensor([i, -i], dtype=torch.int64),
    }


def cases() -> dict:
    """Case name -> (state, save kwargs, manifest edit or None, format version, file edit or
    None); a state of None means ``kwargs["write"](path)`` writes the checkpoint. The 1.0
    vectors stay 1.0 checkpoints, so every 1.x reader is tested on them ([SP-VER-4])."""
    import torch
    import shardpoint as sp
    from shardpoint.tree import dtypes
    from shardpoint_core.transactions.backend import ZarrBackend

    all_dtypes = {
        name: bits(name, (3, 5), i, specials=True) for i, name in enumerate(dtypes.DTYPES)
    }
    nested = {
        "model": {
            "layers.0.weight": bits("float32", (4, 3), 100),
            "layers.0.bias": bits("bfloat16", (4,), 101),
        },
        "optim": {
            "state": {0: {"step": torch.tensor(7.0), "exp_avg": bits("float32", (4, 3), 102)}},
            "param_groups": [
                {
                    "lr": 0.001,
                    "betas": (0.9, 0.999),
                    "params": [0],
                    "amsgrad": False,
                    "name": None,
                    "tag": b"\x00\x01",
                }
            ],
        },
        "values": {
            "none": None,
            "true": True,
            "false": False,
            "int": -1234,
            "int64_min": -(1 << 63),
            "uint64_max": (1 << 64) - 1,
            "float": 0.1,
            "neg_zero": -0.0,
            "inf": float("inf"),
            "nan": float("nan"),
            "str": "h\u00e9llo \u2713",
            "empty_str": "",
            "bytes": b"\x00\x01\xff",
            "empty_bytes": b"",
            "np_float32": np.float32(1.5),
            "np_int8": np.int8(-7),
            3: "an int key",
            "empty_list": [],
            "empty_dict": {},
            "empty_tuple": (),
        },
        "iteration": 1234,
        "rng": sp.ShardedObject(_obj_value(0), 0, 1),
        "np": dtypes.torch_to_numpy(bits("int16", (2, 2), 104)).copy(),
    }

    def three_ranks(m):
        # One process holds one index of a sharded object. A 3-rank gloo save (rank i holding
        # ShardedObject(_obj_value(i), i, 3), the rest replicated) writes this very manifest
        # and the same tensors/ bytes (checked when the vector was made).
        m.objects["rng"] = [_obj_value(i) for i in range(3)]
        m.save_world_size = 3

    big = bits("float32", (37, 11), 200)
    backend = ZarrBackend(shard_above_bytes=256, inner_chunk_bytes=128)
    multi = {
        "grid": sp.ShardedTensor(big, (37, 11), (0, 0)),
        "rows": bits("int32", (23, 4), 201),
        "small": bits("uint16", (5, 3), 202),
    }
    multi_opts = sp.SaveOptions(plan=sp.PlanOptions(max_chunk_bytes=400, chunk_overhead_bytes=0))
    empty = {
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "empty_int": torch.zeros(2, 0, 3, dtype=torch.int8),
        "scalar_bf16": torch.tensor(-0.0, dtype=torch.bfloat16),
    }
    keys = {
        "a/b c": torch.ones(2),
        "7": torch.zeros(1),
        7: torch.full((1,), 7.0),
        "\u00fcn\u00ef": {"~x": torch.arange(3)},
        "-3": {-3: torch.ones(1, dtype=torch.uint8)},
        "50%": torch.tensor([50], dtype=torch.int16),
        "..x": torch.tensor([True]),
    }

    def stage_by_tensor(m):
        # Six ranks, one RNG state per (pipeline stage, tensor rank) on a 2 x 3 grid; a real
        # 6-rank save writes this manifest (tests/planning/test_object_grid.py saves such grids).
        from shardpoint.tree.model import ObjectValues

        m.objects["rng"] = ObjectValues(
            [{"stage": s, "tp": t, "seed": 10 * s + t} for s in range(2) for t in range(3)], (2, 3)
        )
        m.objects["per_stage"] = ObjectValues([(s, "stage") for s in range(2)], (2,))
        m.save_world_size = 6

    grid = {
        "rng": sp.ShardedObject(None, (0, 0), (1, 1)),
        "per_stage": sp.ShardedObject(None, 0, 1),
        "w": bits("float32", (2, 3), 300),
    }
    newer = {
        "u8": bits("uint8", (2, 3), 500),
        "f32": bits("float32", (2, 2), 501),
        "pos": sp.ShardedObject((3, "epoch", 0.5), 0, 1),
        "lr": 1.5,
        "np32": np.float32(2.5),
    }
    v10, v11, v13 = (1, 0), (1, 1), (1, 3)
    # 1.3: chunk tables ([SP-MAN-7]); "a" and "b" have chunk files of one size, so that a
    # swap of them is what only the table catches
    ident = {
        "grid": sp.ShardedTensor(bits("float32", (37, 11), 700), (37, 11), (0, 0)),
        "a": bits("int16", (6, 5), 701),
        "b": bits("int16", (6, 5), 702),
    }
    ident_opts = sp.SaveOptions(plan=sp.PlanOptions(max_chunk_bytes=400, chunk_overhead_bytes=0))
    paths: dict = {k: torch.tensor([i], dtype=torch.int8) for i, k in enumerate(PORTABLE_KEYS)}
    paths["long"] = _long_tree()
    limits = {"w": bits("float32", (2,), 600), "step": 3}
    # 1.4: the packed layout (format.md section 13): plain and sharded chunks, an edge chunk,
    # a 0-d and an empty tensor, bool; one writer whose objects split at 1 KiB, written by
    # one thread so that the chunks' order (and so every byte) is reproducible
    from shardpoint_core.transactions.packed import PackedBackend

    packed = {
        "grid": sp.ShardedTensor(bits("float32", (37, 11), 800), (37, 11), (0, 0)),
        "a": bits("int16", (6, 5), 801),
        "b": bits("int16", (6, 5), 802),
        "flag": bits("bool", (3,), 803),
        "scalar": torch.tensor(1.5, dtype=torch.float64),
        "empty": torch.zeros(0, 2),
        "step": 9,
    }
    packed_be = PackedBackend(
        ZarrBackend(shard_above_bytes=256, inner_chunk_bytes=128),
        cap=1024,
        write_threads=1,
        writer_id="w0",
    )
    return {
        "all_dtypes": (all_dtypes, {}, None, v10, None),
        "nested_tree": (nested, {}, three_ranks, v10, None),
        "multi_chunk": (multi, {"backend": backend, "options": multi_opts}, None, v10, None),
        "empty_and_scalar": (empty, {}, None, v10, None),
        "key_escaping": (keys, {}, None, v10, None),
        "object_grid": (grid, {}, stage_by_tensor, v11, None),
        "edge_chunks": (None, {"write": write_edge_chunks}, None, v11, None),
        "newer_minor": (newer, {}, None, v11, _newer_minor_files),
        "portable_paths": (paths, {}, None, v11, None),
        "at_the_limits": (limits, {}, None, v11, _at_the_limits),
        "chunk_identity": (
            ident,
            {
                "backend": ZarrBackend(shard_above_bytes=256, inner_chunk_bytes=128),
                "options": ident_opts,
            },
            None,
            v13,
            None,
        ),
        "packed_basic": (packed, {"backend": packed_be, "options": ident_opts}, None, (1, 4), None),
        "compressed_zstd": (None, {"write": write_compressed}, None, (1, 5), None),
        # 1.4 incremental ([SP-PACK-9], [SP-PACK-10]): checkpoint/ builds on its sibling base/
        "packed_incremental": (None, {"write": write_incremental}, None, (1, 4), None),
    }


def write_compressed(path: str) -> None:
    """(1.5) A checkpoint whose arrays are all compressed ([SP-ARRAY-7]): chunks of one
    frame each, an edge chunk, bool, bfloat16, a 0-d and an empty tensor, with chunk tables.
    Its frames are :func:`~.vector_damage_15.simple_frame`'s (raw and RLE blocks) instead of
    a zstd library's, so that the bytes reproduce whatever libzstd regenerates the vector:
    the save's encoder is swapped for the time of this save."""
    import shardpoint as sp
    from shardpoint_core.arrays import array as zarr_layer
    from shardpoint_conformance.vector_damage_15 import simple_frame

    state = {
        "zeros": np.zeros((32, 32), np.float32),  # one 4 KiB chunk, one RLE block
        "rows": bits("float32", (30, 50), 900),  # two chunks, the second an edge chunk
        "flags": bits("bool", (5, 3), 901),
        "bf": bits("bfloat16", (7, 2), 902),
        "scalar": np.array(-2.5),  # a 0-d tensor: its one chunk "c"
        "empty": np.zeros((0, 4), np.int16),
        "step": 12,
    }
    opts = sp.SaveOptions(
        plan=sp.PlanOptions(max_chunk_bytes=4096, chunk_overhead_bytes=0), compression="zstd"
    )
    keep = zarr_layer.encode_zstd
    zarr_layer.encode_zstd = lambda data, level: simple_frame(bytes(data))
    try:  # compressed arrays are the per-array layout's ([SP-ARRAY-7]; packed has none)
        sp.save(state, path, options=opts, backend=sp.ZarrBackend())
    finally:
        zarr_layer.encode_zstd = keep


# Keys whose array paths pin [SP-LAYOUT-4]: case marks counting letters outside %XX escapes
# ("\u00fcnA" is the component %C3%BCnA, letters n and A: mask 2), reserved names compared
# after the case mark ("CON" -> CON~7 stays, "con" and "Con.txt" fall back to ~h/), a
# trailing dot, an integer component.
PORTABLE_KEYS = ("Encoder", "aBC", "\u00fcnA", "CON", "con", "Con.txt", "nul.x", "a.", 12)


def _long_tree() -> dict:
    """Two keys whose paths straddle the 1024-byte limit: ``tensors/`` + key is exactly 1024
    bytes for ``long/fits/...`` (kept) and 1025 for ``long/over/...`` (hashed), though both
    keys alone are under 1024 bytes."""
    import torch

    def chain(total: int) -> dict:  # components of <= 250 lower-case letters
        parts, left = [], total
        while left > 251:
            parts.append("p" * 250)
            left -= 251
        parts.append("q" * left)
        node: Any = torch.tensor([total], dtype=torch.int16)
        for c in reversed(parts):
            node = {c: node}
        return node

    prefix = len("tensors/long/fits/")  # "over" has the same length
    return {"fits": chain(1024 - prefix), "over": chain(1025 - prefix)}


def _at_the_limits(path: str) -> None:
    """at_the_limits: what a reader must accept at the edges of the 1.1 rules: a body with
    ``created_unix`` as a msgpack int ([SP-MAN-2]) and an ignorable field nesting exactly 256
    levels, its outer 5 containers ext 2 tuples counting one level each ([SP-MAN-5])."""
    from shardpoint_conformance.vector_damage import deep_with_tuples, rewrite_body

    rewrite_body(path, lambda b: b.update(created_unix=1_790_000_000, later=deep_with_tuples(254)))


def _zarr_spellings(path: str) -> None:
    """newer_minor: zarr.json written the way other Zarr writers may, all allowed by
    [SP-ARRAY-2], [SP-ARRAY-3] and [SP-ARRAY-5]."""
    for name in ("u8", "f32"):
        p = os.path.join(path, "tensors", name, "zarr.json")
        meta = json.load(open(p))
        meta["attributes"] = {"note": "ignored by readers"}
        meta["dimension_names"] = [None, "cols"]
        meta["storage_transformers"] = []
        meta["vendor.extension"] = {"must_understand": False, "x": 1}
        meta["chunk_key_encoding"] = {"name": "default", "configuration": {"separator": "/"}}
        meta["codecs"][-1]["configuration"] = {}  # crc32c with an empty configuration
        if name == "u8":
            meta["codecs"][0].pop("configuration", None)  # one-byte dtype: no endian
        else:
            meta["fill_value"] = 0  # +0 spelled as a JSON integer
        json.dump(meta, open(p, "w"), indent=2, sort_keys=True)


def _float32_body(path: str) -> None:
    """newer_minor: a [1, 2] body (a minor version newer than this spec) with ignorable fields
    everywhere they may appear, every float packed as float 32 ([SP-MAN-5])."""
    import hashlib

    mpath = os.path.join(path, "manifest.msgpack")
    env = msgpack.unpackb(open(mpath, "rb").read())
    body = msgpack.unpackb(
        env["body"], strict_map_key=False, ext_hook=lambda code, data: msgpack.ExtType(code, data)
    )
    body["format_version"] = [1, 2]
    body["later_field"] = {"must_understand": False, "values": [1, 2.5]}
    body["tensors"]["f32"]["later_entry_field"] = {"must_understand": False}
    body["objects"]["pos"]["later_object_field"] = {"must_understand": False}
    body["extensions"]["vendor.note"] = {"must_understand": False, "text": "ignored"}
    raw = msgpack.packb(body, use_bin_type=True, use_single_float=True)
    open(mpath, "wb").write(
        msgpack.packb({"sha256": hashlib.sha256(raw).digest(), "body": raw}, use_bin_type=True)
    )


def _newer_minor_files(path: str) -> None:
    _zarr_spellings(path)
    _float32_body(path)


def write_edge_chunks(path: str) -> None:
    """Two 10x7 tensors with chunk grids a one-process save would not pick: ``plain`` in 4x3
    chunks (edge chunks in both dimensions, no sharding) and ``sharded`` in 8x4 shards of
    2x4 inner chunks (the last shard row holds a present edge inner chunk and absent inner
    chunks wholly outside the tensor, [SP-ARRAY-4]). Saved through the core's
    :class:`~shardpoint_core.transactions.writer.CheckpointWriter`, as every writer saves."""
    from shardpoint.tree import dtypes
    from shardpoint_core.format.manifest import Manifest, TensorEntry, array_path_for
    from shardpoint_core.format.spec import ArraySpec
    from shardpoint_core.transactions.backend import ZarrBackend
    from shardpoint_core.transactions.writer import CheckpointWriter

    be = ZarrBackend(shard_above_bytes=64, inner_chunk_bytes=32)
    plain = dtypes.torch_to_numpy(bits("int16", (10, 7), 400))
    sharded = dtypes.torch_to_numpy(bits("float32", (10, 7), 401))
    tensors, ops = {}, []
    with CheckpointWriter.begin(path, backend=be) as w:
        for key, a, chunk, big in (
            ("plain", plain, (4, 3), 1 << 30),
            ("sharded", sharded, (8, 4), 64),
        ):
            be.shard_above_bytes = big  # the codecs are chosen when the array opens
            spec = ArraySpec(a.shape, dtypes.from_numpy(a.dtype).name, chunk)
            h = w.open_array(array_path_for(key), spec)
            ops.append(w.write(h, (0, 0), a))
            tensors[key] = TensorEntry(key, array_path_for(key), a.shape, spec.dtype, chunk)
        w.wait(ops)
        w.flush()  # a 1.1 vector: no chunk tables, so their crc32c are not used
        tree = {
            "dict": [
                ["plain", {"tensor": "plain", "origin": "numpy"}],
                ["sharded", {"tensor": "sharded", "origin": "numpy"}],
            ]
        }
        w.commit(Manifest(tree, tensors, {}, save_world_size=1))


def _incremental_states() -> tuple:
    """The base's state and the incremental one's: "frozen" (three plain chunks) and
    "same" unchanged, "moved" with one chunk of three changed, "fresh" new."""
    frozen = bits("float32", (12, 5), 900)
    moved = bits("int16", (9, 4), 901)
    base = {"frozen": frozen, "moved": moved, "same": bits("uint8", (5,), 902), "step": 1}
    moved2 = moved.clone()
    moved2[6:] += 1  # the last chunk (rows 6..8) only
    step = {
        "frozen": frozen,
        "moved": moved2,
        "same": base["same"],
        "fresh": bits("bool", (4,), 903),
        "step": 2,
    }
    return base, step


def write_incremental(path: str) -> None:
    """packed_incremental: ``base/`` (a packed save that records chunk hashes, its manifest
    pinned as every vector's) and ``checkpoint/`` (a save building on it: it names base's
    unchanged chunks instead of storing them), one writer and one thread each so that every
    byte is reproducible."""
    import shardpoint as sp
    from shardpoint_core.transactions.backend import ZarrBackend
    from shardpoint_core.transactions.packed import PackedBackend

    opts = sp.SaveOptions(plan=sp.PlanOptions(max_chunk_bytes=80, chunk_overhead_bytes=0))
    base_state, step_state = _incremental_states()
    base = os.path.join(os.path.dirname(path), "base")

    def backend(**kw):
        return PackedBackend(ZarrBackend(), write_threads=1, **kw)

    sp.save(base_state, base, backend=backend(writer_id="b0", hashes=True), options=opts)
    pin_manifest(base)
    sp.save(step_state, path, backend=backend(writer_id="w0", incremental="base"), options=opts)


PINNED_WRITER = "shardpoint-py/vectors"
PINNED_TIME = 1_790_000_000.0


def pin_manifest(path: str, edit=None, version=None) -> None:
    """Make the manifest reproducible: rewrite it through shardpoint_core.format.manifest's own
    decode/encode with ``writer`` and ``created_unix`` pinned (and ``edit`` applied)."""
    from shardpoint_core.format.manifest import decode_manifest, encode_manifest

    mpath = os.path.join(path, "manifest.msgpack")
    m = decode_manifest(open(mpath, "rb").read())
    m.writer, m.created_unix = PINNED_WRITER, PINNED_TIME
    m.format_version = version or m.format_version
    if tuple(m.format_version) < (1, 3):  # a 1.0/1.1 vector has no 1.3 chunk tables
        for e in m.tensors.values():
            e.chunk_crc32c = None
    if edit is not None:
        edit(m)
    with open(mpath, "wb") as f:
        f.write(encode_manifest(m))
