"""The benchmark's --quick mode runs end to end (tiny sizes, one run) and prints its tables;
no timing is asserted."""
import os
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


def test_quick_benchmark_prints_every_table(capsys, tmp_path):
    sys.path.insert(0, BENCH)
    try:
        import bench
        bench.main(["--quick", "--dir", str(tmp_path)])
    finally:
        sys.path.remove(BENCH)
    out = capsys.readouterr().out
    for row in ("raw write", "shardpoint save", "shardpoint async save", "DCP save",
                "DCP async_save", "torch.save", "safetensors load", "raw read",
                "shardpoint load", "DCP load", "by columns: shardpoint (auto: ",
                "exchange rate", "1 process, whole tensors",
                "floor: shardpoint's files, raw (16 threads",
                "floor: shardpoint's files, raw read (8 threads",
                "copy into reused buffers (the staging limit)"):
        assert row in out, row
    # the format's floor writes the same files shardpoint does
    floor = next(ln for ln in out.splitlines() if ln.startswith("| floor: shardpoint's files, raw ("))
    save = next(ln for ln in out.splitlines() if ln.startswith("| shardpoint save |"))
    assert floor.split("|")[-2] == save.split("|")[-2] != " "
    assert "page cache: NOT dropped (--quick)" in out
    assert os.listdir(tmp_path) == []       # everything it wrote is removed
