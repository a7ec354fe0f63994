"""The documentation site builds with warnings as errors (what CI's third step runs), and its
generated pages hold what they are generated from: every command's help, the spec's files,
the benchmark tables' figures. Skips where mkdocs (the docs extra) is not installed."""

import json
import os
import subprocess
import sys

import pytest

from .blocks import ROOT

pytest.importorskip("mkdocs", reason="the docs site needs mkdocs (pip install -e '.[docs]')")
pytest.importorskip("mkdocstrings", reason="the docs site needs mkdocstrings (the docs extra)")
pytest.importorskip("material", reason="the docs site needs mkdocs-material (the docs extra)")


def test_site_builds_strict_with_generated_pages(tmp_path):
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for cmd in (
        "inspect",
        "verify",
        "recover",
        "demo",
        "convert",
        "diff",
        "conformance run",
        "conformance adapter-test",
        "conformance fuzz",
    ):
        assert f"shardpoint {cmd}" in cli, cmd
    assert "--min-age" in cli and "--save-world-sizes" in cli  # the parsers' own options
    for page in ("", "format/", "versioning/", "security/", "rationale/", "CHANGELOG/", "vectors/"):
        assert (site / "spec" / page / "index.html").is_file(), page
    bench = (site / "benchmarks" / "index.html").read_text()
    charts = 0
    names = sorted(
        f[:-5]
        for f in os.listdir(os.path.join(ROOT, "benchmarks", "results"))
        if f.endswith(".json")
    )
    assert {"bench", "bench_jax", "bench_s3", "plan_scale"} <= set(names)
    for name in names:  # every result file the page is generated from
        with open(os.path.join(ROOT, "benchmarks", "results", f"{name}.json")) as f:
            data = json.load(f)
        assert f"benchmarks/results/{name}.json" in bench and data["date"] in bench
        for t in data["tables"]:
            charts += t["unit"] == "s" and len(t["rows"]) > 1
            for row in t["rows"]:
                assert f"<td>{row['label']}" in bench.replace("&gt;", ">"), row["label"]
    assert bench.count('role="img"') == charts > 4
    api = (site / "reference" / "api" / "index.html").read_text()
    for name in ("CheckpointManager", "ShardedTensor", "LoadOptions", "read_metadata"):
        assert name in api, name
