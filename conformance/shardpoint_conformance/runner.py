"""Run cases: save each in its saving layout, load it in its loading layout, compare bits.

Locally (:func:`run_local`) every world size gets one spawned gloo world that runs a whole
batch of cases (spawning costs seconds); under ``torchrun`` (:func:`run_in_job`) the job's
own world runs every case, and so does one world on a test cluster's hosts
(:func:`run_cases_cluster`, all its cases being of that world's size). The per-rank functions :func:`save_batch` and :func:`load_batch`
are the same in both modes. Results are plain dicts; :func:`format_table` prints them.
"""

from __future__ import annotations

import os
import shutil
import time
import traceback
from typing import Any, Optional

import numpy as np

from shardpoint_conformance.cases import (
    case_bytes,
    decode_value,
    describe_layout,
    expected_array,
    first_difference,
    get_path,
    grid_values,
    is_pieces,
    object_grid,
    object_index,
    object_value,
    piece_of,
    rank_pieces,
    set_path,
)

_MESH: dict = {}


# -------------------------------------------------------------------------------- tensors
def to_torch(a: np.ndarray, device: str = "cpu"):
    """numpy (ml_dtypes included) -> torch tensor with the same bits, via raw bytes."""
    import torch
    from shardpoint.tree.dtypes import from_numpy

    tdt = from_numpy(a.dtype).torch
    if a.size == 0:
        return torch.empty(a.shape, dtype=tdt, device=device)
    raw = torch.from_numpy(np.frombuffer(np.ascontiguousarray(a).tobytes(), np.uint8).copy())
    return raw.view(tdt).reshape(a.shape).to(device)


def to_bytes(t) -> bytes:
    import torch

    if hasattr(t, "to_local"):
        t = t.to_local()
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _not(a: np.ndarray) -> np.ndarray:
    """A sentinel differing from ``a`` in every element (unfilled targets get caught)."""
    if a.dtype == np.bool_:
        return ~a
    raw = np.frombuffer(np.ascontiguousarray(a).tobytes(), np.uint8) ^ 0xFF
    return raw.view(a.dtype).reshape(a.shape)


def _mesh(world: int, device: str):
    if world not in _MESH:
        from torch.distributed.device_mesh import init_device_mesh

        _MESH[world] = init_device_mesh(device.split(":")[0], (world,))
    return _MESH[world]


def _dtensor(local, kind: str, shape: list, world: int, device: str):
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    place = kind.split(" ")[1]
    p = Replicate() if place == "R" else Shard(int(place[1:]))
    stride = tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))
    return DTensor.from_local(
        local, _mesh(world, device), [p], run_check=False, shape=torch.Size(shape), stride=stride
    )


# -------------------------------------------------------------------------------- per rank
def _all_ok(ok: bool, device: str) -> bool:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return ok
    t = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item()) == 0


def _err(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}"[:2000], "spec_id": getattr(e, "spec_id", None)}


def build_save_state(case: dict, rank: int, world: int, device: str = "cpu") -> dict:
    """This rank's state tree for the case's saving layout."""
    import shardpoint as sp

    st: dict = {}
    for t in case["tensors"]:
        lay = case["save"]["tensors"][t["key"]]
        full = expected_array(case["seed"], t["key"], t["dtype"], t["shape"])
        several = []
        for _r, off, shp, flat, rep in rank_pieces(lay, rank):
            if lay["kind"].startswith("dtensor"):
                leaf = _dtensor(
                    to_torch(piece_of(full, off, shp, None), device),
                    lay["kind"],
                    t["shape"],
                    world,
                    device,
                )
            elif rep is None:
                leaf = to_torch(full, device)
            else:
                leaf = sp.ShardedTensor(
                    to_torch(piece_of(full, off, shp, flat), device),
                    t["shape"],
                    off,
                    local_shape=shp,
                    flattened_range=tuple(flat) if flat else None,
                    replica_id=tuple(rep),
                )
            several.append(leaf)
            set_path(st, t["path"], leaf)
        if is_pieces(lay) and several:
            set_path(st, t["path"], sp.ShardedPieces(several))
    for v in case["values"]:
        set_path(st, v["path"], decode_value(v["value"]))
    for o in case["objects"]:
        for r, idx, rep in case["save"]["objects"].get(o["key"], []):
            if r == rank:
                val = decode_value(object_value(case["seed"], o["key"], idx))
                set_path(
                    st,
                    o["path"],
                    sp.ShardedObject(val, object_index(idx), object_grid(o), replica_id=tuple(rep)),
                )
    return st


