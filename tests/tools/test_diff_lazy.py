"""``shardpoint diff`` (bitwise and tolerant, chunk by chunk), ``sp.open`` lazy views that read
only the chunks a slice needs, ``inspect --values``, and progress bars only on a terminal."""

import glob
import json
import os

import pytest
import torch

import shardpoint as sp
from shardpoint.tools.cli import main as cli
from shardpoint.tools.diff import diff_checkpoints
from shardpoint_testing.launch import run_code


def run(capsys, *argv):
    rc = cli(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_diff_finds_one_flipped_bit_in_23_mb(tmp_path, capsys):
    """Two of the diff's blocks of rows (4 Mi elements each) and a dozen 2 MiB inner chunks:
    the bit is in the second block, so its index needs that block's offset."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2400, 2400, generator=g)  # 23 MB of float32
    b = a.clone()
    b.view(torch.int32)[2017, 1234] ^= 1  # lowest mantissa bit
    from shardpoint_core.transactions.backend import ZarrBackend

    fast = ZarrBackend(fsync=False)  # durability is not under test
    sp.save({"w": a, "step": 1}, str(tmp_path / "a"), backend=fast)
    sp.save({"w": b, "step": 1}, str(tmp_path / "b"), backend=fast)
    del a, b
    rc, out, err = run(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "b"))
    assert rc == 1 and err == ""
    assert "w: 1 of 5760000 elements, first at [2017, 1234]" in out
    assert "DIFFERENT (bitwise)" in out
    rc, out, _ = run(capsys, "diff", "--atol", "1e-5", str(tmp_path / "a"), str(tmp_path / "b"))
    assert rc == 0 and out.startswith("equal (atol=1e-05, rtol=0)")


def test_diff_of_a_checkpoint_replaced_while_it_is_read_is_refused(tmp_path):
    """A checkpoint replaced by another save during the diff (its first tensor compared from
    the old one, the rest from the new) is LoadFailedError [SP-COMMIT-14], not a report."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    sp.save({"x": torch.zeros(4), "y": torch.zeros(4)}, a)
    sp.save({"x": torch.ones(4), "y": torch.ones(4)}, b)
    replaced = []

    def progress(_n):
        if not replaced:
            replaced.append(sp.save({"x": torch.ones(4), "y": torch.ones(4)}, a, overwrite=True))

    with pytest.raises(sp.LoadFailedError, match="replaced") as e:
        diff_checkpoints(a, b, progress=progress)
    assert e.value.spec_id == "SP-COMMIT-14" and replaced
    assert diff_checkpoints(a, b).tensors == []  # read again: equal now


def test_diff_reports_keys_shapes_dtypes_values(tmp_path, capsys):
    nan = torch.tensor([float("nan"), -0.0, 1.0])
    sp.save(
        {
            "same": torch.arange(6).reshape(2, 3),
            "nan": nan,
            "gone": torch.ones(1),
            "shape": torch.ones(2, 3),
            "dtype": torch.ones(2),
            "bf": torch.ones(4).bfloat16(),
            "v": 1,
            "o": sp.ShardedObject({"s": 1}, 0, 1),
        },
        str(tmp_path / "a"),
    )
    sp.save(
        {
            "same": torch.arange(6).reshape(2, 3),
            "nan": torch.tensor([float("nan"), 0.0, 1.0]),
            "new": 3,
            "shape": torch.ones(3, 2),
            "dtype": torch.ones(2, dtype=torch.float64),
            "bf": torch.tensor([1, 1, 1.5, 9]).bfloat16(),
            "v": 2,
            "o": sp.ShardedObject({"s": 2}, 0, 1),
        },
        str(tmp_path / "b"),
    )
    rep = diff_checkpoints(str(tmp_path / "a"), str(tmp_path / "b"))
    assert rep.only_a == ["gone"] and rep.only_b == ["new"]
    assert dict(rep.mismatched) == {
        "shape": "shape [2, 3] vs [3, 2]",
        "dtype": "dtype float32 vs float64",
    }
    assert {k for k, _, _ in rep.values} == {"v", "o"}
    by = {t.key: t for t in rep.tensors}
    assert set(by) == {"nan", "bf"}  # -0.0 vs 0.0 differs bitwise; NaN = NaN
    assert by["nan"].first_index == (1,) and by["nan"].max_abs_diff == 0.0
    assert by["bf"].differing == 2 and by["bf"].first_index == (2,)
    assert by["bf"].max_abs_diff == 8.0
    tol = diff_checkpoints(str(tmp_path / "a"), str(tmp_path / "b"), atol=0.6)
    assert [t.key for t in tol.tensors] == ["bf"] and tol.tensors[0].differing == 1
    rc, out, _ = run(capsys, "diff", "--json", str(tmp_path / "a"), str(tmp_path / "b"))
    d = json.loads(out)
    assert rc == 1 and not d["equal"] and d["only_a"] == ["gone"]
    rc, out, err = run(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "nope"))
    assert rc == 2 and "CheckpointNotFoundError" in err and err.count("\n") == 1


def test_diff_across_formats(tmp_path, capsys):
    from safetensors.torch import save_file

    w = torch.randn(8, 3).to(torch.float8_e4m3fn)
    sp.save({"w": w}, str(tmp_path / "a"))
    save_file({"w": w}, str(tmp_path / "b.safetensors"))
    assert run(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "b.safetensors"))[0] == 0


