"""Issue 30's "every loader, the CLI, the converters, the plug-ins and the managers read it":
a packed checkpoint (format 1.4) saved by ``sp.save`` is read, bit for bit, through DCP's
``dcp.load`` with our reader, Megatron's ``ShardedTensor`` loads, the converter to
safetensors, the CLI's inspect/verify/diff, and ``sp.open``. (shardpoint_jax, Orbax and the
managers: tests/jax/test_jax_packed.py and tests/api/test_incremental.py.)"""

import warnings

import pytest
import torch

import shardpoint as sp
from shardpoint.tools.cli import main as cli_main
from shardpoint_core.transactions.resolve import read_metadata


@pytest.fixture
def packed(tmp_path):
    state = {
        "w": torch.randn(8, 4),
        "b": torch.arange(5.0).to(torch.bfloat16),
        "i": torch.arange(6, dtype=torch.int64),
    }
    path = str(tmp_path / "pk")
    sp.save(state, path, backend=sp.PackedBackend())
    assert read_metadata(path).packed is not None
    return path, state


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1), b.view(-1))


def test_dcp_load_with_our_reader(packed):
    import torch.distributed.checkpoint as dcp
    from shardpoint.dcp import ShardpointReader

    path, state = packed
    target = {k: torch.empty_like(v) for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized"
        dcp.load(target, storage_reader=ShardpointReader(path))
    assert all(_same(target[k], state[k]) for k in state)


def test_megatron_sharded_tensors_load(packed):
    pytest.importorskip("megatron.core", reason="the megatron extra")
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from shardpoint.integrations.megatron import load_megatron

    path, state = packed
    ssd = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 4), (0, 1, 2))}
    out = load_megatron(ssd, path)  # rank 1 of 2 along dim 0: rows 4-7
    assert _same(out["w"], state["w"][4:])


def test_converter_cli_and_lazy_open(packed, tmp_path, capsys):
    from safetensors.torch import load_file

    path, state = packed
    out = str(tmp_path / "m.safetensors")
    assert cli_main(["convert", path, out]) == 0
    back = load_file(out)
    assert all(_same(back[k], state[k]) for k in state)
    for cmd in (["inspect", path], ["verify", path], ["diff", path, path]):
        assert cli_main(cmd) == 0, cmd
    assert "packed: 3 chunks" in capsys.readouterr().out
    with sp.open(path) as ck:
        assert _same(ck["w"][2:4].to_torch(), state["w"][2:4])
