"""The checkpointer object: typed results with timings, state owned per checkpointer (plan
cache, async saves and their pools, side groups), ``sp.save``/``sp.load`` as thin wrappers over
the default one; on one process and on real gloo worlds."""

import numpy as np
import pytest
import torch

import shardpoint as sp
from shardpoint.api.checkpointer import default_checkpointer
from shardpoint_testing.launch import run_world


def _state(scale: float = 1.0) -> dict:
    return {
        "w": torch.arange(12.0).view(3, 4) * scale,
        "n": np.arange(3),
        "step": int(scale),
        "o": sp.ShardedObject({"k": 1}, 0, 1),
    }


def test_load_result_is_typed_with_timings(tmp_ckpt):
    ck = sp.Checkpointer()
    res = ck.save(_state(), tmp_ckpt)
    assert isinstance(res, sp.SaveResult) and res.tensors == 2
    assert {"plan_total", "write", "commit", "total"} <= set(res.timings)
    out = ck.load(tmp_ckpt, like={"w": torch.empty(3, 4), "step": 0})
    assert isinstance(out, sp.LoadResult)
    assert torch.equal(out.tree["w"], _state()["w"]) and out.tree["step"] == 1
    assert out.path == tmp_ckpt and out.world_size == 1
    assert out.unexpected_keys == ["n"] and out.missing_keys == []
    assert out.rank_bytes_read == 48 and out.strategy in ("direct", "dedup")
    assert {"plan", "read", "total"} <= set(out.timings)
    assert all(v >= 0 for v in out.timings.values())


def test_sp_load_returns_the_tree_and_fills_report(tmp_ckpt):
    sp.save(_state(), tmp_ckpt)
    rep = sp.LoadResult()
    tree = sp.load(tmp_ckpt, like={"w": torch.empty(3, 4), "nope": 1}, strict=False, report=rep)
    assert set(tree) == {"w", "nope"} and tree["nope"] == 1
    assert rep.missing_keys == ["value 'nope'"] and rep.tree is tree
    assert rep.rank_bytes_read == 48 and "total" in rep.timings
    assert sp.LoadReport is sp.LoadResult  # the name report= always took


def test_plan_cache_belongs_to_its_checkpointer(tmp_path):
    a, b = sp.Checkpointer(), sp.Checkpointer()
    st = _state()
    assert a.save(st, str(tmp_path / "a1")).timings["plan_cached"] is False
    assert a.save(st, str(tmp_path / "a2")).timings["plan_cached"] is True
    # another checkpointer (another state, another store) has its own cache
    assert b.save(st, str(tmp_path / "b1")).timings["plan_cached"] is False
    # the default one behind sp.save is one more
    default_checkpointer()._groups.clear()
    assert sp.save(st, str(tmp_path / "d1")).timings["plan_cached"] is False
    assert sp.save(st, str(tmp_path / "d2")).timings["plan_cached"] is True
    # a changed structure plans again
    st2 = dict(st, extra=torch.ones(2))
    assert a.save(st2, str(tmp_path / "a3")).timings["plan_cached"] is False
    assert torch.equal(sp.load(str(tmp_path / "a3"))["extra"], torch.ones(2))


def test_async_saves_of_two_checkpointers_and_close(tmp_path):
    with sp.Checkpointer() as a, sp.Checkpointer() as b:
        ha = a.save(_state(1.0), str(tmp_path / "a"), async_save=True)
        hb = b.save(_state(2.0), str(tmp_path / "b"), async_save=True)
        assert isinstance(ha, sp.AsyncSave) and isinstance(hb, sp.AsyncSave)
        a.wait()
        assert ha.done() and ha.wait().tensors == 2
    assert hb.done()  # close() waited for it
    assert torch.equal(sp.load(str(tmp_path / "b"))["w"], _state(2.0)["w"])
    assert a._groups == {} and "pending_async_saves=0" in repr(a)


class FailingFlush:
    """The real store; making the staged files durable fails once (a dying disk)."""

    def __init__(self):
        from shardpoint_core.transactions.resolve import get_backend

        self.inner, self.fail = get_backend(), True

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def flush(self, root):
        if self.fail:
            self.fail = False
            raise OSError(5, "Input/output error", root)
        self.inner.flush(root)


def test_wait_raises_an_unreported_async_error_once(tmp_path):
    ck = sp.Checkpointer(backend=FailingFlush())
    h = ck.save(_state(), str(tmp_path / "x"), async_save=True)  # fails in the background
    with pytest.raises(sp.SaveFailedError, match="Input/output error"):
        ck.wait()
    assert h.reported and not (tmp_path / "x").exists()
    ck.wait()  # reported once; the next wait and save go on
    assert ck.save(_state(), str(tmp_path / "x")).tensors == 2


def test_open_and_read_metadata_use_the_checkpointers_store(tmp_ckpt):
    ck = sp.Checkpointer()
    ck.save(_state(), tmp_ckpt)
    assert set(ck.read_metadata(tmp_ckpt).tensors) == {"w", "n"}
    with ck.open(tmp_ckpt) as c:
        assert torch.equal(c["w"][1].to_torch(), torch.arange(4.0, 8.0))


def _two_checkpointers(rank, world, base):
    import shardpoint as sp

    a, b = sp.Checkpointer(), sp.Checkpointer()
    rows = torch.arange(24.0).view(6, 4)
    lo, hi = rank * 3, rank * 3 + 3
    st = {"t": sp.ShardedTensor(rows[lo:hi].clone(), (6, 4), (lo, 0)), "step": 5}
    ha = a.save(st, f"{base}/a", async_save=True)  # each makes its own side group
    hb = b.save(st, f"{base}/b", async_save=True)
    ra, rb = ha.wait(), hb.wait()
    like = {"t": sp.ShardedTensor(torch.empty(6, 2), (6, 4), (0, rank * 2))}
    out = a.load(f"{base}/b", like=like)
    again = a.save(st, f"{base}/a2")
    return (
        ra.world_size,
        rb.world_size,
        torch.equal(out.tree["t"], rows[:, rank * 2 : rank * 2 + 2]),
        out.world_size,
        again.timings["plan_cached"],
    )


def test_two_checkpointers_on_a_gloo_world(tmp_path):
    res = run_world(2, _two_checkpointers, str(tmp_path), timeout=120)
    assert res == [(2, 2, True, 2, True)] * 2