def save_batch(
    rank: int, world: int, cases: list, root: str, device: str = "cpu", backend: Any = None
) -> list:
    """Save every case of the batch (collective); one result dict per case. With
    ``SHARDPOINT_CONFORMANCE_KILL`` set, saves go through :class:`.faults.KillingBackend`
    (a rehearsal: the run must then report the failure)."""
    import shardpoint as sp
    from shardpoint_conformance.backends import KILL_ENV, KillingBackend

    if backend is None and os.environ.get(KILL_ENV):
        backend = KillingBackend()
    out = []
    for case in cases:
        res: dict = {"id": case["id"], "ok": False}
        try:
            st = build_save_state(case, rank, world, device)
            built = True
        except Exception as e:  # noqa: BLE001 - reported in the table
            res.update(_err(e))
            res["error"] = "building the state: " + res["error"] + traceback.format_exc()[-800:]
            built = False
        if not _all_ok(built, device):
            res.setdefault("error", "another rank failed to build its state")
            out.append(res)
            continue
        path = os.path.join(root, case["id"])
        t0 = time.perf_counter()
        try:
            r = sp.save(st, path, overwrite=True, backend=backend)
            res.update(ok=True, bytes=r.unique_bytes, time=time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001
            res.update(_err(e))
        if res["ok"] and rank == 0:
            res.update(_validate(path))
        out.append(res)
    return out


def _validate(path: str) -> dict:
    """Run the spec validator on a written checkpoint when the library ships one."""
    try:
        from shardpoint_core.verify import verify_checkpoint
    except ImportError:
        return {"validated": None}
    problems = list(verify_checkpoint(path, strict=True))
    if problems:
        return {
            "ok": False,
            "validated": False,
            "spec_id": problems[0][0],
            "error": "validator: " + "; ".join(f"[{s}] {m}" for s, m in problems[:5]),
        }
    return {"validated": True}


def _check(name: str, got: bytes, want: np.ndarray, problems: list) -> None:
    if got != np.ascontiguousarray(want).tobytes():
        g = np.frombuffer(got, np.uint8)
        if len(got) == want.nbytes:
            g = g.view(want.dtype).reshape(want.shape)
            problems.append(f"{name}: {first_difference(g, want)}")
        else:
            problems.append(f"{name}: got {len(got)} bytes, expected {want.nbytes}")


def load_batch(
    rank: int, world: int, cases: list, root: str, device: str = "cpu", backend: Any = None
) -> list:
    """Load every case of the batch in its loading layout and compare with the expected bits."""
    import shardpoint as sp

    out = []
    for case in cases:
        res: dict = {"id": case["id"], "ok": False}
        path = os.path.join(root, case["id"])
        try:
            like, targets = _build_like(case, rank, world, device)
            built = True
        except Exception as e:  # noqa: BLE001
            res.update(_err(e))
            built = False
        if not _all_ok(built, device):
            res.setdefault("error", "another rank failed to build its load targets")
            out.append(res)
            continue
        t0 = time.perf_counter()
        try:
            got = sp.load(path, like=like, backend=backend)
            res["time"] = time.perf_counter() - t0
            problems = _compare(case, rank, got, targets)
            res["ok"] = not problems
            if problems:
                res["error"] = "wrong data: " + "; ".join(problems[:5])
        except Exception as e:  # noqa: BLE001
            res.update(_err(e))
        out.append(res)
    return out


def _build_like(case: dict, rank: int, world: int, device: str) -> tuple:
    import shardpoint as sp

    if not case["load"]["like"]:
        return None, []
    like: dict = {}
    targets = []  # (name, target tensor, expected numpy)
    for t in case["tensors"]:
        lay = case["load"]["tensors"][t["key"]]
        full = expected_array(case["seed"], t["key"], t["dtype"], t["shape"])
        several = []
        for _r, off, shp, flat, rep in rank_pieces(lay, rank):
            want = piece_of(full, off, shp, flat)
            data = to_torch(_not(want), device)
            if lay["kind"].startswith("dtensor"):
                leaf = _dtensor(data, lay["kind"], t["shape"], world, device)
            elif rep is None:
                leaf = data
            else:
                leaf = sp.ShardedTensor(
                    data,
                    t["shape"],
                    off,
                    local_shape=shp,
                    flattened_range=tuple(flat) if flat else None,
                )
            targets.append((f"{t['key']}@{off}+{shp}{'/' + str(flat) if flat else ''}", leaf, want))
            several.append(leaf)
            set_path(like, t["path"], leaf)
        if is_pieces(lay) and several:
            set_path(like, t["path"], sp.ShardedPieces(several))
    for v in case["values"]:
        set_path(like, v["path"], _placeholder(decode_value(v["value"])))
    for o in case["objects"]:
        for r, idx in case["load"]["objects"].get(o["key"], []):
            if r == rank:
                set_path(like, o["path"], sp.ShardedObject(None, object_index(idx), object_grid(o)))
    return like, targets


def _placeholder(v: Any) -> Any:
    """Same containers as ``v`` (the tree keeps them), every scalar leaf replaced."""
    if isinstance(v, dict):
        return {k: _placeholder(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_placeholder(x) for x in v]
    return "<not loaded>"


def _compare(case: dict, rank: int, got: Any, targets: list) -> list:
    problems: list = []
    if case["load"]["like"]:
        for name, leaf, want in targets:
            data = leaf.data if hasattr(leaf, "global_offset") else leaf
            _check(name, to_bytes(data), want, problems)
        for o in case["objects"]:
            for r, idx in case["load"]["objects"].get(o["key"], []):
                if r == rank:
                    want = decode_value(object_value(case["seed"], o["key"], idx))
                    have = get_path(got, o["path"])
                    if have != want:
                        problems.append(f"object {o['key']}[{idx}]: {have!r} != {want!r}")
    else:
        for t in case["tensors"]:
            want = expected_array(case["seed"], t["key"], t["dtype"], t["shape"])
            _check(t["key"], to_bytes(get_path(got, t["path"])), want, problems)
        for o in case["objects"]:
            want = grid_values(case["seed"], o["key"], object_grid(o))
            if get_path(got, o["path"]) != want:
                problems.append(f"object {o['key']}: {get_path(got, o['path'])!r} != {want!r}")
    for v in case["values"]:
        want = decode_value(v["value"])
        have = get_path(got, v["path"])
        if have != want or type(have) is not type(want):
            problems.append(f"value {v['path']}: {have!r} != {want!r}")
    return problems


# -------------------------------------------------------------------------------- drivers
def _merge(rank_results: list) -> list:
    """Per-case results of every rank -> one result per case."""
    merged = []
    for per_case in zip(*rank_results):
        bad = [(r, x) for r, x in enumerate(per_case) if not x["ok"]]
        m = dict(per_case[0])
        m["ok"] = not bad
        m["time"] = max(x.get("time", 0.0) for x in per_case)
        if bad:
            r, x = bad[0]
            m["error"] = f"rank {r}: {x.get('error')}"
            m["spec_id"] = x.get("spec_id")
        merged.append(m)
    return merged


def _run_batch(world: int, fn, batch: list, root: str, timeout: float, launch=None) -> list:
    """``fn`` on a world of ``world`` ranks: spawned here (``launch`` None) or by ``launch``
    (``launch(fn, *args, timeout=, pg_timeout=)``, e.g. a test cluster's ``run``)."""
    from shardpoint_testing.launch import RankFailure, run_world

    try:
        if launch is None:
            out = run_world(world, fn, batch, root, timeout=timeout, pg_timeout=60)
        else:
            out = launch(fn, batch, root, timeout=timeout, pg_timeout=60)
        return _merge(out)
    except RankFailure as e:
        return [
            {"id": c["id"], "ok": False, "error": f"world of {world} failed: {e}"[:3000]}
            for c in batch
        ]


def run_cases_local(
    cases: list, root: str, *, timeout_per_case: float = 30.0, log=print, launch=None
) -> list:
    """Save and load ``cases`` in spawned gloo worlds, one world per size and phase
    (``launch``: run each world another way, e.g. on a test cluster's hosts)."""
    rows = {c["id"]: {"case": c} for c in cases}
    for w in sorted({c["save"]["world"] for c in cases}):
        batch = [c for c in cases if c["save"]["world"] == w]
        t0 = time.perf_counter()
        for r in _run_batch(w, save_batch, batch, root, 60 + timeout_per_case * len(batch), launch):
            rows[r["id"]]["save"] = r
        log(f"  saved {len(batch)} case(s) in a world of {w} ({time.perf_counter() - t0:.1f}s)")
    for w in sorted({c["load"]["world"] for c in cases}):
        batch = [c for c in cases if c["load"]["world"] == w and rows[c["id"]]["save"]["ok"]]
        if not batch:
            continue
        t0 = time.perf_counter()
        for r in _run_batch(w, load_batch, batch, root, 60 + timeout_per_case * len(batch), launch):
            rows[r["id"]]["load"] = r
        log(f"  loaded {len(batch)} case(s) in a world of {w} ({time.perf_counter() - t0:.1f}s)")
    return [_row(rows[c["id"]]) for c in cases]


def run_cases_cluster(
    cases: list,
    root: str,
    hosts: int,
    ranks_per_host: int,
    *,
    link_mbit: Optional[float] = None,
    s3_url: Optional[str] = None,
    timeout_per_case: float = 30.0,
    log=print,
) -> list:
    """Save and load ``cases`` (all of world ``hosts x ranks_per_host``) on a test cluster
    of this machine (:mod:`shardpoint_testing.cluster`: hosts as network namespaces, links
    shaped to ``link_mbit``, ``root`` the shared directory), in one world that saves every
    case and then loads it. With ``s3_url`` (``s3://BUCKET/PREFIX``) the checkpoints go to
    an S3-compatible server on the cluster's storage host instead, reached over the shaped
    links; each row then says what the server holds for its case (``stored``), listed on
    the storage host. Needs root."""
    from shardpoint_testing.cluster import Cluster, Link
    from shardpoint_testing.launch import RankFailure

    bucket, _, prefix = (s3_url or "").partition("://")[2].partition("/")
    with Cluster(
        hosts, ranks_per_host, Link(mbit=link_mbit), shared_dir=None if s3_url else root
    ) as c:
        log(
            f"  test cluster: {hosts} host(s) x {ranks_per_host} rank(s) as network "
            f"namespaces, links {f'{link_mbit:g} Mbit/s' if link_mbit else 'unshaped'}"
        )
        s3 = c.s3_server(bucket) if s3_url else None
        if s3 is not None:
            log(
                f"  storage host: S3-compatible server at {s3.endpoint}, checkpoints under {s3_url}"
            )
        crossed = c.link_bytes(-1)
        t0 = time.perf_counter()
        try:
            rows = c.run(
                _job,
                cases,
                s3_url or root,
                timeout=60 + 2 * timeout_per_case * len(cases),
                pg_timeout=60,
                env=s3.env() if s3 else None,
            )[0]
        except RankFailure as e:  # a rank died or hung: every case failed
            rows = [
                _row(
                    {
                        "case": cs,
                        "save": {"ok": False, "error": f"world of {c.world} failed: {e}"[:3000]},
                    }
                )
                for cs in cases
            ]
        log(
            f"  saved and loaded {len(cases)} case(s) in a world of {c.world} "
            f"({time.perf_counter() - t0:.1f}s)"
        )
        if s3 is not None:
            crossed = c.link_bytes(-1) - crossed
            held = s3.objects(f"{prefix}/" if prefix else "")
            for r in rows:
                mine = {
                    k: v
                    for k, v in held.items()
                    if k.startswith(f"{prefix}/{r['id']}/".lstrip("/"))
                }
                r["stored"] = {
                    "objects": len(mine),
                    "bytes": sum(mine.values()),
                    "manifest": any(k.endswith("/manifest.msgpack") for k in mine),
                }
            log(
                f"  storage host: the server holds {len(held)} object(s), "
                f"{sum(held.values())} bytes, under {s3_url}; the storage link carried "
                f"{crossed} bytes both ways (they go with the cluster)"
            )
        return rows


def _job(rank: int, world: int, cases: list, root: str) -> list:
    """One rank of a cluster world: every case saved, then loaded (:func:`run_in_job`)."""
    return run_in_job(cases, root, "cpu")


def _row(r: dict) -> dict:
    c, s, ld = r["case"], r.get("save", {}), r.get("load")
    ok = s.get("ok", False) and ld is not None and ld.get("ok", False)
    failed = s if not s.get("ok", False) else (ld or {})
    return {
        "id": c["id"],
        "seed": c["seed"],
        "save_world": c["save"]["world"],
        "load_world": c["load"]["world"],
        "profile": c["profile"],
        "save_layout": describe_layout(c["save"]),
        "load_layout": describe_layout(c["load"]) + ("" if c["load"]["like"] else "(all)"),
        "bytes": case_bytes(c),
        "save_s": s.get("time"),
        "load_s": (ld or {}).get("time"),
        "ok": ok,
        "phase": None if ok else ("save" if failed is s else "load"),
        "error": None if ok else failed.get("error", "not run"),
        "spec_id": None if ok else failed.get("spec_id"),
    }


def run_in_job(cases: list, root: str, device: str) -> list:
    """Under torchrun: this job's world saves and loads every case. Collective."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    # Test results travel as msgpack through the library's own control channel (no pickle).
    import msgpack
    from shardpoint.exchange.comm import Comm

    comm = Comm()

    def merged(mine: list) -> list:
        return _merge(
            [
                msgpack.unpackb(b, strict_map_key=False)
                for b in comm.all_gather_bytes(msgpack.packb(mine))
            ]
        )

    saves = merged(save_batch(rank, world, cases, root, device))
    # every rank loads the same cases (rank 0's validator may fail a save the others passed)
    ok_ids = {r["id"] for r in saves if r["ok"]}
    loaded = load_batch(rank, world, [c for c in cases if c["id"] in ok_ids], root, device)
    loads = {r["id"]: r for r in merged(loaded)} if ok_ids else {}
    return [_row({"case": c, "save": s, "load": loads.get(c["id"])}) for c, s in zip(cases, saves)]


def format_table(rows: list) -> str:
    head = ["case", "seed", "save layout", "load layout", "bytes", "save s", "load s", "result"]
    lines = [head]
    for r in rows:
        res = "ok" if r["ok"] else f"FAIL({r['phase']}{' ' + r['spec_id'] if r['spec_id'] else ''})"
        lines.append(
            [
                r["id"],
                str(r["seed"]),
                r["save_layout"][:38],
                r["load_layout"][:38],
                str(r["bytes"]),
                _fmt(r["save_s"]),
                _fmt(r["load_s"]),
                res,
            ]
        )
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    text = ["  ".join(x[i].ljust(widths[i]) for i in range(len(head))) for x in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    for r in rows:
        if not r["ok"]:
            text.append(
                f"\n{r['id']} FAILED in {r['phase']}: {r['error']}\n  replay: "
                f"shardpoint conformance run --replay {r['seed']} --save-world-sizes "
                f"{r['save_world']} --load-world-sizes {r['load_world']} --profile "
                f"{r['profile']}"
            )
    return "\n".join(text)


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3f}"


def cleanup(root: str, rows: list, own_root: bool = False) -> None:
    """Remove the checkpoints of the cases that passed (failing ones stay, for a look);
    ``own_root``: ``root`` is the run's own temporary directory, removed too once empty."""
    if "://" in root:  # an object store (--store): the committer removes what passed
        from shardpoint_core.transactions.resolve import backend_for

        committer = backend_for(root).committer
        for r in rows:
            if r["ok"]:
                committer.remove(f"{root.rstrip('/')}/{r['id']}")
        return
    for r in rows:
        if r["ok"]:
            shutil.rmtree(os.path.join(root, r["id"]), ignore_errors=True)
    if own_root and os.path.isdir(root) and not os.listdir(root):
        shutil.rmtree(root, ignore_errors=True)


def passed(rows: list) -> bool:
    """Every case passed."""
    return all(r["ok"] for r in rows)
