"""Megatron-core's semantics through the shardpoint backend (issue 33, issue 32's common
state): ShardedObjects holding a ``set`` or an ``io.BytesIO`` round-trip without a pickle,
``allow_shape_mismatch`` loads trim and pad as Megatron does, our errors are Megatron's
``CheckpointingException`` too, the common state is no pickle with the backend named alone,
and the load strategy reads a checkpoint written through the DCP plug-in. One gloo rank
(Megatron's ``save`` needs a process group); the real megatron-core throughout."""

import importlib.util
import os

import pytest

from shardpoint_testing.launch import run_world

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (pip install "
    "'megatron-core==0.16.*', part of the test extra)",
)


def _objects_and_common(rank, world, base):
    import io
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    import shardpoint.integrations.megatron_strategy  # noqa: F401  (registers the backend)

    def ssd(load):
        return {
            "w": ShardedTensor.from_rank_offsets(
                "w", torch.zeros(3) if load else torch.arange(3.0)
            ),
            "ObjB": ShardedObject(
                "ObjB", None if load else {7, 3, "x"}, (1, 1), (0, 0), replica_id=0
            ),
            "blob": ShardedObject("blob", None if load else io.BytesIO(b"\x00raw"), (1,), (0,)),
            "frozen": ShardedObject(
                "frozen", None if load else {"f": frozenset({1, 2}), "l": [{4}]}, (1,), (0,)
            ),
            "iteration": 5,
            "seen": {"a", "b"},
        }

    d = f"{base}/ckpt"
    os.makedirs(d)
    dist_checkpointing.save(ssd(False), d, sharded_strategy=("shardpoint", 1))
    out = dist_checkpointing.load(ssd(True), d)
    files = sorted(f for _r, _ds, fs in os.walk(d) for f in fs if f.endswith((".pt", ".pkl")))
    # under Megatron's fully-parallel wrapper too; another backend's save keeps common.pt
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    class Other(SaveShardedStrategy):  # another backend (torch_dist forks, not allowed here)
        def save(self, sharded_state_dict, checkpoint_dir):
            pass

    listings = {}
    for name, strategy in (
        ("fp", FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("shardpoint"))),
        ("td", Other("other", 1)),
    ):
        os.makedirs(f"{base}/{name}")
        dist_checkpointing.save(
            {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2)), "iteration": 1},
            f"{base}/{name}",
            sharded_strategy=strategy,
        )
        listings[name] = "common.pt" in os.listdir(f"{base}/{name}")
    return {
        "listings": listings,
        "ObjB": out["ObjB"],
        "blob": (type(out["blob"]).__name__, out["blob"].getvalue()),
        "frozen": out["frozen"],
        "iteration": out["iteration"],
        "seen": out["seen"],
        "w": out["w"].tolist(),
        "listing": sorted(os.listdir(d)),
        "pickles": files,
    }


def test_sets_and_bytesio_in_sharded_objects_and_common_state_without_pickle(tmp_path):
    """Megatron's own save with ``sharded_strategy=("shardpoint", 1)`` and nothing else: sets,
    frozensets and BytesIO come back as themselves; no ``common.pt`` is written."""
    out = run_world(1, _objects_and_common, str(tmp_path), timeout=120)[0]
    assert out["ObjB"] == {7, 3, "x"} and isinstance(out["ObjB"], set)
    assert out["blob"] == ("BytesIO", b"\x00raw")
    assert out["frozen"] == {"f": frozenset({1, 2}), "l": [{4}]}
    assert type(out["frozen"]["f"]) is frozenset
    assert out["iteration"] == 5 and out["seen"] == {"a", "b"} and out["w"] == [0.0, 1.0, 2.0]
    assert out["listing"] == ["common", "metadata.json", "shardpoint"], out["listing"]
    assert out["pickles"] == []
    assert out["listings"] == {"fp": False, "td": True}, out["listings"]
    # the directory loads in a process that never imported the strategy module
    # (load_megatron finds the backend from metadata.json)
    got = run_world(1, _load_without_registration, str(tmp_path), timeout=120)[0]
    assert got == ([0.0, 1.0, 2.0], {7, 3, "x"}, b"\x00raw", 5, {"a", "b"}, False), got


