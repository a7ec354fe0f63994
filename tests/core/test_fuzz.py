"""The readers' fuzzer, short: mutated manifests, zarr.json files, shard indexes and chunks
all end in documented errors, in a memory-bounded reader process (issue 21). The long run
is `shardpoint conformance fuzz --cases 10000`."""
import pytest

from shardpoint_conformance import fuzz


def test_short_fuzz_run_finds_only_documented_errors(tmp_path):
    rep = fuzz.run_fuzz(12, seed=20261125, memory_bytes=1 << 30, workdir=str(tmp_path),
                        timeout=120, log=lambda s: None)
    assert rep["cases"] == 12
    assert rep["failures"] == [], rep["failures"]
    # the mutations reach every reader and are refused by rule, not all waved through
    assert sum(v for k, v in rep["outcomes"].items() if k.startswith("load: ")) == 12
    assert any("CorruptCheckpointError" in k for k in rep["outcomes"])


def test_mutations_are_reproducible_from_the_seed(tmp_path):
    import torch
    import shardpoint as sp
    from shardpoint_core.zarr import TensorStoreBackend
    sp.save({"w": torch.ones(64), "v": 3}, str(tmp_path / "base"),
            backend=TensorStoreBackend(shard_above_bytes=64, inner_chunk_bytes=32))
    a = fuzz.make_case(str(tmp_path / "base"), str(tmp_path / "a"), 7)
    b = fuzz.make_case(str(tmp_path / "base"), str(tmp_path / "b"), 7)
    assert a == b
    for name in ("manifest.msgpack",):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.parametrize("out,bad", [
    ({"load": ["documented", "CorruptCheckpointError", "SP-READ-3"],
      "verify": ["ok", []]}, False),
    ({"load": ["UNDOCUMENTED", "TypeError", "x", ""]}, True),
    ({"load": ["documented", "ShardpointError", None]}, True),
    ({"crash": "killed by signal 11", "stderr": ""}, True),
])
def test_judge(out, bad):
    assert bool(fuzz.judge(out)) is bad
