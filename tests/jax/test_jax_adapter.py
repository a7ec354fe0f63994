"""The conformance adapter matrix with shardpoint_jax as the adapter under test:
reference -> JAX, JAX -> reference (checked by the spec validator too), JAX -> JAX and a
corrupted reference checkpoint -> JAX, every tensor compared bit for bit."""

from __future__ import annotations

import shlex
import sys

import pytest

pytest.importorskip("jax", reason="shardpoint_jax needs jax (pip install -e '.[jax]')")

from shardpoint_conformance import cli, harness  # noqa: E402

ADAPTER = f"{shlex.quote(sys.executable)} -m shardpoint_jax.adapter"


def test_adapter_matrix_passes_every_pair(tmp_path):
    rep = harness.run_matrix(ADAPTER, cases=1, seed=5, workdir=str(tmp_path), log=lambda *_: None)
    assert rep["ok"], harness.format_report(rep)
    assert rep["capabilities"]["name"] == "shardpoint-jax"
    assert len(rep["capabilities"]["dtypes"]) == 17
    for row in rep["rows"]:
        assert set(row["cells"]) == set(harness.PAIRS)
        assert all(c["status"] == "ok" for c in row["cells"].values()), row
        assert row["cells"]["corrupt→adapter"]["spec_ids"] == ["SP-READ-3"]
        assert not row["notes"]  # nothing skipped: every dtype and feature


@pytest.mark.slow
def test_adapter_test_command_passes_on_eight_cases(tmp_path, capsys):
    rc = cli.main(
        [
            "adapter-test",
            "--adapter",
            ADAPTER,
            "--cases",
            "8",
            "--seed",
            "11",
            "--dir",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "adapter-test: PASSED" in out, out
