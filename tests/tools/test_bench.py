"""The benchmark's --quick mode runs end to end (tiny sizes, one run) and prints its tables;
with --json it writes them as data that the docs hook renders. No timing is asserted."""

import importlib.util
import json
import os
import re
import statistics
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
HOOK = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "_hooks", "generated.py")


def render(path: str, printed: str = "", here: bool = True) -> tuple:
    """The results file at ``path`` as the docs hook renders it (loaded in-process, without
    mkdocs), after checking each row's median, min and max against its raw values, and,
    where the script printed ``| label | median |``, that median against the printed one
    (``here``: the file was written by a run on this machine)."""
    with open(path) as f:
        data = json.load(f)
    assert data["schema"] == "shardpoint-bench/1" and data["date"] and data["tables"]
    assert data["machine"]["kernel"] and data["machine"]["nproc"] == (
        os.cpu_count() if here else data["machine"]["nproc"]
    )  # run on this machine
    assert "--json" not in data["source"] and data["source"].startswith("python benchmarks/")
    for t in data["tables"]:
        for r in t["rows"]:
            assert r["median"] == statistics.median(r["values"]), r
            assert (r["min"], r["max"]) == (min(r["values"]), max(r["values"])), r
            # as printed: "| label [marks] | median |", a label maybe in several tables
            shown = re.findall(
                r"^\| " + re.escape(r["label"]) + r"(?: [*†])* \| ([^|]*?) \|", printed, re.M
            )
            if t["unit"] == "s" and shown:
                assert f"{r['median']:.3f}" in shown, (r["label"], shown)
    spec = importlib.util.spec_from_file_location("docs_generated", HOOK)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return data, hook.render_results(data, path)


def test_quick_benchmark_prints_every_table(capsys, tmp_path, tmp_path_factory):
    res = str(tmp_path_factory.mktemp("results") / "bench.json")
    sys.path.insert(0, BENCH)
    try:
        import bench

        bench.main(["--quick", "--dir", str(tmp_path), "--json", res])
    finally:
        sys.path.remove(BENCH)
    out = capsys.readouterr().out
    data, md = render(res, out)
    assert data["source"].startswith("python benchmarks/bench.py --quick --dir ")
    assert data["config"]["quick"] is True and data["config"]["cold_cache"] is False
    assert [t["name"] for t in data["tables"]][:3] == ["mixed", "uniform", "reshard"]
    assert "| shardpoint save |" in md and "| DCP load |" in md and md.count("<svg") >= 3
    assert f"`{data['source']}`" in md
    assert len(data["targets"]["rows"]) == 8
    for row in (
        "raw write",
        "shardpoint save",
        "shardpoint async save",
        "DCP save",
        "DCP async_save",
        "torch.save",
        "safetensors load",
        "raw read",
        "shardpoint load",
        "DCP load",
        "by columns: shardpoint (auto: ",
        "exchange rate",
        "1 process, whole tensors",
        "floor: shardpoint's files, raw (16 threads",
        "floor: shardpoint's files, raw read (8 threads",
        "copy into reused buffers (the staging limit)",
    ):
        assert row in out, row
    # the format's floor writes the same files shardpoint does
    floor = next(
        ln for ln in out.splitlines() if ln.startswith("| floor: shardpoint's files, raw (")
    )
    save = next(ln for ln in out.splitlines() if ln.startswith("| shardpoint save |"))
    assert floor.split("|")[-2] == save.split("|")[-2] != " "
    assert "page cache: NOT dropped (--quick)" in out
    assert os.listdir(tmp_path) == []  # everything it wrote is removed
    assert "ranks: the checkpoint's files read raw, a share per rank" in out
    # the targets table: every target, one verdict per state, the reshard targets
    targets = out.split("### Targets (issue 7)")[1].splitlines()
    body = [ln for ln in targets if ln.startswith("| ") and not ln.startswith("| target")]
    assert len(body) == 8 + 1  # 8 per-state targets, 1 reshard world
    for ln in body[:8]:
        assert len([c for c in ln.split("|")[2:-1] if " met" in c or c == " n/a "]) == 2, ln