@pytest.fixture
def chunked(tmp_path, request):
    """16x16 float32 in four row chunks of 4x16, plus bf16, 0-d, values and an object; in
    the default layout (packed) unless the test asks for ``per-array`` (indirect param)."""
    path = str(tmp_path / "ck")
    w = torch.arange(256, dtype=torch.float32).reshape(16, 16)
    per_array = getattr(request, "param", "packed") == "per-array"
    sp.save(
        {
            "model": {"w": w, "b": torch.arange(6).bfloat16()},
            "s": torch.tensor(2.5),
            "step": 9,
            "rng": sp.ShardedObject([1, 2], 0, 1),
        },
        path,
        options=sp.SaveOptions(plan=sp.PlanOptions(max_chunk_bytes=256)),
        backend=sp.ZarrBackend() if per_array else None,
    )
    assert sp.read_metadata(path).tensors["model/w"].chunk_shape == (4, 16)
    return path, w


@pytest.mark.parametrize("chunked", ["per-array", "packed"], indirect=True)
def test_open_slices_read_only_the_chunks_they_need(chunked):
    path, w = chunked
    m = sp.read_metadata(path)
    if m.packed is None:
        files = glob.glob(f"{path}/tensors/model/w/c/0/*") + glob.glob(
            f"{path}/tensors/model/w/c/3/*"
        )
        assert len(files) == 2
        for f in files:
            os.remove(f)  # rows 0-3 and 12-15 are gone
        rule = "SP-READ-2"
    else:  # packed: a byte of chunks 0 and 3 (rows 0-3 and 12-15) flipped in the object
        for c in (0, 3):
            obj, off, _n, _crc = m.tensors["model/w"].packed.chunk(c)
            with open(os.path.join(path, obj), "r+b") as f:
                f.seek(off + 8)
                byte = f.read(1)
                f.seek(off + 8)
                f.write(bytes([byte[0] ^ 1]))
        rule = "SP-READ-3"
    with sp.open(path) as ck:
        assert ck.keys() == ["model/w", "model/b", "s", "step", "rng"]
        v = ck["model/w"]
        assert v.shape == (16, 16) and v.dtype == torch.float32 and len(v) == 16
        assert torch.equal(v[5:10, :4].to_torch(), w[5:10, :4])
        assert torch.equal(v[4:12:3, 1::5].to_torch(), w[4:12:3, 1::5])
        assert torch.equal(v[7].to_torch(), w[7]) and v[7, -1].to_torch().item() == 127
        assert torch.equal(v[4:12][2:4, ...][:, 3].to_torch(), w[6:8, 3])
        assert v[8:4].shape == (0, 16) and v[8:4].to_torch().shape == (0, 16)
        with pytest.raises(sp.CorruptCheckpointError, match=rule):
            v[2:6].to_torch()  # needs the damaged first chunk
        with pytest.raises(sp.CorruptCheckpointError, match=rule):
            v[12:].to_torch()  # and the last
        with pytest.raises(IndexError):
            v[16]
        with pytest.raises(IndexError):
            v[::-1]
        with pytest.raises(IndexError):
            v[1, 2, 3]
        b = ck["model/b"].to_numpy()
        assert str(b.dtype) == "bfloat16" and b.tolist() == [0, 1, 2, 3, 4, 5]
        assert ck["s"].to_torch().item() == 2.5 and ck["s"].shape == ()
        assert ck["step"] == 9 and ck["rng"] == [[1, 2]] and ("model", "w") in ck
        with pytest.raises(KeyError, match="keys under it"):
            ck["model"]


def test_inspect_values(chunked, capsys):
    path, w = chunked
    rc, out, _ = run(capsys, "inspect", path, "--values", "model/w[1:3, 14:]")
    assert rc == 0 and out.splitlines()[0] == "model/w: float32[2x2]"
    assert "[[30., 31.]" in out and "[46., 47.]]" in out
    rc, out, _ = run(capsys, "inspect", path, "--values", "model/b", "--json")
    assert json.loads(out) == {
        "key": "model/b",
        "dtype": "bfloat16",
        "shape": [6],
        "values": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
    }
    rc, out, _ = run(capsys, "inspect", path, "--values", "step")
    assert rc == 0 and out.strip() == "step = 9"
    rc, _, err = run(capsys, "inspect", path, "--values", "nope")
    assert rc == 2 and "'nope' is not a key" in err  # a usage error (issue 21)


# ------------------------------------------------------------------------------- progress
def test_progress_bar_on_a_terminal_only(tmp_path, capsys):
    from safetensors.torch import save_file

    save_file({f"t{i}": torch.zeros(1 << 18) for i in range(8)}, str(tmp_path / "m.safetensors"))
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="80", OMP_NUM_THREADS="1")
    env.pop("NO_COLOR", None)
    # `python -m shardpoint.tools.cli convert ...` at a terminal (a process forked from the
    # launcher's fork server: the terminal is under test here, not a fresh interpreter)
    r = run_code(
        "import runpy; runpy.run_module('shardpoint.tools.cli', run_name='__main__', "
        "alter_sys=True)",
        "convert",
        tmp_path / "m.safetensors",
        tmp_path / "a",
        env=env,
        timeout=120,
        terminal=True,
    )
    rc, out = r.returncode, r.stdout
    assert rc == 0, out
    assert "━" in out and "8.0/8.0 MiB" in out and "converted" in out
    # Piped (here: pytest's captured, non-terminal stdout and stderr): no bar, no escapes.
    rc, out, err = run(capsys, "convert", str(tmp_path / "m.safetensors"), str(tmp_path / "b"))
    assert rc == 0 and out.startswith("converted") and err == ""
    assert "━" not in out and "\x1b[" not in out
