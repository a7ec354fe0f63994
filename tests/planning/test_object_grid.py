"""Sharded objects over a multi-dimensional grid (format 1.1, [SP-OBJ-1..4], [SP-REPL-2]).

Megatron's ``ShardedObject`` has ``global_offset``/``global_shape`` (e.g. one RNG state per
(pipeline stage, tensor rank), replicated over data parallel); shardpoint takes the same as
tuple ``index``/``count``. Planner rules on metadata, then one real 4-rank gloo save loaded
back cell by cell.
"""

import os

import msgpack
import pytest

import shardpoint as sp
from shardpoint_core.format.manifest import decode_manifest, encode_manifest
from shardpoint.planning.planner import LocalPlan, plan_objects
from shardpoint_testing.launch import run_world


def lp(rank, *objs):
    return LocalPlan(rank, None, [], list(objs))


def test_grid_cells_come_back_in_row_major_order_with_the_grid_shape():
    plans = [lp(r, ("o", (r // 3, r % 3), (2, 3), (0,), f"v{r}")) for r in range(6)]
    plans = [
        LocalPlan.from_bytes(LocalPlan(p.rank, {"dict": []}, [], p.objects).to_bytes())
        for p in reversed(plans)
    ]  # wire round trip, shuffled order
    got = plan_objects(plans)["o"]
    assert list(got) == [f"v{r}" for r in range(6)] and got.shape == (2, 3)


def test_an_int_index_is_the_one_dimensional_grid():
    a = plan_objects([lp(0, ("o", 0, 2, (0,), "a")), lp(1, ("o", (1,), (2,), (0,), "b"))])
    assert list(a["o"]) == ["a", "b"] and a["o"].shape == (2,)
    o = sp.ShardedObject(1, 1, 2)
    assert (o.index, o.count, o.grid_index, o.grid_shape) == (1, 2, (1,), (2,))


@pytest.mark.parametrize(
    "objs, sid, words",
    [
        ([("o", (0, 0), (2, 2), (0,), 1), ("o", (1,), (4,), (0,), 2)], "SP-OBJ-2", ["[2, 2]", "4"]),
        (
            [("o", (0, 0), (1, 1), (0,), 1), ("o", (0, 0), (1, 1), (0, 0), 2)],
            "SP-REPL-2",
            ["main replica", "0", "1"],
        ),
        ([("o", (0, 0), (2, 1), (0,), 1)], "SP-OBJ-3", ["(1, 0)"]),
        ([("o", (0, 5), (2, 2), (0,), 1)], "SP-OBJ-1", ["(0, 5)"]),
    ],
)
def test_invalid_grids_name_the_key_and_the_rule(objs, sid, words):
    with pytest.raises(sp.InvalidShardingError) as e:
        plan_objects([lp(r, o) for r, o in enumerate(objs)])
    assert e.value.spec_id == sid and "'o'" in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_non_main_replicas_may_share_an_id_and_the_main_one_is_stored():
    # Megatron: the main holder has replica id 0, every other holder 1.
    got = plan_objects(
        [
            lp(2, ("o", 0, 1, (1,), "other")),
            lp(1, ("o", 0, 1, (1,), "other")),
            lp(3, ("o", 0, 1, (0,), "main")),
        ]
    )
    assert list(got["o"]) == ["main"]
    got = plan_objects([lp(1, ("o", 0, 1, (0, 1), "x")), lp(0, ("o", 0, 1, (0, 1), "x"))])
    assert list(got["o"]) == ["x"]  # no main replica at all: lowest id, lowest rank


def test_constructor_refuses_mismatched_grids():
    for index, count in (
        ((0,), (2, 2)),
        ((2, 0), (2, 2)),
        ((0, -1), (2, 2)),
        ((), ()),
        ((True,), (2,)),
    ):
        with pytest.raises(sp.InvalidShardingError) as e:
            sp.ShardedObject(None, index, count)
        assert e.value.spec_id == "SP-OBJ-1"


@pytest.mark.parametrize("layout", ["per-array", "packed"])
def test_manifest_stores_the_grid_only_when_it_is_not_one_dimensional(tmp_ckpt, layout):
    state = {"o": sp.ShardedObject(1, 0, 1), "g": sp.ShardedObject(2, (0, 0), (1, 1))}
    sp.save(state, tmp_ckpt, backend=sp.ZarrBackend() if layout == "per-array" else None)
    raw = open(f"{tmp_ckpt}/manifest.msgpack", "rb").read()
    body = msgpack.unpackb(msgpack.unpackb(raw)["body"], strict_map_key=False)
    # the grid is a 1.1 construct ([SP-VER-1]); a state of objects alone has no array, so
    # the default (packed) backend writes no `packed` field either: every 1.x reader reads it
    assert body["format_version"] == [1, 1]
    assert "packed" not in body and not os.path.exists(f"{tmp_ckpt}/packed")
    assert body["objects"]["o"] == {"count": 1, "values": [1]}  # as in format 1.0
    assert body["objects"]["g"] == {"count": 1, "values": [2], "shape": [1, 1]}
    m = decode_manifest(raw)
    assert m.objects["g"].shape == (1, 1) and decode_manifest(encode_manifest(m)).objects[
        "g"
    ].shape == (1, 1)


def _save_grid(rank, world, path):
    stage, tp = rank // 2, rank % 2
    sp.save(
        {
            "rng": sp.ShardedObject({"stage": stage, "tp": tp}, (stage, tp), (2, 2)),
            "per_stage": sp.ShardedObject([stage], (stage,), (2,), replica_id=tp),
            "shared": sp.ShardedObject("one", (0, 0), (1, 1), replica_id=min(rank, 1)),
        },
        path,
    )
    return True


def test_a_4_rank_stage_by_tensor_grid_saves_and_loads_cell_by_cell(tmp_path):
    path = str(tmp_path / "ck")
    assert run_world(4, _save_grid, path, timeout=180) == [True] * 4
    for stage in range(2):
        for tp in range(2):
            got = sp.load(
                path,
                {
                    "rng": sp.ShardedObject(None, (stage, tp), (2, 2)),
                    "per_stage": sp.ShardedObject(None, stage, 2),
                },
            )
            assert got == {"rng": {"stage": stage, "tp": tp}, "per_stage": [stage]}
    with pytest.raises(sp.LayoutMismatchError) as e:
        sp.load(path, {"rng": sp.ShardedObject(None, 1, 4)})
    msg = str(e.value)
    assert e.value.spec_id == "SP-OBJ-2" and "'rng'" in msg and "(2, 2)" in msg and "4" in msg
    whole = sp.load(path)
    assert whole["rng"] == [[{"stage": s, "tp": t} for t in range(2)] for s in range(2)]
    assert whole["per_stage"] == [[0], [1]] and whole["shared"] == [["one"]]
