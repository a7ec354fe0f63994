"""What a first-time user hits with a wrong path, a wrong ``like`` or a damaged file: one
documented error naming the key or path and the fix, a clean CLI line, no hang."""

import os

import pytest
import torch

import shardpoint as sp
from shardpoint.tools.cli import main as cli
from shardpoint_core.verify import verify_checkpoint
from shardpoint_testing.launch import run_world


def small(path, **kw):
    sp.save(
        {
            "model": {
                "layers.0.weight": torch.arange(64.0).reshape(8, 8),
                "layers.0.bias": torch.ones(8),
            },
            "step": 3,
        },
        path,
        **kw,
    )
    return path


def backend_of(layout):
    """Save options for ``layout``: packed (the default since 1.4) or per-array."""
    return {"backend": sp.ZarrBackend()} if layout == "per-array" else {}


def chunk_at(path, key):
    """(file, offset) of the first stored chunk of ``key``: per-array its chunk file, packed
    its data object and the chunk's offset there (from the manifest's index)."""
    e = sp.read_metadata(path).tensors[key]
    if e.packed is not None:
        obj, off, _n, _crc = e.packed.chunk(0)
        return os.path.join(path, obj), off
    return next(
        os.path.join(d, f)
        for d, _, fs in os.walk(f"{path}/{e.array}")
        for f in fs
        if f != "zarr.json"
    ), 0


