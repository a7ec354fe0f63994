"""Pictures of layouts (issue 32): a tensor's chunk grid by writer and chunk, and a
resharding load's plan (which rank reads which chunk, who sends what to whom), drawn as boxes
in the terminal. The tests read the drawing's labels and boxes, not its pixels."""

import json

import torch

import shardpoint as sp
from shardpoint.planning.planner import LocalPlan, PlanOptions, plan_load, plan_save
from shardpoint.tools import layout as lay
from shardpoint.tools.cli import main as cli
from shardpoint.tree.model import Holding

TREE = {"dict": [["w", {"tensor": "w"}]]}


def saved_by_two():
    """w[6x4] float32 held by 2 ranks (3 rows each) and saved in chunks of 3x4: the pure
    save planner elects each rank the writer of its own rows."""
    plans = [
        LocalPlan(r, TREE, [Holding("w", "float32", (6, 4), (3 * r, 0), (3, 4), None, (0,))], [])
        for r in range(2)
    ]
    return plan_save(plans, PlanOptions(max_chunk_bytes=48))


def rows(text):
    return text.splitlines()


def test_chunks_drawn_by_writer_from_a_two_rank_save_plan():
    plan = saved_by_two()
    t = plan.tensors["w"]
    writers = lay.save_writers(plan, "w")
    assert writers == {(0, 0): 0, (1, 0): 1}
    d = lay.draw_chunks("w", t.shape, t.dtype, t.chunk_shape, writers, width=40)
    assert [b[2] for b in d.boxes] == ["c0,0 r0", "c1,0 r1"]
    assert [b[:2] for b in d.boxes] == [((0, 0), (3, 4)), ((3, 0), (6, 4))]
    lines = rows(d.plain)
    assert lines[0] == "w: float32[6x4], 2 chunk(s) of 3x4"
    assert lines[1].startswith("┌") and lines[-1].startswith("└")
    assert sum(ln.startswith("├") for ln in lines) == 1  # two boxes, one above the other
    assert sum("c0,0 r0" in ln for ln in lines) == 1 and d.notes == []
    # each writer its own colour
    styles = {str(s.style) for s in d.text.spans}
    assert {lay.PALETTE[0], lay.PALETTE[1]} <= styles


def test_a_two_rank_save_loaded_by_three_ranks_is_drawn_by_reader_and_destination():
    plan = saved_by_two()
    t = plan.tensors["w"]
    works = plan_load(lay.even_requests("w", "float32", (6, 4), 3), plan.tensors)
    d = lay.draw_load_plan(works, t, width=40, writers=lay.save_writers(plan, "w"))
    # rank 1 needs rows 2:4, across both chunks: row 2 of chunk 0 from the rank that reads
    # it, row 3 of chunk 1 likewise; ranks 0 and 2 read their chunk and keep their rows
    assert [(b[0], b[1]) for b in d.boxes] == [
        ((0, 0), (2, 4)),
        ((2, 0), (3, 4)),
        ((3, 0), (4, 4)),
        ((4, 0), (6, 4)),
    ]
    labels = [b[2] for b in d.boxes]
    assert labels == ["c0,0 r0", "c0,0 r0→r1", "c1,0 r2→r1", "c1,0 r2"]
    text = d.plain
    assert "saved: c0,0 by r0, c1,0 by r1" in text
    assert "  rank 0: reads c0,0 (8 element(s) in all)" in text
    assert (
        "  rank 1: reads nothing; receives [2:3, 0:4] of c0,0 from r0, [3:4, 0:4] of "
        "c1,0 from r2 (8 element(s) in all)"
    ) in text
    assert "  rank 2: reads c1,0 (8 element(s) in all)" in text
    grid = [ln for ln in rows(text) if ln[:1] in "┌├└│"]
    assert sum(ln.startswith("├") for ln in grid) == 3 and all(lab in text for lab in labels)
    pieces = lay.plan_pieces(works, "w", t.chunk_shape)
    assert sorted((p.dest, p.reader, p.chunk) for p in pieces) == [
        (0, 0, (0, 0)),
        (1, 0, (0, 0)),
        (1, 2, (1, 0)),
        (2, 2, (1, 0)),
    ]


def test_one_three_and_zero_dimensional_tensors_and_fine_grids():
    d = lay.draw_chunks("v", (10,), "float32", (3,), width=50)
    assert [b[2] for b in d.boxes] == ["c0", "c1", "c2", "c3"]
    assert len(rows(d.plain)) == 4  # title, top, one row of boxes, bottom
    assert "does not record which rank wrote" in d.notes[0]
    d = lay.draw_chunks("t", (4, 6, 8), "float32", (2, 3, 4), width=50)
    assert sorted(b[2] for b in d.boxes) == ["c0,0,*", "c0,1,*", "c1,0,*", "c1,1,*"]
    assert any("dimensions 0 and 1 of 3" in n for n in d.notes)
    assert [b[2] for b in lay.draw_chunks("s", (), "float32", (), width=20).boxes] == ["c"]
    d = lay.draw_chunks("x", (1000, 3000), "float32", (64, 128), width=78)
    assert any("16x24 chunks: each box is a block" in n for n in d.notes)
    assert len(d.boxes) <= lay.MAX_ROWS * lay.MAX_COLS and "c15,20-23" in d.plain
    assert max(len(ln) for ln in rows(d.plain)[1:]) <= 80


def test_inspect_layout_and_its_load_plan_on_a_checkpoint(tmp_path, capsys):
    p = str(tmp_path / "ck")
    sp.save(
        {"model": {"w": torch.ones(16, 16)}, "step": 1},
        p,
        options=sp.SaveOptions(plan=sp.PlanOptions(max_chunk_bytes=256)),
    )  # 4x16 chunks
    assert cli(["inspect", p, "--layout", "model/w"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model/w: float32[16x16], 4 chunk(s) of 4x16, saved by 1 rank(s)")
    assert all(f"c{i},0" in out for i in range(4)) and out.count("├") == 3
    assert "note: the manifest does not record which rank wrote each chunk" in out
    assert cli(["inspect", p, "--layout", "model/w", "--load-ranks", "3", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["load_ranks"] == 3
    got = {}
    for b in d["boxes"]:  # every row lands on exactly one destination rank
        dest = int(b["label"].rsplit("r", 1)[1])
        got[dest] = got.get(dest, 0) + (b["hi"][0] - b["lo"][0])
    assert got == {0: 5, 1: 5, 2: 6}
    assert cli(["inspect", p, "--layout", "step"]) == 2
    assert "'step' is a value" in capsys.readouterr().err
    assert cli(["inspect", p, "--load-ranks", "2"]) == 2
    assert "give --layout KEY" in capsys.readouterr().err
