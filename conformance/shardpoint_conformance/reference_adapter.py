"""The reference implementation behind the adapter protocol (see :mod:`.adapters`).

    python -m shardpoint_conformance.reference_adapter capabilities
    python -m shardpoint_conformance.reference_adapter write CASE.json DIR
    python -m shardpoint_conformance.reference_adapter read DIR CASE.json OUT_DIR

It goes through the same harness as any other implementation. :func:`write_checkpoint` also
runs on several ranks (the harness's reference writer uses a world of 2, so sharded objects
get a count above 1 and tensors are written by two ranks).
"""

from __future__ import annotations

import json
import os
import sys

from shardpoint_conformance.adapters import FEATURES, read_case_files, region_of, save_npy
from shardpoint_conformance.cases import (
    SPEC_DTYPES,
    decode_value,
    encode_value,
    get_path,
    grid_cell,
    object_index,
    set_path,
)


def capabilities() -> dict:
    import shardpoint

    return {
        "name": "shardpoint-reference",
        "version": shardpoint.__version__,
        "dtypes": list(SPEC_DTYPES),
        "features": list(FEATURES),
    }


def write_checkpoint(case_json: str, ckpt_dir: str, rank: int = 0, world: int = 1) -> None:
    """Save the case with shardpoint. With ``world > 1`` (inside a process group) tensors are
    replicas on every rank and rank ``r`` holds cell number ``r`` (row-major) of each sharded object
    (whose count must then equal ``world``). (Sharded tensor writes are covered by ``conformance run``.)"""
    import shardpoint as sp
    from shardpoint_conformance.runner import to_torch

    case, arrays = read_case_files(case_json)
    st: dict = {}
    for t in case["tensors"]:
        set_path(st, t["path"], to_torch(arrays[t["key"]]))
    for v in case["values"]:
        set_path(st, v["path"], decode_value(v["value"]))
    for o in case["objects"]:
        count = len(o["values"])
        if count != world:
            raise ValueError(
                f"object {o['key']!r} has count {count}; a world of {world} writes count == world"
            )
        grid = _grid(o)
        set_path(
            st,
            o["path"],
            sp.ShardedObject(
                decode_value(o["values"][rank]), object_index(grid_cell(rank, grid)), grid
            ),
        )
    sp.save(st, ckpt_dir)


def read_checkpoint(ckpt_dir: str, case_json: str, out_dir: str) -> None:
    """Read the case's regions and values with shardpoint into ``out_dir``."""
    import numpy as np
    import torch

    import shardpoint as sp
    from shardpoint.tree.dtypes import from_name

    from shardpoint_conformance.cases import NUMPY_DTYPES
    from shardpoint_conformance.runner import to_bytes

    with open(case_json) as f:
        case = json.load(f)
    like: dict = {}
    targets = []
    for i, t in enumerate(case["tensors"]):
        off, shp = region_of(t)
        data = torch.empty(shp, dtype=from_name(t["dtype"]).torch)
        set_path(like, t["path"], sp.ShardedTensor(data, t["shape"], off))
        targets.append((i, t, data))
    for v in case["values"]:
        set_path(like, v["path"], _shape_like(decode_value(v["value"])))
    for o in case["objects"]:
        set_path(
            like, o["path"], sp.ShardedObject(None, object_index(grid_cell(0, _grid(o))), _grid(o))
        )
    got = sp.load(ckpt_dir, like=like)
    objs = []
    for o in case["objects"]:
        # A job asks for one index per rank; one process asks for each in turn.
        vals = [encode_value(get_path(got, o["path"]))]
        for i in range(1, len(o["values"])):
            one: dict = {}
            set_path(
                one,
                o["path"],
                sp.ShardedObject(None, object_index(grid_cell(i, _grid(o))), _grid(o)),
            )
            vals.append(encode_value(get_path(sp.load(ckpt_dir, like=one), o["path"])))
        objs.append(vals)
    os.makedirs(out_dir, exist_ok=True)
    for i, t, data in targets:
        a = np.frombuffer(to_bytes(data), np.uint8).view(NUMPY_DTYPES[t["dtype"]])
        save_npy(os.path.join(out_dir, f"{i}.npy"), a.reshape(tuple(data.shape)), t["dtype"])
    with open(os.path.join(out_dir, "values.json"), "w") as f:
        json.dump(
            {
                "values": [encode_value(get_path(got, v["path"])) for v in case["values"]],
                "objects": objs,
            },
            f,
        )


def _grid(o: dict):
    """An adapter case object's grid: its ``shape`` as a tuple, else ``len(values)``."""
    return tuple(o["shape"]) if o.get("shape") else len(o["values"])


def _shape_like(v):
    if isinstance(v, dict):
        return {k: _shape_like(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_shape_like(x) for x in v]
    return "<not loaded>"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["capabilities"]:
            print(json.dumps(capabilities()))
        elif argv[:1] == ["write"] and len(argv) == 3:
            write_checkpoint(argv[1], argv[2])
        elif argv[:1] == ["read"] and len(argv) == 4:
            read_checkpoint(argv[1], argv[2], argv[3])
        else:
            print(
                "usage: capabilities | write CASE.json DIR | read DIR CASE.json OUT_DIR",
                file=sys.stderr,
            )
            return 2
    except Exception as e:  # noqa: BLE001 - the protocol reports failures on stderr
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
