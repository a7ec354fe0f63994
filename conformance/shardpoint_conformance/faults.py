"""Fault cases: ranks killed in the middle of a save, and damaged bytes on disk.

*Kills.* :class:`KillingBackend` wraps the storage backend (passed to ``save`` with
``backend=``; the library is not touched). When the environment variable
``SHARDPOINT_CONFORMANCE_KILL="RANK:POINT[:N]"`` is set in a rank, that rank SIGKILLs itself
(a real ``os.kill``) at POINT:

* ``write:N``          after its N-th chunk write reached the disk,
* ``before-manifest``  (coordinator) with every chunk written, before the manifest,
* ``after-manifest``   (coordinator) with the manifest staged, before the commit,
* ``mid-commit``       (coordinator) inside an overwriting commit, once it published,
* ``after-commit``     (coordinator) right after the commit.

With ``async_save=True`` the new save runs asynchronously: the kill then happens in the
background thread that writes and commits, after the call returned to the caller.

The rule checked ([SP-COMMIT-*]): the previous checkpoint stays loadable and bitwise intact,
and the new one is either complete (bitwise) or invisible (not found / incomplete).

*Damage.* A flipped byte in any chunk or shard index, a truncated chunk, a missing chunk, a
truncated or flipped manifest, a missing manifest: each must raise its documented error,
never return wrong data.
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

from shardpoint_conformance.backends import (  # noqa: F401 - API: re-exported
    KILL_ENV,
    KILL_POINTS,
    FailingWrites,
    KillingBackend,
)


# -------------------------------------------------------------------------------- kills
def _save_rank(
    rank: int, world: int, case: dict, path: str, kill: bool, async_save: bool = False
) -> int:
    import shardpoint as sp
    from shardpoint_conformance.runner import build_save_state

    be = KillingBackend() if kill else None
    out = sp.save(
        build_save_state(case, rank, world), path, overwrite=True, backend=be, async_save=async_save
    )
    if async_save:
        out.wait()
    return be.writes if be else 0


def fault_case(world: int, seed: int = 5) -> dict:
    """A case whose save gives every rank several chunks to write (plain data)."""
    from shardpoint_core.format.keys import encode_key

    tensors, layouts = [], {}
    for i in range(2 * world + 2):
        path: list[str | int] = ["layers", i, "w"]
        key = encode_key(tuple(path))
        shape = [4 * world, 3 + i % 3]
        tensors.append(
            {
                "path": path,
                "key": key,
                "dtype": ["float32", "bfloat16", "int64", "float8_e5m2"][i % 4],
                "shape": shape,
            }
        )
        owner = i % world  # one rank per tensor (pipeline style): no exchange needed
        layouts[key] = {"kind": f"owner r{owner}", "pieces": [[owner, [0, 0], shape, None, [0]]]}
    return {
        "seed": seed,
        "id": "fault",
        "profile": "fault",
        "tensors": tensors,
        "values": [{"path": ["step"], "value": seed}],
        "objects": [],
        "save": {"world": world, "tensors": layouts, "objects": {}},
        "load": {"world": 1, "like": False, "tensors": {}, "objects": {}},
    }


def check_full(path: str, case: dict) -> list:
    """Problems loading ``path`` (one process, whole tree) against ``case``'s expected bits."""
    import shardpoint as sp
    from shardpoint_conformance.cases import expected_array, get_path
    from shardpoint_conformance.runner import to_bytes

    got = sp.load(path)
    problems = []
    for t in case["tensors"]:
        want = expected_array(case["seed"], t["key"], t["dtype"], t["shape"])
        if to_bytes(get_path(got, t["path"])) != want.tobytes():
            problems.append(f"{t['key']}: bits differ")
    for v in case["values"]:
        if get_path(got, v["path"]) != v["value"]:
            problems.append(f"value {v['path']}: {get_path(got, v['path'])!r} != {v['value']!r}")
    return problems


