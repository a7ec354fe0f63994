"""The conformance suite tested as a product: real spawned worlds, real files, real kills."""

from __future__ import annotations

import json
import shlex
import sys

import pytest
from hypothesis import HealthCheck, given, settings

from shardpoint_conformance import cli, faults, harness, runner
from shardpoint_conformance.adapters import reference_adapter_command
from shardpoint_conformance.cases import check_case, expected_array, same_bits, SPEC_DTYPES
from shardpoint_conformance.strategies import cases, generate_case


# -------------------------------------------------------------------------------- cases
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases("ci", max_world=8))
def test_drawn_cases_are_plain_json_and_cover_exactly_once(case):
    check_case(case)
    assert json.loads(json.dumps(case)) == case
    again = generate_case(case["seed"], case["save"]["world"], case["load"]["world"], "ci")
    assert again == case  # every rank draws the same case from the seed


def test_contents_depend_on_seed_and_key_only():
    a = expected_array(3, "model/w", "bfloat16", [4, 5])
    assert same_bits(a, expected_array(3, "model/w", "bfloat16", [4, 5]))
    assert not same_bits(a, expected_array(4, "model/w", "bfloat16", [4, 5]))
    b = expected_array(3, "flag", "bool", [50])
    assert set(b.view("u1").tolist()) <= {0, 1}


def test_case_set_draws_every_dtype_and_layout_kind():
    got_d, got_k = set(), set()
    for s in range(300):
        c = generate_case(s, 4, 3, "ci")
        got_d |= {t["dtype"] for t in c["tensors"]}
        got_k |= {v["kind"].split(" ")[0] for v in c["save"]["tensors"].values()}
    assert got_d == set(SPEC_DTYPES)
    assert {
        "replicated",
        "owner",
        "split-even",
        "split-ceil",
        "split-uneven",
        "grid",
        "flat",
        "composed",
        "split-replicas",
        "megatron-replicas",
        "pieces-contig",
        "pieces-strided",
        "pieces-flat-contig",
        "pieces-flat-strided",
    } <= got_k


def test_case_set_draws_object_grids_with_shared_replicas():
    """Spec 1.1 object grids reach every world pair: 2-D and 3-D shapes, list indexes, cells
    shared by data-parallel replicas with non-zero replica ids; int indexes stay drawn too."""
    dims, shared, ints = set(), False, False
    for s in range(200):
        c = generate_case(s, 4, 3, "ci")
        for o in c["objects"]:
            entries = c["save"]["objects"][o["key"]]
            if "shape" not in o:
                ints |= all(isinstance(e[1], int) for e in entries)
                continue
            dims.add(len(o["shape"]))
            assert all(
                isinstance(e[1], list) and len(e[1]) == len(o["shape"])
                for e in entries + c["load"]["objects"][o["key"]]
            )
            shared |= o["count"] < 4 and max(e[2][0] for e in entries) > 0
    assert dims == {2, 3} and shared and ints