def test_targets_table_says_met_or_not_with_the_floor_beside_it(capsys):
    """The verdicts follow the ratios (at most / at least), and the floor is shown."""
    sys.path.insert(0, BENCH)
    try:
        import bench_targets as tg
    finally:
        sys.path.remove(BENCH)
    # two rounds; the second runs everything 2x slower (the disk drifted): ratios hold
    one = {
        "save": 1.05,
        "floor w": 1.0,
        "load": 1.5,
        "floor r": 1.2,
        "DCP load": 3.1,
        "blk": 0.12,
        "copy": 0.1,
        "total": 1.3,
        "raw w": 1.0,
        "raw r": 1.0,
        "dcp": 1.1,
    }
    series = {k: [v, 2 * v] for k, v in one.items()}
    names = {
        "save": "save",
        "load": "load",
        "DCP load": "DCP load",
        "async blocking": "blk",
        "async total": "total",
        "copy": "copy",
        "floor write": "floor w",
        "floor reads": ["floor r", "not run"],
    }
    run = tg.StateRun(
        "s",
        1000,
        "raw w",
        "raw r",
        "dcp",
        lambda row: series.get(row, []),
        {"save": 50.0, "load": 200.0}.get,
    )
    rows = dict(tg.state_rows([run], names))
    assert rows["sync save <= 1.10x the raw write"] == ["1.05x met (its files raw: 1.00x)"]
    assert rows["sync save >= 1.5x faster than DCP at its best"][0].startswith("1.05x NOT met")
    assert rows["cold load <= 1.15x the raw read"] == ["1.50x NOT met (its files raw: 1.20x)"]
    assert rows["cold load >= 1.5x faster than DCP"] == ["2.07x met"]
    assert rows["async save blocks <= 1.25x a copy into reused buffers"] == ["1.20x met"]
    assert rows["async save total <= 1.2x the sync save"] == ["1.24x NOT met"]
    assert rows["sync save peak extra memory <= 0.10x the state"] == ["0.05x met"]
    assert rows["load peak extra memory <= 0.10x the state (no full copy)"] == ["0.20x NOT met"]
    assert tg.per_round([1.0, 4.0, 3.0], [1.0, 2.0, 1.0]) == 2.0  # not 8/4 of medians
    tg.print_targets(
        [run],
        names,
        {
            4: {
                "cols": [1.2, 3.0],
                "same": [1.0, 2.0],
                "dcp": [2.4, 6.0],
                "raw": [2.0, 4.0],
                "paired": True,
            },
            3: {"cols": [3.0], "same": [1.0, 2.0], "dcp": [3.0], "paired": False},
        },
    )
    out = capsys.readouterr().out
    assert (
        "| resharded load, 4 ranks by columns" in out
        and "1.35x NOT met (0.68x its files raw); 2.00x met (DCP 1.35x its files raw)" in out
    )
    assert "| resharded load, 3 ranks by columns" in out and "2.00x NOT met; 1.00x NOT met" in out


def test_quick_jax_benchmark_runs_both_tools_and_checks_what_they_loaded(
    capsys, tmp_path, tmp_path_factory
):
    """benchmarks/bench_jax.py --quick: shardpoint_jax against Orbax, every table printed
    (each load is compared bit for bit with what was saved, or the run stops)."""
    import pytest

    pytest.importorskip(
        "orbax.checkpoint", reason="the JAX benchmark's peer: pip install -e '.[jax,jax-test]'"
    )
    res = str(tmp_path_factory.mktemp("results") / "bench_jax.json")
    sys.path.insert(0, BENCH)
    try:
        import bench_jax

        bench_jax.main(["--quick", "--dir", str(tmp_path), "--json", res])
    finally:
        sys.path.remove(BENCH)
    out = capsys.readouterr().out
    data, md = render(res)
    mixed = {r["label"]: r for r in data["tables"][0]["rows"]}
    # the printed per-round ratio is the file's
    ratio = mixed["load: shardpoint_jax"]["ratios"]["x raw"]["per_round"]["median"]
    assert f"| load | shardpoint_jax | {mixed['load: shardpoint_jax']['median']:.3f} |" in out
    assert f"| {ratio:.2f}x |" in out.split("### mixed")[1].split("| load | shardpoint_jax |")[1]
    # (a row may carry a mark after its label: " *" when its median is its family's best)
    assert "| load: orbax (no ocdbt)" in md and md.count("<svg") == 2
    for state in ("### mixed", "### uniform"):
        table = out.split(state)[1].split("###")[0]
        for row in (
            "| save | raw write (1 thread)",
            "| save | shardpoint_jax |",
            "| save | orbax (ocdbt)",
            "| load | shardpoint_jax |",
            "| load | orbax (no ocdbt)",
            "shardpoint_jax vs best Orbax",
            "| async blocking | shardpoint_jax |",
            "| async total | orbax (no ocdbt) |",
        ):
            assert row in table, (state, row)
    assert "page cache: NOT dropped (--quick)" in out
    assert os.listdir(tmp_path) == []