def kill_during_save(
    root: str,
    world: int,
    rank: int,
    point: str,
    n: int = 1,
    *,
    overwrite: bool = True,
    pg_timeout: float = 8.0,
    async_save: bool = False,
) -> dict:
    """Save A, then save B with ``rank`` killed at ``point``; judge what is on disk.

    ``overwrite``: B goes to A's path (replacing it); else to a new path next to it.
    ``async_save``: B is an async save, so the kill lands in its background thread.
    Returns ``{"killed", "state", "ok", "problems"}``; ``state`` names what a reader sees.
    """
    import shardpoint as sp
    from shardpoint_testing.launch import RankFailure, run_world

    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    a = fault_case(world, seed=11)
    b = dict(a, seed=22, values=[{"path": ["step"], "value": 22}])
    pa = os.path.join(root, "ckpt")
    pb = pa if overwrite else os.path.join(root, "ckpt-next")
    run_world(world, _save_rank, a, pa, False, timeout=120)
    os.environ[KILL_ENV] = f"{rank}:{point}:{n}"
    killed = False
    try:
        run_world(
            world,
            _save_rank,
            b,
            pb,
            True,
            async_save,
            timeout=60 + 3 * pg_timeout,
            pg_timeout=pg_timeout,
        )
    except RankFailure as e:
        killed = "code -9" in str(e) or "-9" in str(e)
        detail = str(e)[:300]
    else:
        detail = "save finished (the kill point was never reached)"
    finally:
        del os.environ[KILL_ENV]
    problems = []
    if not overwrite:
        try:
            problems += [f"previous checkpoint: {p}" for p in check_full(pa, a)]
        except Exception as e:  # noqa: BLE001
            problems.append(f"previous checkpoint unreadable: {type(e).__name__}: {e}")
    try:
        got_a = check_full(pb, a) if overwrite else ["(not the previous)"]
        if overwrite and not got_a:
            state = "previous"
        else:
            got_b = check_full(pb, b)
            state = "new" if not got_b else "WRONG DATA"
            if got_b:
                problems.append(f"{pb} loads but matches neither checkpoint: {got_b[:3]}")
    except (sp.CheckpointNotFoundError, sp.IncompleteCheckpointError) as e:
        state = f"invisible ({type(e).__name__})"
        if overwrite:
            problems.append(f"the previous checkpoint at {pb} is gone: {e}")
    except Exception as e:  # noqa: BLE001
        state = f"ERROR {type(e).__name__}"
        problems.append(f"{pb}: {type(e).__name__}: {e}")
    return {
        "killed": killed,
        "state": state,
        "ok": killed and not problems,
        "problems": problems,
        "detail": detail,
        "point": f"rank {rank} {point}:{n}" + (" (async)" if async_save else ""),
        "leftovers": sorted(os.listdir(root)),
    }


# -------------------------------------------------------------------------------- damage
def damaged_checkpoints(root: str) -> list[tuple[str, str, str, type[Exception]]]:
    """Write one small checkpoint (plain chunks and sharded chunks with inner-chunk indexes)
    and derive damaged copies. Returns ``[(name, path, expected spec_id, error class)]``."""
    import torch
    import shardpoint as sp
    from shardpoint_core.transactions.backend import ZarrBackend
    from shardpoint_conformance.harness import chunk_files, flip_byte

    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    good = os.path.join(root, "good")
    g = torch.Generator().manual_seed(3)
    state = {
        "w": torch.randn(16, 8, generator=g),
        "b": torch.randint(0, 9, (7,)),
        "h": torch.randn(4, 4, generator=g).to(torch.bfloat16),
        "step": 3,
    }
    # Small thresholds: "w" (512 B) becomes a sharded chunk with an index of inner chunks.
    sp.save(state, good, backend=ZarrBackend(shard_above_bytes=256, inner_chunk_bytes=64))
    out: list[tuple[str, str, str, type[Exception]]] = []

    def copy(name: str) -> str:
        p = os.path.join(root, name)
        shutil.copytree(good, p)
        return p

    for i, f in enumerate(chunk_files(good)):
        rel = os.path.relpath(f, good)
        size = os.path.getsize(f)
        for where, pos in (("first", 0), ("middle", size // 2), ("last", size - 1)):
            p = copy(f"flip-{i}-{where}")
            flip_byte(os.path.join(p, rel), pos)
            out.append(
                (f"flipped {where} byte of {rel}", p, "SP-READ-3", sp.CorruptCheckpointError)
            )
        p = copy(f"trunc-{i}")
        with open(os.path.join(p, rel), "r+b") as fh:
            fh.truncate(size - 3)
        out.append((f"truncated {rel}", p, "SP-READ-3", sp.CorruptCheckpointError))
        p = copy(f"missing-{i}")
        os.remove(os.path.join(p, rel))
        out.append((f"missing {rel}", p, "SP-READ-2", sp.CorruptCheckpointError))
    man = "manifest.msgpack"
    size = os.path.getsize(os.path.join(good, man))
    for cut in (0, 1, size // 2, size - 1):
        p = copy(f"man-trunc-{cut}")
        with open(os.path.join(p, man), "r+b") as fh:
            fh.truncate(cut)
        out.append(
            (
                f"manifest truncated to {cut} of {size} bytes",
                p,
                "SP-MAN-1",
                sp.CorruptCheckpointError,
            )
        )
    p = copy("man-flip")
    flip_byte(os.path.join(p, man))
    out.append(("flipped manifest byte", p, "SP-MAN-1", sp.CorruptCheckpointError))
    p = copy("man-missing")
    os.remove(os.path.join(p, man))
    out.append(("manifest missing", p, "SP-COMMIT-3", sp.IncompleteCheckpointError))
    return out


def check_damage(name: str, path: str, spec_id: str, err_type: type[Exception]) -> Optional[str]:
    """None if loading ``path`` raises ``err_type`` with ``spec_id``; else the problem."""
    import shardpoint as sp

    try:
        sp.load(path)
    except err_type as e:
        got = getattr(e, "spec_id", None)  # None too where the class carries no ID
        if got != spec_id:
            return f"{name}: raised {type(e).__name__} with {got}, expected {spec_id}"
        return None
    except Exception as e:  # noqa: BLE001
        return f"{name}: raised {type(e).__name__}: {e} (expected {err_type.__name__} [{spec_id}])"
    return f"{name}: loaded without an error (silent wrong data)"