def _shape_mismatch(rank, world, base):
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import CheckpointingException, ShardedTensor
    import shardpoint as sp
    from shardpoint.integrations.megatron import load_megatron, save_megatron
    import shardpoint.integrations.megatron_strategy  # noqa: F401

    emb = torch.arange(40.0).reshape(10, 4)
    d = f"{base}/m"
    os.makedirs(d)
    dist_checkpointing.save(
        {"emb": ShardedTensor.from_rank_offsets("emb", emb.clone())},
        d,
        sharded_strategy=("shardpoint", 1),
    )
    save_megatron({"emb": ShardedTensor.from_rank_offsets("emb", emb.clone())}, f"{base}/own")
    out = {}

    def target(rows, pieces=1, allow=True):
        per = rows // pieces
        ts = [
            ShardedTensor(
                "emb",
                torch.full((per, 4), -1.0),
                torch.float32,
                (per, 4),
                (rows, 4),
                (i * per, 0),
                (pieces, 1),
                allow_shape_mismatch=allow,
            )
            for i in range(pieces)
        ]
        return {f"emb{i}": t for i, t in enumerate(ts)}

    for name, rows, pieces in (("trim", 8, 1), ("pad", 12, 1), ("pad2", 12, 2), ("outside", 24, 2)):
        for how in ("megatron", "own"):
            t = target(rows, pieces)
            got = (
                dist_checkpointing.load(t, d)
                if how == "megatron"
                else load_megatron(t, f"{base}/own")
            )
            full = torch.cat([got[f"emb{i}"] for i in range(pieces)])
            want = torch.zeros(rows, 4)
            n = min(rows, 10)
            want[:n] = emb[:n]
            out[(name, how)] = torch.equal(full, want)
    # another dtype: Megatron's load (DCP underneath) casts into the target; so do we
    ints = torch.arange(8).reshape(2, 4)
    os.makedirs(f"{base}/i")
    dist_checkpointing.save(
        {"i": ShardedTensor.from_rank_offsets("i", ints.clone())},
        f"{base}/i",
        sharded_strategy=("shardpoint", 1),
    )
    for i, how in enumerate(
        (
            lambda t: dist_checkpointing.load(t, f"{base}/i"),
            lambda t: load_megatron(t, f"{base}/i/shardpoint"),
        )
    ):
        t = {
            "i": ShardedTensor.from_rank_offsets(
                "i", torch.zeros(2, 4), allow_shape_mismatch=bool(i)
            )
        }
        got = how(t)["i"]
        out[("cast", i)] = got.dtype == torch.float32 and torch.equal(got, ints.float())
    try:  # without the flag, a mismatch is refused, Megatron's way too
        dist_checkpointing.load(target(12, 1, allow=False), d)
        out["refused"] = "loaded"
    except CheckpointingException as e:
        out["refused"] = (isinstance(e, sp.LayoutMismatchError), str(e)[:300])
    return out


def test_allow_shape_mismatch_trims_and_pads_as_megatron(tmp_path):
    out = run_world(1, _shape_mismatch, str(tmp_path), timeout=120)[0]
    refused = out.pop("refused")
    assert all(out.values()), out
    assert refused[0] is True and "emb" in refused[1], refused


def _errors_and_dcp(rank, world, base):
    import argparse
    import torch
    import torch.distributed.checkpoint as dcp
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import (
        CheckpointingException,
        ShardedObject,
        ShardedTensor,
    )
    import shardpoint as sp
    from shardpoint.dcp import ShardpointWriter
    from shardpoint.integrations.megatron_strategy import ShardpointLoadStrategy

    out = {}
    d = f"{base}/bad"
    os.makedirs(d)
    try:
        dist_checkpointing.save(
            {"o": ShardedObject("o", argparse.Namespace(a=1), (1,), (0,))},
            d,
            sharded_strategy=("shardpoint", 1),
        )
        out["save"] = "saved"
    except CheckpointingException as e:
        import pickle

        out["save"] = (isinstance(e, sp.UnsupportedValueError), type(e).__name__)
        out["pickled"] = pickle.dumps(e)
    # a checkpoint written through the DCP plug-in, keyed by Megatron keys, read by the
    # shardpoint load strategy (what dist_checkpointing.load calls)
    w = torch.arange(12.0).reshape(4, 3)
    dcp.save({"decoder.w": w, "step": 3}, storage_writer=ShardpointWriter(f"{base}/dcp"))
    ssd = {"w": ShardedTensor.from_rank_offsets("decoder.w", torch.zeros(4, 3))}
    got = ShardpointLoadStrategy().load(ssd, f"{base}/dcp")
    out["dcp"] = torch.equal(got["w"], w)
    # and by load_megatron: one shard of it, and a common value from the same top-level name
    from shardpoint.integrations.megatron import load_megatron

    part = {
        "w": ShardedTensor.from_rank_offsets("decoder.w", torch.zeros(2, 3), (0, 1, 2)),
        "step": 0,
    }
    got = load_megatron(part, f"{base}/dcp")
    out["load_megatron"] = (got["w"].tolist(), got["step"])
    # Megatron's own load demands its metadata.json before it asks any strategy
    try:
        dist_checkpointing.load(ssd, f"{base}/dcp", sharded_strategy=ShardpointLoadStrategy())
        out["megatron_load"] = "loaded"
    except CheckpointingException as e:
        out["megatron_load"] = str(e)
    # ... as it does for a checkpoint of DCP's own FileSystemWriter: the same refusal
    dcp.save({"decoder.w": w, "step": 3}, storage_writer=dcp.FileSystemWriter(f"{base}/theirs"))
    try:
        dist_checkpointing.load(ssd, f"{base}/theirs")
        out["megatron_load_theirs"] = "loaded"
    except CheckpointingException as e:
        out["megatron_load_theirs"] = str(e)
    return out


