"""Golden vectors: small checkpoints that every reader must read, or refuse as documented.

``generate(root)`` (re)writes ``root/valid/<case>/`` (a checkpoint + ``expected.json``),
``root/invalid/<case>/`` (a damaged checkpoint + ``expected.json`` naming the damage, the
error category's reference class and the requirement ID) and ``root/README.md`` (the list).
Bytes are reproducible: the data comes from fixed seeds and the manifest's ``writer`` and
``created_unix`` are pinned. ``check_vectors(root)`` reads every valid case twice, with the
independent reader (:mod:`.independent_reader`, written from spec/ alone) and with
``shardpoint.load``, and opens every invalid case expecting its documented error from both.
The cases are in :mod:`.vector_cases` and :mod:`.vector_damage`.

    python -m shardpoint_conformance.vectors generate spec/vectors
    python -m shardpoint_conformance.vectors check spec/vectors
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Optional

import numpy as np

from shardpoint_conformance.independent_reader import (
    DTYPES,
    VectorError,
    array_json,
    crc32c,
    float_json,
    read_independently,
)
from shardpoint_conformance.vector_cases import cases
from shardpoint_conformance.vector_cases import pin_manifest as _pin_manifest
from shardpoint_conformance.vector_damage import INVALID as INVALID_1_1
from shardpoint_conformance.vector_damage_12 import INVALID_1_2
from shardpoint_conformance.vector_damage_13 import INVALID_1_3
from shardpoint_conformance.vector_damage_14 import INVALID_1_4
from shardpoint_conformance.vector_damage_15 import INVALID_1_5

# Every invalid vector: 1.0/1.1's, then each version's clarifications (their own modules,
# built on vector_damage's helpers).
INVALID = {**INVALID_1_1, **INVALID_1_2, **INVALID_1_3, **INVALID_1_4, **INVALID_1_5}

__all__ = [
    "DTYPES",
    "INVALID",
    "VectorError",
    "check_vectors",
    "crc32c",
    "generate",
    "read_independently",
]

DEFAULT_ROOT = Path(__file__).resolve().parents[2] / "spec" / "vectors"


def _jsonable(v):
    """A value as loaded by shardpoint -> its JSON form in expected.json."""
    import torch
    from shardpoint.tree import dtypes

    if isinstance(v, bytes):
        return {"$hex": v.hex()}
    if isinstance(v, tuple):
        return {"$tuple": [_jsonable(x) for x in v]}
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, torch.Tensor):
        v = dtypes.torch_to_numpy(v.contiguous())
    if isinstance(v, (np.ndarray, np.generic)):
        a = np.asarray(v)
        le = a.astype(a.dtype.newbyteorder("<"), copy=False)
        return array_json(dtypes.from_numpy(a.dtype).name, a.shape, le.tobytes())
    if isinstance(v, float):
        return float_json(v)
    return v


def _expected(path: str) -> dict:
    """expected.json through the reference: ``shardpoint.load`` walked along the manifest's
    tree. ``tree``: the skeleton (leaves name their key); ``tensors``: key -> shape, dtype,
    SHA-256 of the little-endian bytes; ``values`` and ``objects``: key -> JSON form."""
    import torch
    import shardpoint as sp
    from shardpoint.tree import dtypes
    from shardpoint_core.format.keys import encode_key
    from shardpoint_core.format.statetree import ObjectLeaf, TensorLeaf

    m = sp.read_metadata(path)
    state = sp.load(path)
    out = {"format_version": list(m.format_version), "tensors": {}, "values": {}, "objects": {}}

    def walk(node, obj, path):  # node: the typed tree (Manifest.tree)
        for kind, typ in (("dict", dict), ("list", list), ("tuple", tuple)):
            if type(node) is typ:
                if type(obj) is not typ:
                    raise AssertionError(f"{path}: loaded {type(obj).__name__}, tree has {kind}")
                if kind == "dict":
                    if list(obj) != list(node):
                        raise AssertionError(f"{path}: keys {list(obj)} != {list(node)}")
                    return {kind: [[k, walk(n, obj[k], path + (k,))] for k, n in node.items()]}
                if len(obj) != len(node):
                    raise AssertionError(f"{path}: length {len(obj)} != {len(node)}")
                return {kind: [walk(n, obj[i], path + (i,)) for i, n in enumerate(node)]}
        key = encode_key(path)
        if isinstance(node, TensorLeaf):
            want = np.ndarray if node.origin == "numpy" else torch.Tensor
            if not isinstance(obj, want):
                raise AssertionError(f"{key}: loaded {type(obj).__name__}, not {want.__name__}")
            a = obj if isinstance(obj, np.ndarray) else dtypes.torch_to_numpy(obj.contiguous())
            a = np.array(a, order="C")  # not ascontiguousarray: it makes 0-d arrays 1-d
            le = a.astype(a.dtype.newbyteorder("<"), copy=False)
            out["tensors"][key] = {
                "shape": list(a.shape),
                "dtype": dtypes.from_numpy(a.dtype).name,
                "sha256": hashlib.sha256(le.tobytes()).hexdigest(),
            }
            return {"tensor": key}
        if isinstance(node, ObjectLeaf):
            out["objects"][key] = [_jsonable(v) for v in obj]
            return {"object": key}
        out["values"][key] = _jsonable(obj)
        return {"value": key}

    out["tree"] = walk(m.tree, state, ())
    return out


def _readme(root: Path) -> str:
    valid = sorted(p.name for p in (root / "valid").iterdir())
    lines = [
        "# Golden vectors (generated; do not edit)",
        "",
        "Valid cases (`valid/<case>/checkpoint/` and `expected.json`, whose form is "
        "described in ../README.md): " + ", ".join(f"`{v}`" for v in valid) + ".",
        "",
        "`packed_incremental` also holds `base/`, the checkpoint its `checkpoint/` builds on "
        "([SP-PACK-9]); invalid cases starting from it hold a copy of both.",
        "",
        "Invalid cases: each starts from a valid case, breaks one rule, and must be "
        "refused by a full read with the requirement ID below (category: the reference "
        "class, spec/format.md section 10).",
        "",
        "| case | base | damage | error | ID |",
        "|---|---|---|---|---|",
    ]
    for name, d in sorted(INVALID.items()):
        lines.append(f"| `{name}` | `{d.base}` | {d.description} | {d.error} | {d.spec_id} |")
    return "\n".join(lines) + "\n"


def generate(root: Optional[str] = None) -> list:
    """Write every vector under ``root`` (default: the repository's spec/vectors)."""
    import shardpoint as sp

    top = Path(root or DEFAULT_ROOT)
    made = []
    for name, (state, kw, edit, version, files) in cases().items():
        d = top / "valid" / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        ck = str(d / "checkpoint")
        if state is None:
            kw["write"](ck)
        else:  # the layout of 1.0-1.3 unless the case names its backend (1.4: packed)
            sp.save(state, ck, **{"backend": sp.ZarrBackend(), **kw})
        _pin_manifest(ck, edit, version)
        if files is not None:
            files(ck)
        (d / "expected.json").write_text(json.dumps(_expected(ck), indent=1, sort_keys=True) + "\n")
        made.append(str(d))
    for name, dmg in INVALID.items():
        d = top / "invalid" / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        for sub in sorted((top / "valid" / dmg.base).iterdir()):  # checkpoint/, base/
            if sub.is_dir():
                shutil.copytree(sub, d / sub.name)
        dmg.apply(str(d / "checkpoint"))
        (d / "expected.json").write_text(
            json.dumps(
                {
                    "base": dmg.base,
                    "damage": dmg.description,
                    "error": dmg.error,
                    "spec_id": dmg.spec_id,
                },
                indent=1,
            )
            + "\n"
        )
        made.append(str(d))
    (top / "README.md").write_text(_readme(top))
    return made


def check_vectors(root: Optional[str] = None) -> tuple:
    """(ok, report text) for every vector under ``root``: valid ones read both ways and
    compared with expected.json; invalid ones refused by both readers with the documented
    error class (shardpoint.load) and requirement ID (both)."""
    import shardpoint as sp
    from shardpoint_core.format import errors

    top = Path(root or DEFAULT_ROOT)
    lines, ok = [], True
    valid = sorted((top / "valid").iterdir()) if (top / "valid").is_dir() else []
    invalid = sorted((top / "invalid").iterdir()) if (top / "invalid").is_dir() else []
    if not valid or not invalid:
        return False, f"no vectors under {top}"
    for d in valid:
        exp = json.loads((d / "expected.json").read_text())
        ck = str(d / "checkpoint")
        try:
            ind = json.loads(json.dumps(read_independently(ck)))
            assert ind == exp, f"independent read differs from expected.json: {_diff(ind, exp)}"
            ref = json.loads(json.dumps(_expected(ck)))
            assert ref == exp, f"shardpoint.load differs from expected.json: {_diff(ref, exp)}"
            lines.append(f"valid/{d.name}: ok ({len(exp['tensors'])} tensors)")
        except Exception as e:  # noqa: BLE001
            ok = False
            lines.append(f"valid/{d.name}: FAILED {type(e).__name__}: {e}")
    for d in invalid:
        exp = json.loads((d / "expected.json").read_text())
        try:
            read_independently(str(d / "checkpoint"))
            ind = "no error"
        except VectorError as e:
            ind = e.spec_id
        try:
            sp.load(str(d / "checkpoint"))
            got = "no error"
        except errors.ShardpointError as e:
            got = f"{type(e).__name__} {e.spec_id}"
        good = got == f"{exp['error']} {exp['spec_id']}" and ind == exp["spec_id"]
        ok &= good
        lines.append(
            f"invalid/{d.name}: {'ok' if good else 'FAILED'} (shardpoint: {got}; "
            f"independent: {ind}; expected {exp['error']} {exp['spec_id']})"
        )
    return ok, "\n".join(lines)


def _diff(a: dict, b: dict) -> str:
    keys = sorted(set(a) | set(b))
    return "; ".join(
        f"{k}: {a.get(k)!r} != {b.get(k)!r}"[:400] for k in keys if a.get(k) != b.get(k)
    )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("generate", "check"):
        print(__doc__)
        return 2
    root = argv[1] if len(argv) > 1 else None
    if argv[0] == "generate":
        for p in generate(root):
            print(p)
        return 0
    ok, text = check_vectors(root)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