def test_quick_async_train_benchmark_writes_every_table(capsys, tmp_path):
    """benchmarks/bench_async_train.py --quick: a trainer steps through async saves of its
    state (writer at the trainer's priority and at a low one), every table printed and
    written in the results schema, the checkpoints removed (no timing asserted)."""
    res = str(tmp_path / "results" / "bench_async_train.json")
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    sys.path.insert(0, BENCH)
    try:
        import bench_async_train

        bench_async_train.main(
            ["--quick", "--modes", "none,sp-normal,sp-low", "--dir", str(ckpts), "--json", res]
        )
    finally:
        sys.path.remove(BENCH)
    out = capsys.readouterr().out
    data, md = render(res, out)
    tables = {t["name"]: [r["label"] for r in t["rows"]] for t in data["tables"]}
    assert tables["step"] == ["none", "sp-normal", "sp-low"] == tables["step_runq"]
    assert tables["drain"] == ["sp-normal", "sp-low"] == tables["lost"]
    assert all(len(r["values"]) == 1 for t in data["tables"] for r in t["rows"])
    assert "| sp-low |" in out and "x no save" in md
    assert os.listdir(ckpts) == []


def test_quick_store_benchmark_runs_every_store(capsys, tmp_path):
    """benchmarks/bench_stores.py --quick: our stores and TensorStore's drivers on files,
    the tests' kind of S3 server and memory, every byte read back checked; the table and its
    results/*.json shape printed and returned (no timing asserted)."""
    import pytest

    pytest.importorskip("tensorstore")
    pytest.importorskip("moto")
    sys.path.insert(0, BENCH)
    try:
        import bench_stores

        data = bench_stores.main(["--quick", "--dir", str(tmp_path)])
    finally:
        sys.path.remove(BENCH)
    out = capsys.readouterr().out
    for row in (
        "files: FileStore",
        "files: TensorStore file (fsync each write)",
        "s3: S3Store (boto3)",
        "s3: TensorStore s3",
        "memory: MemoryStore",
        "memory: TensorStore memory",
        "page cache (files): NOT dropped (--quick)",
        "s3: checkpoint, s3:// (S3Store)",
        "s3: checkpoint, tensorstore+s3://",
        "files: checkpoint, tensorstore+file://",
    ):
        assert row in out, row
    assert len(data["rows"]) == 13 and all(
        len(r["cells"]) == len(data["columns"]) for r in data["rows"]
    )
    assert [b["label"] for b in data["plot"]["bars"]] == [
        "files, put",
        "files, get",
        "files, sp.save",
        "files, sp.load",
        "s3, put",
        "s3, get",
        "s3, sp.save",
        "s3, sp.load",
        "memory, put",
        "memory, get",
        "memory, sp.save",
        "memory, sp.load",
    ]
    assert os.listdir(tmp_path) == []  # everything it wrote is removed


def test_quick_s3_benchmark_writes_what_it_printed(capsys, s3_env, tmp_path):
    """benchmarks/bench_s3.py --quick --json against the session's S3 server: the rows it
    can run (DCP's peer, s3fs, pointed away here), rendered by the docs hook."""
    res = str(tmp_path / "bench_s3.json")
    sys.path.insert(0, BENCH)
    try:
        import bench_s3

        bench_s3.main(
            [
                "--quick",
                "--endpoint",
                s3_env.endpoint,
                "--bucket",
                s3_env.bucket,
                "--s3fs-path",
                str(tmp_path / "no-s3fs"),
                "--json",
                res,
            ]
        )
    finally:
        sys.path.remove(BENCH)
    out = capsys.readouterr().out
    data, md = render(res)
    assert data["config"]["dcp"].startswith("not run") and data["config"]["quick"] is True
    mixed = {r["label"]: r for r in data["tables"][0]["rows"]}
    save = mixed["shardpoint save"]
    assert f"shardpoint save   {save['median']:7.3f} s" in out
    assert f"save: {save['ratios']['speed x raw limit']['value']:.2f}x the raw limit" in out
    assert "DCP save" not in mixed and data["samples"]["mixed"]["save"] == save["values"]
    assert "| shardpoint load |" in md and "<svg" in md


