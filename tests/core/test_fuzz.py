"""The readers' fuzzer, short: mutated manifests, zarr.json files, shard indexes and chunks
all end in documented errors, in a memory-bounded reader process (issue 21). The long run
is `shardpoint conformance fuzz --cases 10000`."""

import re

import pytest

from shardpoint_conformance import fuzz


def test_short_fuzz_run_finds_only_documented_errors(tmp_path, capsys):
    """Through the command (``shardpoint conformance fuzz``), whose report says what each
    reader did with the copies (it said "verify: ok: 12", meaning only "did not crash")."""
    import json
    from shardpoint_conformance.cli import main

    out = tmp_path / "rep.json"
    assert (
        main(
            [
                "fuzz",
                "--cases",
                "12",
                "--seed",
                "20261125",
                "--memory",
                "1GiB",
                "--dir",
                str(tmp_path / "w"),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    rep = json.loads(out.read_text())
    assert rep["cases"] == 12
    assert rep["failures"] == [], rep["failures"]
    # the mutations reach every reader and are refused by rule, not all waved through
    assert sum(v for k, v in rep["outcomes"].items() if k.startswith("load: ")) == 12
    assert any("CorruptCheckpointError" in k for k in rep["outcomes"])
    assert (
        "fuzz: 12 mutated copies, each read by read_metadata, load and verify; 0 failures" in text
        and ": ok:" not in text
    ), text
    for name in ("read_metadata", "load"):
        line = next(ln.strip() for ln in text.splitlines() if ln.strip().startswith(name))
        refused = re.search(r"refused with a documented error: (\d+)", line)
        accepted = re.search(r"accepted \(read without error[^)]*\): (\d+)", line)
        assert refused and accepted and "crashed: 0" in line, line
        assert int(refused[1]) + int(accepted[1]) == 12, line  # every copy, once


def test_mutations_are_reproducible_from_the_seed(tmp_path):
    import torch
    import shardpoint as sp
    from shardpoint_core.transactions.backend import ZarrBackend

    sp.save(
        {"w": torch.ones(64), "v": 3},
        str(tmp_path / "base"),
        backend=ZarrBackend(shard_above_bytes=64, inner_chunk_bytes=32),
    )
    a = fuzz.make_case(str(tmp_path / "base"), str(tmp_path / "a"), 7)
    b = fuzz.make_case(str(tmp_path / "base"), str(tmp_path / "b"), 7)
    assert a == b
    for name in ("manifest.msgpack",):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.parametrize(
    "out,bad",
    [
        (
            {"load": ["documented", "CorruptCheckpointError", "SP-READ-3"], "verify": ["ok", []]},
            False,
        ),
        ({"load": ["UNDOCUMENTED", "TypeError", "x", ""]}, True),
        ({"load": ["documented", "ShardpointError", None]}, True),
        ({"crash": "killed by signal 11", "stderr": ""}, True),
    ],
)
def test_judge(out, bad):
    assert bool(fuzz.judge(out)) is bad