# -------------------------------------------------------------------------------- runner
def test_run_ci_profile_over_world_sizes_1_to_4(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc = cli.main(
        [
            "run",
            "--profile",
            "ci",
            "--seed",
            "1000",
            "--dir",
            str(tmp_path / "c"),
            "--json",
            str(out),
            "--no-vectors",
        ]
    )
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert rc == 0, text
    assert len(rows) == 16
    assert {(r["save_world"], r["load_world"]) for r in rows} == {
        (s, w) for s in range(1, 5) for w in range(1, 5)
    }
    assert all(r["ok"] for r in rows), text
    assert sum(r["ok"] for r in rows) >= 12, text
    assert "case" in text and "save layout" in text


def test_run_reports_failure_with_replay_seed(tmp_path, capsys, monkeypatch):
    # The coordinator SIGKILLs itself before writing the manifest: the run must say so.
    monkeypatch.setenv(faults.KILL_ENV, "0:before-manifest")
    rc = cli.main(
        [
            "run",
            "--replay",
            "7",
            "--save-world-sizes",
            "2",
            "--load-world-sizes",
            "1",
            "--dir",
            str(tmp_path),
            "--no-vectors",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 1
    assert "FAIL(save)" in text and "exited with code -9" in text
    assert "--replay 7 --save-world-sizes 2 --load-world-sizes 1" in text


def test_vectors_step_checks_every_golden_vector():
    ok, text = cli.run_vectors()
    assert text.startswith("vectors: ok") and "skipped" not in text, text
    assert ok, text


# -------------------------------------------------------------------------------- adapters
def own_temp(tmp_path, monkeypatch):
    """A fresh temporary directory for this process and the processes it starts."""
    import tempfile

    t = tmp_path / "tmp"
    t.mkdir()
    monkeypatch.setenv("TMPDIR", str(t))
    monkeypatch.setattr(tempfile, "tempdir", str(t))
    return t


def made_by_us(t):
    """What a run left in the temporary directory ``t`` under the suite's own names (torch
    and others keep caches there of their own)."""
    return sorted(p.name for p in t.iterdir() if p.name.startswith(("shardpoint-", "sp-")))


def test_a_run_leaves_nothing_in_the_temporary_directory(tmp_path, monkeypatch, capsys):
    """The run's own temporary root stayed behind, empty, after every case passed."""
    t = own_temp(tmp_path, monkeypatch)
    rc = cli.main(
        [
            "run",
            "--replay",
            "7",
            "--save-world-sizes",
            "1",
            "--load-world-sizes",
            "1",
            "--no-vectors",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0 and "dir " + str(t) in text, text
    assert made_by_us(t) == []
    d = tmp_path / "mine"  # a --dir given: its passing cases go, it stays
    (d / "a000" / "tensors").mkdir(parents=True)
    (d / "a001").mkdir()
    runner.cleanup(str(d), [{"id": "a000", "ok": True}, {"id": "a001", "ok": False}])
    assert [p.name for p in d.iterdir()] == ["a001"]
    runner.cleanup(str(d), [{"id": "a001", "ok": True}])
    assert d.is_dir() and list(d.iterdir()) == []


@pytest.mark.parametrize("cases", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_adapter_test_passes_with_the_reference_adapter(tmp_path, cases, monkeypatch):
    """Each case costs the adapter four fresh interpreters (torch imports): one by default
    (the reference itself is checked on many more by ``conformance run``), three with
    --runslow. Without a work directory it leaves nothing in the temporary directory."""
    t = own_temp(tmp_path, monkeypatch)
    rep = harness.run_matrix(reference_adapter_command(), cases=cases, seed=3, log=lambda *_: None)
    assert rep["ok"], harness.format_report(rep)
    assert rep["dir"].startswith(str(t)) and made_by_us(t) == []
    assert len(rep["rows"]) == cases
    for row in rep["rows"]:
        assert set(row["cells"]) == set(harness.PAIRS)
        assert row["cells"]["corrupt→adapter"]["spec_ids"] == ["SP-READ-3"]


def test_the_reference_adapter_writes_the_default_packed_layout(tmp_path):
    """The reference adapter saves as ``sp.save`` does by default: the packed layout (format
    1.4, spec section 13), its data objects below ``packed/``, no per-tensor directory, and
    the reference reads it back bit for bit."""
    from shardpoint_conformance import reference_adapter
    from shardpoint_conformance.adapters import read_case_files, write_case_files
    from shardpoint_core.transactions.resolve import read_metadata

    case, arrays, _notes = harness.make_case(5, 0, reference_adapter.capabilities(), 1)
    path = write_case_files(case, arrays, str(tmp_path / "case"))
    ckpt = str(tmp_path / "ckpt")
    reference_adapter.write_checkpoint(path, ckpt)
    m = read_metadata(ckpt)
    assert tuple(m.format_version) == (1, 4) and m.packed is not None
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["manifest.msgpack", "packed"]
    assert [o.split("/")[0] for o, _n in m.packed.objects] == ["packed"]
    reference_adapter.read_checkpoint(ckpt, path, str(tmp_path / "out"))
    got_case, _arrays = read_case_files(path)
    assert harness.compare_output(got_case, arrays, str(tmp_path / "out")) == []


def _broken(mode: str) -> str:
    return f"{shlex.quote(sys.executable)} -m shardpoint_conformance.broken_adapter {mode}"


@pytest.mark.parametrize(
    "mode,spec_id",
    [
        ("delete-chunk", "SP-READ-2"),
        pytest.param("flip-byte", "SP-READ-3", marks=pytest.mark.slow),
        pytest.param("truncate-manifest", "SP-MAN-1", marks=pytest.mark.slow),
    ],
)
def test_adapter_test_catches_a_broken_adapter_with_the_spec_id(tmp_path, mode, spec_id, capsys):
    rc = cli.main(
        [
            "adapter-test",
            "--adapter",
            _broken(mode),
            "--cases",
            "1",
            "--dir",
            str(tmp_path / "w"),
            "--json",
            str(tmp_path / "rep.json"),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 1, text
    rep = json.loads((tmp_path / "rep.json").read_text())
    cell = rep["rows"][0]["cells"]["adapter→reference"]
    assert cell["status"] == "fail" and spec_id in cell["spec_ids"], text
    assert rep["rows"][0]["cells"]["reference→adapter"]["status"] == "ok"
    assert f"adapter                0/1 {spec_id}" in text


# -------------------------------------------------------------------------------- faults
def test_every_damaged_chunk_or_manifest_raises_its_documented_error(tmp_path):
    damaged = faults.damaged_checkpoints(str(tmp_path))
    assert len(damaged) > 20
    problems = [p for d in damaged if (p := faults.check_damage(*d)) is not None]
    assert not problems, problems


def test_check_damage_reports_an_expected_class_that_carries_no_requirement_id(
    tmp_path, monkeypatch
):
    # A reader under test that raises a class with no spec_id attribute (a ValueError).
    import shardpoint as sp

    def load(path, *a, **k):
        raise ValueError("not a documented error")

    monkeypatch.setattr(sp, "load", load)
    problem = faults.check_damage("nul", str(tmp_path / "x"), "SP-LAYOUT-1", ValueError)
    assert problem == "nul: raised ValueError with None, expected SP-LAYOUT-1"


def test_a_path_with_a_nul_byte_is_a_documented_error_everywhere(tmp_path):
    import shardpoint as sp
    import torch
    from shardpoint_core.format.errors import InvalidOptionError

    bad = str(tmp_path / "a\x00b")
    for call in (
        lambda: sp.load(bad),
        lambda: sp.save({"w": torch.ones(2)}, bad),
        lambda: sp.read_metadata(bad),
        lambda: sp.open(bad),
        lambda: sp.load("s3://b/x\x00y"),
        lambda: sp.CheckpointManager(bad),
    ):
        with pytest.raises(InvalidOptionError, match="NUL byte"):
            call()


KILLS = [
    ("write", 1, 1, True),
    ("before-manifest", 0, 1, True),
    ("after-manifest", 0, 1, False),
    pytest.param("write", 0, 2, True, marks=pytest.mark.slow),
    pytest.param("write", 1, 3, False, marks=pytest.mark.slow),
    pytest.param("after-manifest", 0, 1, True, marks=pytest.mark.slow),
    pytest.param("before-manifest", 0, 1, False, marks=pytest.mark.slow),
    pytest.param("after-commit", 0, 1, True, marks=pytest.mark.slow),
    pytest.param("mid-commit", 0, 1, True, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("point,rank,n,overwrite", KILLS)
def test_sigkilled_rank_leaves_previous_intact_and_new_complete_or_invisible(
    tmp_path, point, rank, n, overwrite
):
    """[SP-COMMIT-1] [SP-COMMIT-2] [SP-COMMIT-3] [SP-COMMIT-4]: a real SIGKILL mid-save."""
    r = faults.kill_during_save(str(tmp_path / "k"), 2, rank, point, n, overwrite=overwrite)
    assert r["killed"], r
    assert r["ok"], r
    if point in ("write", "before-manifest", "after-manifest"):
        assert r["state"] == "previous" if overwrite else r["state"].startswith("invisible")
    if point == "after-commit":
        assert r["state"] == "new"


@pytest.mark.slow
def test_kill_in_a_world_of_three(tmp_path):
    r = faults.kill_during_save(str(tmp_path / "k"), 3, 2, "write", 1, overwrite=True)
    assert r["killed"] and r["ok"], r