def test_errors_are_also_checkpointing_exceptions_and_dcp_checkpoints_load(tmp_path):
    out = run_world(1, _errors_and_dcp, str(tmp_path), timeout=120)[0]
    assert out["save"] == (True, "MegatronUnsupportedValueError"), out
    import pickle  # it unpickles in a process that never raised one (the class is made)
    from megatron.core.dist_checkpointing.mapping import CheckpointingException
    import shardpoint as sp

    e = pickle.loads(out["pickled"])
    assert isinstance(e, sp.UnsupportedValueError) and isinstance(e, CheckpointingException)
    assert out["dcp"] is True
    assert out["load_megatron"] == ([[6.0, 7.0, 8.0], [9.0, 10.0, 11.0]], 3), out
    assert "is not a distributed checkpoint" in out["megatron_load"], out
    # DCP's own checkpoints get the same answer: parity, and why the DCP plug-in writes no
    # Megatron metadata.json (docs/plugins-fidelity.md)
    assert "is not a distributed checkpoint" in out["megatron_load_theirs"], out


def _sharded_metadata_cells(rank, world, base):
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing import load
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
    import shardpoint.integrations.megatron_strategy  # noqa: F401
    from megatron.core import dist_checkpointing

    d = f"{base}/c"
    if rank == 0:
        os.makedirs(d)
    dist.barrier()
    dist_checkpointing.save(
        {
            "t": ShardedTensor.from_rank_offsets("t", torch.arange(2), replica_id=rank),
            "o": ShardedObject("o", {rank + 7}, (1, world), (0, rank), replica_id=0),
        },
        d,
        sharded_strategy=("shardpoint", 1),
    )
    meta = load_sharded_metadata(d)
    out = load(meta, d, validate_access_integrity=False)  # every cell, on every rank
    return sorted(meta), [out[f"o/shard_0.{i}_1.{world}"] for i in range(world)]


def test_sharded_metadata_hands_out_each_object_cell_and_they_load(tmp_path):
    """Megatron's NonStrictLoad ``test_sharded_metadata``: ``load_sharded_metadata`` gives
    each cell of an object grid under its ``unique_key``, and loading that metadata gives
    every rank every cell (several cells of one object on one rank)."""
    res = run_world(2, _sharded_metadata_cells, str(tmp_path), timeout=120)
    assert res[0] == res[1] == (["o/shard_0.0_1.2", "o/shard_0.1_1.2", "t"], [{7}, {8}]), res


def _load_without_registration(rank, world, base):
    import sys
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from shardpoint.integrations.megatron import load_megatron

    assert "shardpoint.integrations.megatron_strategy" not in sys.modules
    ssd = {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(3)),
        "ObjB": ShardedObject("ObjB", None, (1, 1), (0, 0), replica_id=0),
        "blob": ShardedObject("blob", None, (1,), (0,)),
        "iteration": 0,
        "seen": None,
    }
    out = load_megatron(ssd, f"{base}/ckpt")
    return (
        out["w"].tolist(),
        out["ObjB"],
        out["blob"].getvalue(),
        out["iteration"],
        out["seen"],
        "shardpoint.integrations.megatron_strategy" in sys.modules,
    )


def test_torch_dist_strategy_options_are_taken_in_order_or_refused():
    """``TorchDistSaveShardedStrategy``'s arguments, in its order: what shardpoint does is
    accepted, what it cannot do is refused (not silently ignored), as Megatron's exception."""
    from megatron.core.dist_checkpointing.mapping import CheckpointingException
    import shardpoint as sp
    from shardpoint.integrations.megatron_strategy import ShardpointSaveStrategy

    ShardpointSaveStrategy("shardpoint", 1, True, None, True)
    for kwargs, word in (
        ({"thread_count": 4}, "thread_count"),
        ({"keep_only_main_replica": False}, "keep_only_main_replica"),
        ({"separation_hint": "optimizer"}, "separation_hint"),
    ):
        with pytest.raises(sp.InvalidOptionError, match=word) as ei:
            ShardpointSaveStrategy("shardpoint", 1, **kwargs)
        assert isinstance(ei.value, CheckpointingException)