def test_quick_plan_scale_writes_what_it_printed(capsys, tmp_path):
    """benchmarks/plan_scale.py --quick --json: the planning steps and the bytes, with their
    ratios to the targets, rendered by the docs hook."""
    res = str(tmp_path / "plan_scale.json")
    sys.path.insert(0, BENCH)
    try:
        import plan_scale

        plan_scale.main(["--quick", "--no-memory", "--json", res])
    finally:
        sys.path.remove(BENCH)
    out = capsys.readouterr().out
    data, md = render(res)
    assert data["config"]["world"] == 8 and data["source"].endswith("--quick --no-memory")
    rows = {r["label"]: r for r in data["tables"][0]["rows"]}
    tot = rows["save plan end to end"]
    assert f"save plan end to end            {tot['median']:7.3f} s" in out
    assert tot["ratios"]["x target"]["value"] == tot["median"] / 1.0
    assert data["samples"]["save_total_s"] == tot["values"]
    assert "| save: received by the coordinator |" in md and "<svg" in md


def test_tier_copy_benchmark_checks_what_it_copied(capsys, tmp_path):
    """benchmarks/bench_tier_copy.py, tiny: both durable copies of each round are loaded bit
    for bit and verified, and the one on the storage step before writes the trained part
    alone (the frozen 95% are references)."""
    sys.path.insert(0, BENCH)
    try:
        import bench_tier_copy

        rc = bench_tier_copy.main(["--mib", "16", "--rounds", "1", "--dir", str(tmp_path)])
    finally:
        sys.path.remove(BENCH)
    out = capsys.readouterr().out
    assert rc == 0 and "every copy loaded bitwise and verified: True" in out
    rows = {ln[:28].strip(): ln[28:].split() for ln in out.splitlines()[2:4]}
    flat, onto = float(rows["flattened"][0]), float(rows["on the storage step before"][0])
    assert flat > 12 and onto < 0.1 * flat  # 3 frozen tensors of 4 MiB, 0.8 MiB trained
    assert os.listdir(tmp_path) == []  # the benchmark removes what it wrote


def test_benchmark_page_figures_all_come_from_files_the_scripts_wrote():
    """docs/benchmarks.md holds no measured figure of its own (no "1.52x", no "0.68 s"): its
    tables come from benchmarks/results/*.json, each written by a script's --json (schema,
    command, date, commit, machine) and each shown on the page."""
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    with open(os.path.join(root, "docs", "benchmarks.md")) as f:
        page = f.read()
    prose = re.sub(r"`[^`]*`", "", page)
    figures = re.findall(r"\d+(?:\.\d+)?\s*(?:x\b|s\b|ms\b|[MG]i?B\b|MB/s|GB/s)|\d+\.\d+", prose)
    assert figures == [], figures
    names = sorted(
        f[:-5]
        for f in os.listdir(os.path.join(root, "benchmarks", "results"))
        if f.endswith(".json")
    )
    assert names and re.findall(r"<!-- generated: benchmark (\w+) -->", page) == [
        "bench",
        "bench_async_train",
        "bench_jax",
        "bench_s3",
        "bench_packed",
        "bench_packed_cold",
        "bench_packed_s3",
        "bench_s3_packed",
        "bench_s3_perarray_same_run",
        "bench_s3_packed_s18",
        "bench_packed_scale",
        "plan_scale",
        "plan_scale_cpu",
    ]
    for name in names:
        assert f"<!-- generated: benchmark {name} -->" in page, name
        path = os.path.join(root, "benchmarks", "results", f"{name}.json")
        data, md = render(path, here=False)
        assert os.path.isfile(os.path.join(root, data["script"])) and data["commit"], name
        assert not data["config"].get("quick"), name  # never a smoke run as the headline
        assert data["source"] in md and data["date"] in md