def run(capsys, *argv):
    rc = cli(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("layout", ["packed", "per-array"])
def test_verify_prints_each_requirement_id_once(tmp_path, capsys, layout):
    p = small(str(tmp_path / "ck"), **backend_of(layout))
    chunk, off = chunk_at(p, "model/layers.0.weight")
    os.truncate(chunk, off + 10)
    rc, out, _ = run(capsys, "verify", p)
    assert rc == 1 and "[SP-READ-3]" in out and "[SP-READ-3] [SP-READ-3]" not in out
    assert all(not m.startswith("[") for _, m in verify_checkpoint(p))


def test_another_format_is_named_with_the_convert_command(tmp_path, capsys):
    """A DCP directory or a torch.save file given to inspect/load is not 'a save that never
    committed': the error says what it is and how to convert it."""
    import torch.distributed.checkpoint as dcp

    d = str(tmp_path / "dcp")
    dcp.save({"w": torch.ones(2)}, checkpoint_id=d, no_dist=True)
    pt = str(tmp_path / "m.pt")
    torch.save({"w": torch.ones(2)}, pt)
    for path, what in ((d, "PyTorch DCP"), (pt, "torch.save")):
        rc, out, err = run(capsys, "inspect", path)
        assert rc == 2 and err.count("\n") == 1, err
        assert what in err and f"shardpoint convert {path} DST" in err, err
        with pytest.raises(sp.CheckpointNotFoundError, match="convert"):
            sp.load(path)
    ck = small(str(tmp_path / "ck"), **backend_of("per-array"))  # its manifest, one array
    with pytest.raises(sp.CheckpointNotFoundError, match="the checkpoint is its directory"):
        sp.load(f"{ck}/manifest.msgpack")
    with pytest.raises(sp.CheckpointNotFoundError, match="one tensor's Zarr array"):
        sp.load(f"{ck}/tensors/model/layers.0.bias")
    packed = small(str(tmp_path / "packed"))  # the default layout: its data directory, a file
    data = os.path.join(packed, "packed", os.listdir(os.path.join(packed, "packed"))[0])
    for path in (os.path.join(packed, "packed"), data):  # the file is no torch.save .bin
        with pytest.raises(sp.CheckpointNotFoundError, match="of the packed checkpoint") as e:
            sp.load(path)
        assert repr(packed) in str(e.value) and "torch.save" not in str(e.value), e.value
    os.makedirs(tmp_path / "crashed" / "tensors")  # a save that never committed stays so
    with pytest.raises(sp.IncompleteCheckpointError):
        sp.load(str(tmp_path / "crashed"))


def test_values_with_a_bad_index_says_so_not_unknown_key(tmp_path, capsys):
    p = small(str(tmp_path / "ck"))
    rc, _, err = run(capsys, "inspect", p, "--values", "model/layers.0.bias[abc]")
    # a usage error, like a missing key: exit 2 (issue 21), not 1 ("damaged checkpoint")
    assert rc == 2 and "index must be ints and slices" in err and "not a key" not in err
    rc, out, _ = run(capsys, "inspect", p, "--values", "model/layers.0.bias[1:3]")
    assert rc == 0 and "tensor([1., 1.])" in out
    rc, _, err = run(capsys, "inspect", p, "--values", "model/layers.0.bais")
    assert rc == 2 and "similar keys: 'model/layers.0.bias'" in err, err
    with sp.open(p) as ckpt, pytest.raises(KeyError, match="similar keys: .'step'"):
        ckpt["stepp"]


def test_like_errors_name_similar_keys_subtrees_and_the_fix(tmp_path):
    p = small(str(tmp_path / "ck"))
    w = torch.zeros(8, 8)
    with pytest.raises(
        sp.LayoutMismatchError,
        match=r"similar keys in it: 'model/layers\.0"
        r"\.weight'",
    ) as e:  # a DDP 'module.' prefix
        sp.load(p, like={"model": {"module.layers.0.weight": w}})
    assert "module.layers.0.weight" in str(e.value)
    with pytest.raises(sp.LayoutMismatchError, match="has a subtree there .*'model/layers"):
        sp.load(p, like={"model": w})
    with pytest.raises(sp.LayoutMismatchError, match="load into a float32 tensor and cast"):
        sp.load(p, like={"model": {"layers.0.weight": w.double()}})
    with pytest.raises(sp.LayoutMismatchError, match=r"sp\.ShardedTensor\(piece, global_shape"):
        sp.load(p, like={"model": {"layers.0.weight": torch.zeros(4, 8)}})


def test_damaged_torch_save_file_is_not_blamed_on_pickled_objects(tmp_path, capsys):
    pt = tmp_path / "m.pt"
    torch.save({"w": torch.ones(4)}, str(pt))
    pt.write_bytes(pt.read_bytes()[:200])  # truncated
    (tmp_path / "g.pt").write_bytes(b"\x46\x00garbage" * 10)
    for f in (pt, tmp_path / "g.pt"):
        rc, _, err = run(capsys, "convert", str(f), str(tmp_path / "out"))
        assert rc == 1 and "is not a readable torch.save file" in err, err
        assert "execute pickled code" not in err


def test_save_under_a_file_is_a_save_failed_error(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(sp.SaveFailedError, match="must be a writable directory"):
        sp.save({"w": torch.ones(2)}, str(tmp_path / "f" / "ck"))
    from shardpoint.tools.convert import convert

    sp.save({"w": torch.ones(2)}, str(tmp_path / "ck"))
    with pytest.raises(sp.ConversionError, match="must be a writable directory"):
        convert(str(tmp_path / "ck"), str(tmp_path / "f" / "m.safetensors"))


def _manager_under_a_file(rank, world, root):
    with sp.CheckpointManager(root) as mgr:
        try:
            mgr.save(1, {"w": torch.ones(2)})
        except sp.SaveFailedError as e:
            return type(e).__name__
    return "saved"


def test_manager_root_it_cannot_create_is_a_save_failed_error(tmp_path):
    """Rank 0 used to create the root alone, before the collective save: a bare OSError here,
    and on 2+ ranks the others left waiting in the save (the test below)."""
    (tmp_path / "f").write_text("x")
    assert _manager_under_a_file(0, 1, str(tmp_path / "f" / "ckpt")) == "SaveFailedError"


@pytest.mark.slow
def test_manager_root_it_cannot_create_fails_every_rank(tmp_path):
    """The same on 2 gloo ranks: every rank raises it, none waits for the other."""
    (tmp_path / "f").write_text("x")
    got = run_world(
        2, _manager_under_a_file, str(tmp_path / "f" / "ckpt"), timeout=90, pg_timeout=30
    )
    assert got == ["SaveFailedError", "SaveFailedError"]


def test_every_subcommand_help_has_a_description_and_examples(capsys):
    for cmd in ("inspect", "verify", "recover", "convert", "diff"):
        assert cli([cmd, "--help"]) == 0
        out = capsys.readouterr().out
        assert "examples:" in out and f"shardpoint {cmd} " in out.split("examples:")[1], cmd
        pos = out.split("positional arguments:")[1].split("options:")[0]
        assert all(len(ln.split()) > 1 for ln in pos.strip().splitlines()), (cmd, pos)


def test_meta_and_sparse_tensors_are_refused_by_name(tmp_path):
    """They used to fail inside the copy (a bare NotImplementedError wrapped as
    SaveFailedError / ShardpointError), and a meta tensor in like= was silently left unfilled."""
    p = str(tmp_path / "ck")
    with pytest.raises(sp.UnsupportedValueError, match=r"state\['w'\] is on the meta device"):
        sp.save({"w": torch.empty(2, device="meta")}, p)
    with pytest.raises(sp.UnsupportedValueError, match=r"state\['w'\] is a sparse_coo .*to_dense"):
        sp.save({"w": torch.eye(2).to_sparse()}, p)
    sp.save({"w": torch.ones(2)}, p)
    with pytest.raises(sp.UnsupportedValueError, match="meta device; nothing can be filled"):
        sp.load(p, like={"w": torch.empty(2, device="meta")})
    with pytest.raises(sp.UnsupportedValueError, match="meta device"):
        sp.load(p, like={"w": sp.ShardedTensor(torch.empty(1, device="meta"), (2,), (0,))})


def test_manager_says_force_and_refuses_negative_steps(tmp_path):
    mgr = sp.CheckpointManager(str(tmp_path / "run"))
    mgr.save(1, {"w": torch.ones(2)})
    with pytest.raises(sp.CheckpointExistsError, match="step 1 is already saved.*force=True"):
        mgr.save(1, {"w": torch.ones(2)})
    for bad in (-1, 2.5):
        with pytest.raises(sp.InvalidKeyError, match="not a step number"):
            mgr.save(bad, {"w": torch.ones(2)})
    assert mgr.all_steps() == [1]


def test_options_and_swapped_arguments_are_refused_before_any_io(tmp_path):
    p = str(tmp_path / "ck")
    with pytest.raises(sp.InvalidKeyError, match="arguments swapped"):
        sp.save(p, {"w": torch.ones(2)})  # shardpoint_jax's order
    assert not os.path.exists(p)
    sp.save({"w": torch.ones(2)}, p)
    with pytest.raises(sp.InvalidKeyError, match="arguments swapped"):
        sp.load(p, like=p)
    with pytest.raises(sp.InvalidOptionError, match="strategy is one of auto, dedup, direct"):
        sp.LoadOptions(strategy="fast")  # was accepted, and loaded somehow
    with pytest.raises(sp.InvalidOptionError, match=r"storage_gbps=0\)"):
        sp.LoadOptions(storage_gbps=0)
    with pytest.raises(ValueError, match="best_mode"):  # still a ValueError for old callers
        sp.CheckpointManager(str(tmp_path / "run"), best_metric="loss", best_mode="maximum")
    mgr = sp.CheckpointManager(str(tmp_path / "run"))
    with pytest.raises(sp.UnsupportedValueError, match="metrics must be a dict"):
        mgr.save(1, {"w": torch.ones(2)}, metrics=0.5)


def test_conformance_run_refuses_world_size_zero_with_a_usage_line(capsys):
    """World size 0 used to reach the case generator: IndexError traceback."""
    for argv in (
        ["--replay", "1", "--save-world-sizes", "0", "--load-world-sizes", "1"],
        ["--save-world-sizes", "abc"],
        ["--cases", "0"],
    ):
        assert cli(["conformance", "run", *argv]) == 2
        err = capsys.readouterr().err
        assert "error: argument" in err and "Traceback" not in err, err


def test_safetensors_source_without_the_package_names_the_install(tmp_path, monkeypatch, capsys):
    """safetensors is an optional dependency (the 'convert' extra); without it the CLI printed
    a ModuleNotFoundError traceback. (The package is installed here: hide it from import.)"""
    import sys
    from shardpoint.tools.convert import convert

    p = str(tmp_path / "ck")
    sp.save({"w": torch.ones(2)}, p)
    convert(p, str(tmp_path / "m.safetensors"))
    monkeypatch.setitem(sys.modules, "safetensors", None)
    rc, _, err = run(capsys, "convert", str(tmp_path / "m.safetensors"), str(tmp_path / "b"))
    assert rc == 1 and "needs the safetensors package" in err and "Traceback" not in err, err


def test_objects_with_state_get_the_call_that_makes_them_plain(tmp_path):
    """DCP users put a model or optimizer (Stateful) in the dict: the error names .state_dict()."""
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    p = str(tmp_path / "ck")
    for obj, fix in (
        (m, r"\.state_dict\(\)"),
        (opt, r"\.state_dict\(\)"),
        (torch.Generator(), r"\.get_state\(\)"),
        (torch.device("cpu"), "str()"),
    ):
        with pytest.raises(sp.UnsupportedValueError, match=fix):
            sp.save({"x": obj}, p)


def test_diff_refuses_a_negative_or_nan_tolerance(tmp_path, capsys):
    p = small(str(tmp_path / "ck"))
    for tol in ("-1", "nan", "x"):
        assert cli(["diff", p, p, "--atol", tol]) == 2
        assert "a tolerance is a finite number >= 0" in capsys.readouterr().err
    assert cli(["diff", p, p, "--atol", "0.5"]) == 0


def test_jax_save_and_load_with_the_pytorch_argument_order_say_so(tmp_path):
    """shardpoint_jax takes (path, tree), the PyTorch reference (state, path): swapped
    arguments raised a bare TypeError from os.fspath."""
    np = pytest.importorskip("numpy")
    spj = pytest.importorskip("shardpoint_jax")
    p = str(tmp_path / "j")
    with pytest.raises(spj.InvalidRequestError, match="arguments swapped"):
        spj.save({"w": np.ones(2)}, p)
    spj.save(p, {"w": np.ones(2)})
    with pytest.raises(spj.InvalidRequestError, match="arguments swapped"):
        spj.load({"w": np.zeros(2)}, p)
    import torch.distributed.checkpoint as dcp

    d = str(tmp_path / "dcp")
    dcp.save({"w": torch.ones(2)}, checkpoint_id=d, no_dist=True)
    with pytest.raises(spj.IncompleteCheckpointError, match="PyTorch DCP checkpoint"):
        spj.load(d)


def test_adapter_test_with_a_broken_adapter_is_one_line(capsys):
    """An adapter that cannot start or prints no capabilities JSON: a usage-level failure
    naming it (it was an AttributeError traceback for non-object JSON)."""
    import sys

    for adapter in ("nonexistent-adapter-xyz", f"{sys.executable} -c 'print(1)'"):
        assert cli(["conformance", "adapter-test", "--adapter", adapter, "--cases", "1"]) == 2
        out, err = capsys.readouterr()
        assert "adapter-test could not run" in err and "Traceback" not in out + err, err


def _different_paths(rank, world, base):
    got = []
    try:  # a per-rank name (a timestamp, the rank) where one shared path belongs
        sp.save({"w": torch.ones(2)}, os.path.join(base, f"ck{rank}"))
    except sp.InvalidOptionError as e:
        got.append(str(e))
    saved = sorted(os.listdir(base))
    sp.save({"w": torch.full((2,), 1.0)}, os.path.join(base, "a"))
    sp.save({"w": torch.full((2,), 2.0)}, os.path.join(base, "b"))
    like = {"w": torch.zeros(2)}
    try:
        sp.load(os.path.join(base, "ab"[rank]), like=like)
    except sp.InvalidOptionError as e:
        got.append(str(e))
    return got, saved, like["w"].tolist()


def test_ranks_given_different_paths_fail_together(tmp_path):
    """Before, a save wrote the coordinator's path alone without a word, and a load read each
    rank's tensors from its own path under the coordinator's manifest: two checkpoints of one
    layout mixed silently. Now every rank raises, naming the paths, before any write."""
    got = run_world(2, _different_paths, str(tmp_path), timeout=90, pg_timeout=30)
    for errs, saved, loaded in got:
        assert len(errs) == 2, errs
        assert "different checkpoint paths" in errs[0] and "ck0" in errs[0] and "ck1" in errs[0]
        assert "'" + str(tmp_path / "a") + "'" in errs[1] and str(tmp_path / "b") in errs[1]
        assert saved == [] and loaded == [0.0, 0.0]  # nothing written, nothing filled


def test_a_directory_the_commit_would_refuse_is_refused_before_any_write(tmp_path):
    """Saving into a directory that is neither empty nor a checkpoint (a DCP directory, a
    user's folder) was refused only at commit, after every byte was written; an async save
    returned a handle and failed later. Now the plan step refuses it, on the calling thread,
    and the directory is left as it was."""
    import torch.distributed.checkpoint as dcp

    d = tmp_path / "dcp"
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(d), no_dist=True)
    before = sorted(os.listdir(d))
    for async_save in (False, True):
        with pytest.raises(sp.CheckpointExistsError, match="not a checkpoint.*DCP"):
            sp.save({"w": torch.ones(4)}, str(d), async_save=async_save)
    assert sorted(os.listdir(d)) == before and sorted(os.listdir(tmp_path)) == ["dcp"]
    with pytest.raises(sp.CheckpointExistsError, match="overwrite='any'"):
        sp.save({"w": torch.ones(4)}, str(d), overwrite=True)  # True: checkpoints only
    sp.save({"w": torch.ones(4)}, str(d), overwrite="any")  # replacing it stays possible
    assert torch.equal(sp.load(str(d))["w"], torch.ones(4))


def _one_rank_bad_step(rank, world, root):
    got = []
    with sp.CheckpointManager(root) as mgr:
        for call in (lambda s: mgr.save(s, {"w": torch.ones(2)}), lambda s: mgr.load(s)):
            try:
                call(-1 if rank == 1 else 1)
            except sp.ShardpointError as e:
                got.append(type(e).__name__)
    return got


def test_a_bad_step_on_one_rank_fails_every_rank_not_a_wait(tmp_path):
    """The manager checked its arguments on each rank before the collective save, so the
    rank with the bad step raised alone and the others waited for it until the group's
    timeout; now they agree first and all raise."""
    got = run_world(2, _one_rank_bad_step, str(tmp_path / "ck"), timeout=60, pg_timeout=20)
    assert got == [["InvalidKeyError", "InvalidKeyError"]] * 2


@pytest.mark.parametrize("layout", ["packed", "per-array"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])  # direct reads; TensorStore's
def test_a_damaged_or_missing_chunk_names_its_tensor(tmp_path, dtype, layout):
    """The chunk's file path alone (tensors/<encoded key>/c/...) left the user to decode the
    key; the error now starts with it, for either read path and either layout (packed: the
    data object removed takes b's chunk with it, so either tensor may be the one named)."""
    p = str(tmp_path / "ck")
    state = {"model": {"w": torch.ones(8, 8, dtype=dtype), "b": torch.ones(8)}}
    sp.save(state, p, **backend_of(layout))
    chunk, off = chunk_at(p, "model/w")
    raw = bytearray(open(chunk, "rb").read())
    raw[off + 1] ^= 0x40
    open(chunk, "wb").write(raw)
    like = {"model": {"w": torch.zeros(8, 8, dtype=dtype), "b": torch.zeros(8)}}
    with pytest.raises(sp.CorruptCheckpointError, match=r"^\[SP-READ-3\] tensor 'model/w': "):
        sp.load(p, like=like)
    os.remove(chunk)
    named = "model/w" if layout == "per-array" else "model/[wb]"
    with pytest.raises(sp.CorruptCheckpointError, match=rf"^\[SP-READ-2\] tensor '{named}': "):
        sp.load(p, like=like)


def _disagreeing_arguments(rank, world, base):
    got = []
    sp.save({"w": torch.ones(2)}, os.path.join(base, "a"))
    before = os.stat(os.path.join(base, "a", "manifest.msgpack")).st_ino
    for kwargs in (
        {"overwrite": rank == 1},
        {
            "overwrite": True,
            "options": sp.SaveOptions(plan=sp.PlanOptions(max_chunk_bytes=(1 << 20) * (rank + 1))),
        },
    ):
        try:
            sp.save({"w": torch.full((2,), 5.0)}, os.path.join(base, "a"), **kwargs)
            got.append("saved")
        except sp.InvalidOptionError as e:
            got.append(str(e))
    try:  # a per-rank value saved as a plain one
        sp.save({"w": torch.ones(2), "pos": 100 + rank}, os.path.join(base, "b"))
        got.append("saved")
    except sp.InvalidShardingError as e:
        got.append(f"{e.spec_id} {e}")
    after = os.stat(os.path.join(base, "a", "manifest.msgpack")).st_ino
    return got, before == after, sorted(os.listdir(base))


def test_ranks_passing_different_overwrite_options_or_values_fail_together(tmp_path):
    """Before, rank 0's overwrite flag and options decided silently, and a plain value that
    differed per rank kept rank 0's; now every rank raises, naming the argument or the key,
    before anything is written (issue 21)."""
    got = run_world(2, _disagreeing_arguments, str(tmp_path), timeout=120, pg_timeout=30)
    for errs, untouched, listing in got:
        assert "different overwrite flags" in errs[0] and "False" in errs[0], errs
        assert "different SaveOptions.plans" in errs[1], errs
        assert errs[2].startswith("SP-REPL-1") and "'pos'" in errs[2] and "100" in errs[2]
        assert untouched and listing == ["a"]


def _diverged_replicas(rank, world, base):
    got = []
    st = {
        "w": torch.full((4, 3), 1.0 + (rank == 1) * 1e-7),  # diverged DP rank
        "ok": sp.ShardedTensor(torch.ones(2, 3), (4, 3), (2 * rank, 0)),
    }
    try:
        sp.save(st, os.path.join(base, "a"), options=sp.SaveOptions(check_replicas=True))
        got.append("saved")
    except sp.InvalidShardingError as e:
        got.append(f"{e.spec_id} {e}")
    same = {"w": torch.full((4, 3), 1.0), "ok": st["ok"]}
    r = sp.save(same, os.path.join(base, "b"), options=sp.SaveOptions(check_replicas=True))
    got.append(r.timings.get("replica_check") is not None)
    return got, sorted(os.listdir(base))


def test_replica_check_refuses_diverged_replicas(tmp_path):
    """Replicas with different values were accepted and one kept silently; with
    check_replicas the save fails on every rank, naming the key and region (issue 21)."""
    got = run_world(2, _diverged_replicas, str(tmp_path), timeout=120, pg_timeout=30)
    for (err, timed), listing in got:
        assert err.startswith("SP-REPL-1") and "'w'" in err and "differ" in err, err
        assert timed and listing == ["b"]


def test_load_with_swapped_arguments_names_the_fix_not_the_whole_tree(tmp_path):
    """``load(like, path)`` printed the whole dict as "the path" (CheckpointNotFoundError);
    ``save`` already said its arguments looked swapped."""
    p = small(str(tmp_path / "ck"))
    like = {"model": {"layers.0.weight": torch.zeros(8, 8), "layers.0.bias": torch.zeros(8)}}
    with pytest.raises(
        sp.InvalidOptionError,
        match=r"is a dict, .*like is a path "
        r".*arguments swapped\? call load\(path, like\)",
    ) as e:
        sp.load(like, p)
    assert "tensor(" not in str(e.value) and "{" not in str(e.value)
    with pytest.raises(sp.InvalidOptionError, match=r"call load\(path\)"):
        sp.Checkpointer().load(like)  # a tree and no path at all
    assert torch.equal(sp.load(p, like)["model"]["layers.0.bias"], torch.ones(8))


def test_a_missing_manifest_names_an_incomplete_copy_too(tmp_path, capsys):
    """A directory without its manifest is as likely a copy that stopped short (or left the
    manifest out) as a crashed save; the error says both, still IncompleteCheckpointError."""
    import shutil

    p = small(str(tmp_path / "ck"))
    cp = str(tmp_path / "copy")
    shutil.copytree(p, cp, ignore=shutil.ignore_patterns("manifest.msgpack"))
    with pytest.raises(sp.IncompleteCheckpointError, match="incomplete copy") as e:
        sp.load(cp)
    assert "unfinished save" in str(e.value) and e.value.spec_id == "SP-COMMIT-3"
    rc, _, err = run(capsys, "inspect", cp)
    assert rc == 1 and "incomplete copy" in err and err.count("\n") == 1, err
