"""The simulated checkpoint counts of ``benchmarks/bench_packed_scale.py`` against real saves:
the same states saved by 1 process (files and an object store) and by 4 real gloo processes
(files), per-array and packed: the keys written, the directories, each chunk file's size
and the packed writers' objects are those the simulation computes from the save plan."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import shardpoint as sp
from shardpoint_core.stores.location import locate
from shardpoint_core.transactions.backend import ZarrBackend
from shardpoint_core.transactions.packed import PackedBackend
from shardpoint_testing.launch import run_world

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_packed_scale as bps  # noqa: E402

SCALE = 0.05
CAP = 96 << 10  # small enough that the uniform state's writers split their objects
# 4 ranks, uniform state at scale 0.5: chunks of 512 KiB + 4 bytes; on files each chunk of
# 256 KiB and more starts on a 4 KiB boundary, so 2 of them fit below this cap, not 3
CAP4, SCALE4 = 3 * (512 << 10) + 4096, 0.5


def _normal(keys) -> list:
    """Keys with a packed writer's random id written ``w`` and an object store's save
    prefix left out, sorted."""
    out = []
    for k in keys:
        parts = [p for p in k.split("/") if not p.startswith("save-")]
        if len(parts) == 2 and parts[0] == "packed":
            parts[1] = "w-" + parts[1].rpartition("-")[2]
        out.append("/".join(parts))
    return sorted(out)


def _writers(keys) -> list:
    """Objects per packed writer, sorted."""
    per: dict = {}
    for k in keys:
        parts = k.split("/")
        name = parts[-1]
        if parts[-2:-1] == ["packed"] and name.endswith(".bin"):
            w = name.rpartition("-")[0]
            per[w] = per.get(w, 0) + 1
    return sorted(per.values())


def _files(root: str) -> tuple:
    """(relative file paths, their sizes, directories with the root) below ``root``."""
    files, sizes, dirs = [], {}, 1
    for d, ds, fs in os.walk(root):
        dirs += len(ds)
        for f in fs:
            rel = os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
            files.append(rel)
            sizes[rel] = os.path.getsize(os.path.join(d, f))
    return files, sizes, dirs


def _check_files(root: str, sim: dict, layout: str) -> None:
    files, sizes, dirs = _files(root)
    want = sim[layout]
    assert len(files) == want["files"] and dirs == want["dirs"], (layout, len(files), dirs)
    if layout == "per-array":
        assert sorted(files) == want["keys"]
        assert {k: sizes[k] for k in want["chunk_sizes"]} == want["chunk_sizes"]
    else:
        assert _normal(files) == _normal(want["keys"])
        assert _writers(files) == want["objects_per_writer"]


def _states(name: str, world: int) -> list:
    if name == "big":  # one chunk above SHARD_ABOVE_BYTES: a shard of inner chunks
        g = torch.Generator().manual_seed(3)
        return [{"big": torch.randn(1001, 2600, generator=g), "n": 1}]
    return bps.rank_states(name, world, SCALE)


@pytest.mark.parametrize("name", ["mixed", "uniform", "big"])
def test_one_process_saves_what_the_simulation_counts(tmp_path, name):
    states = _states(name, 1)
    # splits on the object store only where every chunk is alike: with chunks of varied
    # sizes the count depends on the order the write threads append them in
    cap = CAP if name == "uniform" else None
    sim = bps.checkpoint_counts(bps.local_plans(states), object_cap=cap)
    if name == "uniform":
        assert max(sim["packed object store"]["objects_per_writer"]) > 1
    sp.save(states[0], str(tmp_path / "pa"), backend=ZarrBackend())
    _check_files(str(tmp_path / "pa"), sim, "per-array")
    sp.save(states[0], str(tmp_path / "pk"), backend=PackedBackend())
    _check_files(str(tmp_path / "pk"), sim, "packed files")
    for layout, be in (
        ("per-array", ZarrBackend()),
        ("packed object store", PackedBackend(cap=cap)),
    ):
        url = f"memory://bps-{name}/{layout.replace(' ', '-')}"
        sp.save(states[0], url, backend=be)
        store, root = locate(url).pair()
        keys = [i.key[len(root) + 1 :] for i in store.list(root + "/")]
        assert len(keys) == sim[layout]["objects"], layout
        if layout == "per-array":
            assert _normal(keys) == sorted(sim[layout]["keys"] + [bps.LEASE_NAME])
        else:
            assert _normal(keys) == _normal(sim[layout]["keys"])
            assert _writers(keys) == sim[layout]["objects_per_writer"]


def _save4(rank: int, world: int, root: str) -> None:
    for name in ("mixed", "uniform"):
        state = bps.rank_states(name, world, SCALE)[rank]
        sp.save(state, os.path.join(root, name, "pa"), backend=ZarrBackend())
        sp.save(state, os.path.join(root, name, "pk"), backend=PackedBackend())
    # equal chunks per writer: the split count does not depend on the threads' order
    state = bps.rank_states("uniform", world, SCALE4)[rank]
    sp.save(state, os.path.join(root, "cap"), backend=PackedBackend(cap=CAP4))


def test_four_processes_save_what_the_simulation_counts(tmp_path):
    run_world(4, _save4, str(tmp_path), timeout=180, pg_timeout=60)
    for name in ("mixed", "uniform"):
        plans = bps.local_plans(bps.rank_states(name, 4, SCALE))
        sim = bps.checkpoint_counts(plans)
        assert sim["plan"]["writers"] == 4  # every rank writes: 4 data files
        _check_files(str(tmp_path / name / "pa"), sim, "per-array")
        _check_files(str(tmp_path / name / "pk"), sim, "packed files")
    plans = bps.local_plans(bps.rank_states("uniform", 4, SCALE4))
    capped = bps.checkpoint_counts(plans, file_cap=CAP4)
    assert capped["packed files"]["objects_per_writer"] == [4] * 4  # 8 chunks, 2 an object
    _check_files(str(tmp_path / "cap"), capped, "packed files")


def test_the_script_prints_its_table_and_data(tmp_path, capsys):
    """The script's table and its data file (3 tables: files, objects, requests; a row per
    state, world and layout); the job's packed checkpoint on files is a data file per
    writer and the manifest."""
    out = tmp_path / "scale.json"
    args = f"--dp 2 --layers 4 --hidden 256 --vocab 1003 --scale {SCALE} --json {out}"
    bps.main(args.split())
    assert "| GPT-like job, TP 8 x PP 4 x DP 2" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert [len(t["rows"]) for t in data["tables"]] == [5 * 2] * 3
    files = {r["label"]: r for r in data["tables"][0]["rows"]}
    assert all(r["values"][0] > 0 for r in files.values())
    job = {k.rpartition(": ")[2]: r for k, r in files.items() if "64 ranks" in k}
    assert job["packed"]["arrays"] == 4 * (12 * 4 + 2)  # layers x 12 + 2, 4 states each
    assert job["packed"]["files"] == job["packed"]["writers"] + 1
    assert job["per-array"]["files"] > job["packed"]["arrays"] + job["packed"]["chunks"]
