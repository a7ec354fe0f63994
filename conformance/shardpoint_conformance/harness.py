"""Producer x consumer matrix between the reference implementation and an adapter.

For each case (drawn like the round-trip cases, world size 1 for the adapter):

* reference -> adapter: the reference writes (a spawned world of 2), the adapter reads;
* adapter -> reference: the adapter writes, the spec validator (``shardpoint_core.verify``) checks
  the directory, the reference reads;
* adapter -> adapter, and reference -> reference (a check of the harness itself);
* corrupt -> adapter: a reference checkpoint with one flipped chunk byte; the adapter's
  reader must refuse it (readers are strict: [SP-READ-3]).

Every read is compared bit for bit with the arrays the case was made from.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any, Optional

from shardpoint_conformance.adapters import (
    SPEC_ID,
    AdapterError,
    CommandAdapter,
    load_npy,
    region_of,
    write_case_files,
)
from shardpoint_conformance.cases import (
    decode_value,
    expected_array,
    first_difference,
    grid_cell,
    object_value,
    piece_of,
    same_bits,
)
from shardpoint_conformance.strategies import generate_case

PAIRS = [
    "reference→reference",
    "reference→adapter",
    "adapter→reference",
    "adapter→adapter",
    "corrupt→adapter",
]
REF_WORLD = 2


# -------------------------------------------------------------------------------- cases
def make_case(seed: int, index: int, caps: dict, objects_count: int) -> tuple:
    """(adapter case, arrays, skip notes) for case ``index``, filtered by capabilities."""
    base = generate_case(seed + index, 1, 1, "ci", case_id=f"a{index:03d}")
    rng = random.Random(f"adapter:{seed}:{index}")
    feats = set(caps["features"])
    notes = []
    tensors: list[dict[str, Any]] = []  # the adapter case's tensor entries (JSON-shaped)
    arrays = {}
    anchor = {"path": ["anchor"], "key": "anchor", "dtype": "float32", "shape": [6, 4]}
    for t in [anchor] + base["tensors"]:
        if t["dtype"] not in caps["dtypes"]:
            notes.append(f"{t['key']}: dtype {t['dtype']} not supported by the adapter")
            continue
        if 0 in t["shape"] and "zero_size" not in feats:
            notes.append(f"{t['key']}: zero-size tensors not supported")
            continue
        if not t["shape"] and "scalar" not in feats:
            notes.append(f"{t['key']}: 0-d tensors not supported")
            continue
        e = {
            "path": t["path"],
            "key": t["key"],
            "dtype": t["dtype"],
            "shape": t["shape"],
            "file": f"arrays/{len(tensors)}.npy",
        }
        if "partial_read" in feats and t["shape"] and t is not anchor and rng.random() < 0.6:
            off = [rng.randint(0, n) for n in t["shape"]]
            e["read"] = {
                "offset": off,
                "shape": [rng.randint(0, n - o) for n, o in zip(t["shape"], off)],
            }
        arrays[t["key"]] = expected_array(base["seed"], t["key"], t["dtype"], t["shape"])
        tensors.append(e)
    values = base["values"] if "values" in feats else []
    if base["values"] and not values:
        notes.append("values: not supported by the adapter")
    objects = []
    if "objects" in feats:
        for o in base["objects"]:
            e = {"path": o["path"], "key": o["key"]}
            grid: object = objects_count
            if o.get("shape") and "object_grid" in feats:  # a 2-D grid of the same cells
                grid = e["shape"] = rng.choice([[1, objects_count], [objects_count, 1]])
            e["values"] = [
                object_value(base["seed"], o["key"], grid_cell(i, grid))
                for i in range(objects_count)
            ]
            objects.append(e)
    elif base["objects"]:
        notes.append("objects: not supported by the adapter")
    case = {
        "version": 1,
        "id": base["id"],
        "seed": base["seed"],
        "tensors": tensors,
        "values": values,
        "objects": objects,
    }
    return case, arrays, notes


# -------------------------------------------------------------------------------- checks
def compare_output(case: dict, arrays: dict, out_dir: str) -> list:
    """Problems with what a reader wrote to ``out_dir`` (empty list: bitwise correct)."""
    problems = []
    for i, t in enumerate(case["tensors"]):
        off, shp = region_of(t)
        want = piece_of(arrays[t["key"]], off, shp, None)
        p = os.path.join(out_dir, f"{i}.npy")
        try:
            got = load_npy(p, t["dtype"])
        except Exception as e:  # noqa: BLE001
            problems.append(f"{t['key']}: cannot read {i}.npy ({type(e).__name__}: {e})")
            continue
        if not same_bits(got, want):
            problems.append(f"{t['key']} region {off}+{shp}: {first_difference(got, want)}")
    try:
        with open(os.path.join(out_dir, "values.json")) as f:
            vals = json.load(f)
    except Exception as e:  # noqa: BLE001
        return problems + [f"values.json: {type(e).__name__}: {e}"]
    got_v = [decode_value(v) for v in vals.get("values", [])]
    want_v = [decode_value(v["value"]) for v in case["values"]]
    if got_v != want_v:
        problems.append(f"values: got {got_v!r:.200} expected {want_v!r:.200}")
    got_o = [[decode_value(x) for x in o] for o in vals.get("objects", [])]
    want_o = [[decode_value(x) for x in o["values"]] for o in case["objects"]]
    if got_o != want_o:
        problems.append(f"objects: got {got_o!r:.200} expected {want_o!r:.200}")
    return problems


def validate(ckpt: str) -> tuple:
    """(problems, note): the spec validator's findings on a directory, if it is installed."""
    try:
        from shardpoint_core.verify import verify_checkpoint
    except ImportError:
        return [], "validator not available (shardpoint_core.verify)"
    try:
        return [(str(s), str(m)) for s, m in verify_checkpoint(ckpt, strict=True)], ""
    except Exception as e:  # noqa: BLE001 - a validator crash is a finding too
        sid = getattr(e, "spec_id", None) or "VALIDATOR"
        return [(sid, f"validator raised {type(e).__name__}: {e}")], ""


