"""benchmarks/bench_memory_tier.py --quick runs end to end: save to memory and files, a host
lost, restores from peer memory and from storage, both checked bit for bit inside the
script, the figures written as --json."""

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


@pytest.mark.slow
def test_quick_memory_tier_benchmark_restores_both_ways(tmp_path, capsys):
    sys.path.insert(0, os.path.abspath(BENCH))
    try:
        import bench_memory_tier

        res = str(tmp_path / "bench_memory_tier.json")
        bench_memory_tier.main(
            [
                "--quick",
                "--dir",
                str(tmp_path / "d"),
                "--shm-dir",
                str(tmp_path / "shm"),
                "--json",
                res,
            ]
        )
    finally:
        sys.path.remove(os.path.abspath(BENCH))
    out = capsys.readouterr().out
    assert "restore: peer memory" in out and "to the replacement host" in out
    data = json.load(open(res))
    rows = {r["label"]: r for t in data["tables"] for r in t["rows"]}
    assert rows["from peer memory (restart of the tier included)"]["fetched_bytes"] > 0
    assert data["config"]["quick"] is True
    assert not os.path.exists(tmp_path / "shm" / f"run{os.getpid()}")