def chunk_files(where: str) -> list:
    """Stored chunk files under a checkpoint (or one array's folder): every file under
    ``tensors/`` but zarr.json, and the packed layout's data objects (``packed/*.bin``,
    spec section 13), largest first."""
    out = []
    sub = os.path.join(where, "tensors")
    for d, _dirs, files in os.walk(sub if os.path.isdir(sub) else where):
        out += [os.path.join(d, f) for f in files if f != "zarr.json"]
    packed = os.path.join(where, "packed")
    if os.path.isdir(packed) and not os.path.isdir(sub):
        out = [os.path.join(packed, f) for f in os.listdir(packed) if f.endswith(".bin")]
    return sorted(out, key=lambda p: (-os.path.getsize(p), p))


def chunk_spots(ckpt: str, key: Optional[str] = None) -> list:
    """(file, byte position) inside a stored chunk of the checkpoint ``ckpt`` (of tensor
    ``key`` only, where given), largest chunk first: a chunk file and None (its middle) in
    the per-array layout; in the packed one the data object and the middle of the chunk's
    record ([SP-PACK-4]), never padding between chunks."""
    from shardpoint_core.format.manifest import decode_manifest

    with open(os.path.join(ckpt, "manifest.msgpack"), "rb") as f:
        m = decode_manifest(f.read())
    if m.packed is None:
        where = ckpt if key is None else os.path.join(ckpt, m.tensors[key].array)
        return [(p, None) for p in chunk_files(where)]
    spots = []
    for k, e in m.tensors.items():
        if key is not None and k != key:
            continue
        for r in e.packed.records:
            path = os.path.join(ckpt, e.packed.objects[int(r["object"])][0])
            spots.append((int(r["length"]), path, int(r["offset"]) + int(r["length"]) // 2))
    return [(p, pos) for _n, p, pos in sorted(spots, key=lambda t: (-t[0], t[1], t[2]))]


def flip_byte(path: str, pos: Optional[int] = None) -> None:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        i = len(data) // 2 if pos is None else pos
        data[i] ^= 0x40
        f.seek(0)
        f.write(data)


def _cell(status: str, detail: str = "", spec_ids: Optional[list] = None) -> dict:
    return {"status": status, "detail": detail, "spec_ids": sorted(set(spec_ids or []))}


def _ref_read(ckpt: str, case_json: str, out: str) -> dict:
    from shardpoint_conformance.reference_adapter import read_checkpoint

    try:
        read_checkpoint(ckpt, case_json, out)
    except Exception as e:  # noqa: BLE001
        sid = getattr(e, "spec_id", None)
        return _cell(
            "fail",
            f"reference reader: {type(e).__name__}: {e}"[:600],
            [sid] if sid else SPEC_ID.findall(str(e)),
        )
    return _cell("ok")


def _ref_write_batch(rank: int, world: int, jobs: list) -> list:
    from shardpoint_conformance.reference_adapter import write_checkpoint

    out: list[Optional[str]] = []  # None: written, else why not
    for case_json, ckpt in jobs:
        try:
            write_checkpoint(case_json, ckpt, rank, world)
            out.append(None)
        except Exception as e:  # noqa: BLE001
            out.append(f"{type(e).__name__}: {e}")
    return out


def _judge(case: dict, arrays: dict, out: str, read_cell: dict) -> dict:
    if read_cell["status"] != "ok":
        return read_cell
    problems = compare_output(case, arrays, out)
    return _cell("fail", "wrong data: " + "; ".join(problems)[:600]) if problems else read_cell


# -------------------------------------------------------------------------------- driver
def run_matrix(
    adapter_cmd: str,
    *,
    cases: int = 6,
    seed: int = 0,
    workdir: Optional[str] = None,
    timeout: float = 120.0,
    log=print,
    keep: bool = False,
) -> dict:
    """Run every pair on ``cases`` cases; returns a JSON-ready report. The files of passing
    cases are removed unless ``keep`` (failing ones stay under ``dir``), and the temporary
    directory made when no ``workdir`` is given once it is empty."""
    from shardpoint_testing.launch import RankFailure, run_world

    adapter = CommandAdapter(adapter_cmd, timeout)
    caps = adapter.capabilities()
    own = not workdir
    root = workdir or tempfile.mkdtemp(prefix="shardpoint-adapter-test-")
    os.makedirs(root, exist_ok=True)
    log(
        f"adapter {caps.get('name')!r} ({adapter_cmd}); {len(caps['dtypes'])} dtypes, "
        f"features {caps['features']}; dir {root}"
    )
    made = []
    for i in range(cases):
        ref_case, arrays, notes = make_case(seed, i, caps, REF_WORLD)
        adp_case, _, _ = make_case(seed, i, caps, 1)
        cdir = os.path.join(root, ref_case["id"])
        shutil.rmtree(cdir, ignore_errors=True)
        made.append(
            {
                "id": ref_case["id"],
                "ref_case": ref_case,
                "adp_case": adp_case,
                "arrays": arrays,
                "notes": notes,
                "dir": cdir,
                "ref_json": write_case_files(ref_case, arrays, f"{cdir}/ref-case"),
                "adp_json": write_case_files(adp_case, arrays, f"{cdir}/adapter-case"),
            }
        )
    t0 = time.perf_counter()
    jobs = [(m["ref_json"], f"{m['dir']}/ref-ckpt") for m in made]
    try:
        errs = run_world(REF_WORLD, _ref_write_batch, jobs, timeout=60 + 20 * len(jobs))[0]
    except RankFailure as e:
        errs = [f"reference writer world failed: {e}"[:600]] * len(jobs)
    log(
        f"  reference wrote {len(jobs)} checkpoint(s) in a world of {REF_WORLD} "
        f"({time.perf_counter() - t0:.1f}s)"
    )
    rows = []
    for m, err in zip(made, errs):
        d, cells = m["dir"], {}
        ref_ckpt, adp_ckpt = f"{d}/ref-ckpt", f"{d}/adapter-ckpt"
        if err:
            for p in ("reference→reference", "reference→adapter", "corrupt→adapter"):
                cells[p] = _cell("fail", f"reference writer: {err}")
        else:
            cells["reference→reference"] = _judge(
                m["ref_case"],
                m["arrays"],
                f"{d}/out-rr",
                _ref_read(ref_ckpt, m["ref_json"], f"{d}/out-rr"),
            )
            cells["reference→adapter"] = _adapter_read_cell(
                adapter, ref_ckpt, m["ref_json"], m["ref_case"], m["arrays"], f"{d}/out-ra"
            )
            bad = f"{d}/corrupt-ckpt"
            shutil.copytree(ref_ckpt, bad)
            victim, pos = chunk_spots(bad, "anchor")[0]  # read in full
            flip_byte(victim, pos)
            os.makedirs(f"{d}/out-ca", exist_ok=True)
            r = adapter.read(bad, m["ref_json"], f"{d}/out-ca")
            cells["corrupt→adapter"] = (
                _cell("ok", f"refused: {r.brief()}", r.spec_ids)
                if not r.ok
                else _cell(
                    "fail",
                    f"adapter read a checkpoint with a flipped byte in "
                    f"{os.path.relpath(victim, bad)} without an error",
                    ["SP-READ-3"],
                )
            )
        w = adapter.write(m["adp_json"], adp_ckpt)
        if not w.ok:
            for p in ("adapter→reference", "adapter→adapter"):
                cells[p] = _cell("fail", "adapter writer: " + w.brief(), w.spec_ids)
        else:
            problems, note = validate(adp_ckpt)
            cell = _judge(
                m["adp_case"],
                m["arrays"],
                f"{d}/out-ar",
                _ref_read(adp_ckpt, m["adp_json"], f"{d}/out-ar"),
            )
            if problems:
                cell = _cell(
                    "fail",
                    "validator: "
                    + "; ".join(f"[{s}] {msg}" for s, msg in problems[:5])[:600]
                    + (" | " + cell["detail"] if cell["detail"] else ""),
                    [s for s, _ in problems] + cell["spec_ids"],
                )
            elif note and cell["status"] == "ok":
                cell["detail"] = note
            cells["adapter→reference"] = cell
            cells["adapter→adapter"] = _adapter_read_cell(
                adapter, adp_ckpt, m["adp_json"], m["adp_case"], m["arrays"], f"{d}/out-aa"
            )
        rows.append(
            {
                "id": m["id"],
                "seed": m["ref_case"]["seed"],
                "notes": m["notes"],
                "tensors": len(m["ref_case"]["tensors"]),
                "cells": cells,
            }
        )
    if not keep:
        _cleanup(root, made, rows, own)
    return {
        "adapter": adapter_cmd,
        "capabilities": caps,
        "dir": root,
        "rows": rows,
        "ok": all(c["status"] != "fail" for r in rows for c in r["cells"].values()),
    }


def _cleanup(root: str, made: list, rows: list, own_root: bool) -> None:
    """Remove the directories of the cases whose cells all passed (only those this run
    made), and ``root`` when the run made it and nothing is left in it."""
    for m, r in zip(made, rows):
        if all(c["status"] != "fail" for c in r["cells"].values()):
            shutil.rmtree(m["dir"], ignore_errors=True)
    if own_root and os.path.isdir(root) and not os.listdir(root):
        shutil.rmtree(root, ignore_errors=True)


def _adapter_read_cell(
    adapter, ckpt: str, case_json: str, case: dict, arrays: dict, out: str
) -> dict:
    """The adapter reads ``ckpt`` into ``out``; the cell judges what it wrote."""
    os.makedirs(out, exist_ok=True)
    r = adapter.read(ckpt, case_json, out)
    return _judge(
        case,
        arrays,
        out,
        _cell("ok") if r.ok else _cell("fail", "adapter reader: " + r.brief(), r.spec_ids),
    )


def format_report(rep: dict) -> str:
    def short(c: dict) -> str:
        if c["status"] == "ok":
            return "ok" + (f"[{','.join(c['spec_ids'])}]" if c["spec_ids"] else "")
        return f"{c['status'].upper()}" + (f"[{','.join(c['spec_ids'])}]" if c["spec_ids"] else "")

    head = ["case"] + PAIRS
    lines = [head] + [
        [r["id"]] + [short(r["cells"].get(p, _cell("skip"))) for p in PAIRS] for r in rep["rows"]
    ]
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    out = ["  ".join(x[i].ljust(widths[i]) for i in range(len(head))) for x in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    out.append("\nproducer \\ consumer    reference      adapter")
    for prod in ("reference", "adapter"):
        cells = []
        for cons in ("reference", "adapter"):
            cs = [
                r["cells"][f"{prod}→{cons}"] for r in rep["rows"] if f"{prod}→{cons}" in r["cells"]
            ]
            ids = sorted({i for c in cs for i in c["spec_ids"] if c["status"] == "fail"})
            cells.append(
                f"{sum(c['status'] == 'ok' for c in cs)}/{len(cs)}"
                + (f" {','.join(ids)}" if ids else "")
            )
        out.append(f"{prod:<22} {cells[0]:<14} {cells[1]}")
    for r in rep["rows"]:
        for p, c in r["cells"].items():
            if c["status"] == "fail":
                out.append(f"\n{r['id']} {p}: {c['detail']}")
        for n in r["notes"]:
            out.append(f"{r['id']} skipped part: {n}")
    if not rep["ok"]:
        out.append(f"\nthe failing cases' files are kept under {rep['dir']}")
    out.append(f"\nadapter-test: {'PASSED' if rep['ok'] else 'FAILED'}")
    return "\n".join(out)


def run_adapter_test(
    adapter_cmd: str,
    *,
    cases: int = 6,
    seed: int = 0,
    workdir: Optional[str] = None,
    json_out: Optional[str] = None,
    timeout: float = 120.0,
    keep: bool = False,
) -> int:
    """``shardpoint conformance adapter-test``: print the matrix; 0 when nothing failed."""
    try:
        rep = run_matrix(
            adapter_cmd, cases=cases, seed=seed, workdir=workdir, timeout=timeout, keep=keep
        )
    except AdapterError as e:  # the adapter's own fault: one line, no traceback of ours
        print(f"adapter-test could not run: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001
        print(f"adapter-test could not run: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        return 1
    print(format_report(rep))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(rep, f, indent=1, default=str)
    return 0 if rep["ok"] else 1
