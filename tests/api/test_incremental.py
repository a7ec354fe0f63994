"""Incremental packed checkpoints (issue 30 item 4; spec/format.md section 13, [SP-PACK-9]
to [SP-PACK-11]): a save refers to a base's unchanged chunks instead of rewriting them;
loads are bitwise; a base that is missing, replaced or elsewhere is refused by rule; and
nothing deletes a checkpoint that a live one builds on (overwrite, remove, retention), while
a crashed incremental save's leftovers go without touching its base."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import shardpoint as sp
from shardpoint_core.format.errors import (
    CheckpointReferencedError,
    CorruptCheckpointError,
    InvalidOptionError,
)
from shardpoint_core.format.manifest import decode_manifest
from shardpoint_core.transactions.packed import PackedBackend
from shardpoint_core.verify import verify_checkpoint


def _state(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "frozen": {
            "emb": np.random.default_rng(99).standard_normal((300, 200)).astype(np.float32),
            "big": np.random.default_rng(98).standard_normal((1100, 600)).astype(np.float32),
        },
        "train": rng.standard_normal((40, 30)).astype(np.float32),
        "flag": np.array([True, False]),
        "step": seed,
    }


def _manifest(path: str):
    with open(os.path.join(path, "manifest.msgpack"), "rb") as f:
        return decode_manifest(f.read())


def _own_bytes(path: str) -> int:
    d = os.path.join(path, "packed")
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def _same(got: dict, want: dict) -> None:
    for k in ("emb", "big"):
        assert np.asarray(got["frozen"][k]).tobytes() == want["frozen"][k].tobytes()
    assert np.asarray(got["train"]).tobytes() == want["train"].tobytes()
    assert np.asarray(got["flag"]).tobytes() == want["flag"].tobytes()
    assert got["step"] == want["step"]


def test_incremental_save_writes_only_changed_chunks_and_loads_bitwise(tmp_path):
    s1, s2 = _state(1), _state(2)
    sp.save(s1, str(tmp_path / "a"), backend=PackedBackend(hashes=True))
    sp.save(s2, str(tmp_path / "b"), incremental="a")
    assert _own_bytes(str(tmp_path / "b")) * 20 < _own_bytes(str(tmp_path / "a"))
    m = _manifest(str(tmp_path / "b"))
    assert [n for n, _i in m.packed.bases] == ["a"]
    shared = [i for i in range(len(m.packed.objects)) if m.packed.base_of(i) is not None]
    assert shared and m.packed.hashes is not None
    _same(sp.load(str(tmp_path / "b")), s2)
    rep = verify_checkpoint(str(tmp_path / "b"))
    assert rep.ok, rep.problems
    own = m.packed.sharing()["own"]["chunks"]
    assert rep.hashes and rep.shared["a"] == rep.chunks - own > 0
    assert own == m.tensors["train"].packed.records.size  # only train changed


def test_chain_refers_to_the_owner_directly_and_survives_a_moved_parent(tmp_path):
    root = tmp_path / "run"
    sp.save(_state(1), str(root / "s1"), backend=PackedBackend(hashes=True))
    sp.save(_state(2), str(root / "s2"), incremental=True)  # the newest beside it: s1
    s3 = _state(3)
    sp.save(s3, str(root / "s3"), incremental=str(root / "s2"))
    # s2's own chunk (train) changed again: s3 refers to s1's bytes directly, not via s2
    assert [n for n, _i in _manifest(str(root / "s3")).packed.bases] == ["s1"]
    os.rename(root, tmp_path / "moved")
    _same(sp.load(str(tmp_path / "moved" / "s3")), s3)


def test_a_replaced_or_missing_base_is_refused_by_rule(tmp_path):
    sp.save(_state(1), str(tmp_path / "a"), backend=PackedBackend(hashes=True))
    sp.save(_state(2), str(tmp_path / "b"), incremental="a")
    shutil.move(str(tmp_path / "a"), str(tmp_path / "a_old"))
    with pytest.raises(CorruptCheckpointError, match=r"SP-PACK-9.*tensor '.*': base 'a'.*missing"):
        sp.load(str(tmp_path / "b"))
    # another save at the base's name, with the very same bytes: still not the base
    sp.save(_state(1), str(tmp_path / "a"), backend=PackedBackend(hashes=True))
    with pytest.raises(CorruptCheckpointError, match=r"SP-PACK-9.*replaced"):
        sp.load(str(tmp_path / "b"))


def test_a_base_must_lie_beside_and_not_be_the_target(tmp_path):
    sp.save(_state(1), str(tmp_path / "x" / "a"), backend=PackedBackend(hashes=True))
    with pytest.raises(InvalidOptionError, match="beside"):
        sp.save(_state(2), str(tmp_path / "y" / "b"), incremental=str(tmp_path / "x" / "a"))
    with pytest.raises(InvalidOptionError, match="replaces"):
        sp.save(_state(2), str(tmp_path / "x" / "a"), incremental="a", overwrite=True)
    sp.save(_state(1), str(tmp_path / "x" / "plain"), backend=sp.ZarrBackend())  # per-array
    with pytest.raises(InvalidOptionError, match="packed layout"):
        sp.save(_state(2), str(tmp_path / "x" / "b"), incremental="plain")
    assert not os.path.exists(tmp_path / "y" / "b") and not os.path.exists(tmp_path / "x" / "b")


def test_a_base_without_hashes_shares_nothing_and_says_so(tmp_path, caplog):
    sp.save(_state(1), str(tmp_path / "a"), backend=PackedBackend())  # no hashes
    with caplog.at_level("WARNING", logger="shardpoint"):
        sp.save(_state(2), str(tmp_path / "b"), incremental="a")
    said = [r.getMessage() for r in caplog.records if "records no chunk hashes" in r.message]
    assert len(said) == 1 and str(tmp_path / "a") in said[0], caplog.text
    b = _manifest(str(tmp_path / "b")).packed
    assert not b.bases and b.hashes is not None  # a full save, which the next can build on
    _same(sp.load(str(tmp_path / "b")), _state(2))


def test_overwrite_and_remove_of_a_base_are_refused(tmp_path):
    sp.save(_state(1), str(tmp_path / "a"), backend=PackedBackend(hashes=True))
    sp.save(_state(2), str(tmp_path / "b"), incremental="a")
    with pytest.raises(CheckpointReferencedError, match=r"SP-PACK-11.*\['b'\]"):
        sp.save(_state(5), str(tmp_path / "a"), overwrite=True)
    from shardpoint_core.commit.posix import PosixCommitter

    with pytest.raises(CheckpointReferencedError):
        PosixCommitter().remove(str(tmp_path / "a"))
    _same(sp.load(str(tmp_path / "b")), _state(2))
    # once nothing builds on it, it goes
    assert PosixCommitter().remove(str(tmp_path / "b"))
    assert PosixCommitter().remove(str(tmp_path / "a"))


def test_manager_retention_keep_1_over_a_chain_keeps_the_bases(tmp_path):
    mgr = sp.CheckpointManager(str(tmp_path / "run"), max_to_keep=1, incremental=True)
    last = None
    for step in range(1, 5):
        last = _state(step)
        mgr.save(step, last)
    mgr.wait()
    # step 1 holds the frozen bytes every later step refers to: kept; 2 and 3 are gone
    assert mgr.all_steps() == [1, 4]
    assert not mgr.retention_warnings
    _same(sp.load(mgr.path(4)), last)
    assert _own_bytes(mgr.path(4)) * 20 < _own_bytes(mgr.path(1))
    assert verify_checkpoint(mgr.path(4)).ok


_CRASH = """
import os, sys, numpy as np
from shardpoint_core.format.spec import ArraySpec
from shardpoint_core.transactions.packed import PackedBackend
from shardpoint_core.transactions.writer import CheckpointWriter
be = PackedBackend(incremental="a")
w = CheckpointWriter.begin(sys.argv[1], backend=be)
x = np.ones((64, 64), np.float32)
h = w.open_array("tensors/x", ArraySpec((64, 64), "float32", (64, 64)))
w.wait([w.write(h, (0, 0), x)])
w.flush()
os._exit(0)  # a crash: staged objects, no manifest
"""


def test_a_crashed_incremental_saves_leftovers_go_without_touching_its_base(tmp_path):
    s1 = _state(1)
    sp.save(s1, str(tmp_path / "a"), backend=PackedBackend(hashes=True))
    before = {
        f: os.path.getsize(tmp_path / "a" / "packed" / f)
        for f in os.listdir(tmp_path / "a" / "packed")
    }
    subprocess.run([sys.executable, "-c", _CRASH, str(tmp_path / "b")], check=True, timeout=120)
    found = sp.recover(str(tmp_path), min_age_s=0)
    assert found, "the crashed save's staging is a leftover"
    assert sorted(os.listdir(tmp_path)) == ["a"]
    after = {
        f: os.path.getsize(tmp_path / "a" / "packed" / f)
        for f in os.listdir(tmp_path / "a" / "packed")
    }
    assert after == before
    _same(sp.load(str(tmp_path / "a")), s1)


def test_verify_finds_a_chunk_whose_hash_is_not_the_index_s_and_inspect_shows_sharing(
    tmp_path, capsys
):
    from shardpoint.tools.cli import main
    from shardpoint_conformance.vector_damage import rewrite_body

    sp.save(_state(1), str(tmp_path / "a"), backend=PackedBackend(hashes=True))
    sp.save(_state(2), str(tmp_path / "b"), incremental="a")
    assert main(["inspect", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "shared with base 'a'" in out and "in its own objects" in out

    def flip(body: dict) -> None:
        h = bytearray(body["packed"]["hashes"])
        h[0] ^= 1
        body["packed"]["hashes"] = bytes(h)

    rewrite_body(str(tmp_path / "b"), flip)
    rep = verify_checkpoint(str(tmp_path / "b"))
    assert not rep.ok and [p for p in rep.problems if "SP-PACK-10" in str(p)], rep.problems


def test_incremental_on_s3_refers_to_the_base_objects_and_guards_them(s3_env):
    from shardpoint_core.stores.location import locate

    root = s3_env.url(s3_env.fresh_prefix("incr") + "/run")
    s2 = _state(2)
    sp.save(_state(1), f"{root}/a", backend=PackedBackend(hashes=True))
    sp.save(s2, f"{root}/b", incremental=f"{root}/a")
    store, key = locate(f"{root}/b").pair()
    own = sum(i.size for i in store.list(key + "/") if "/packed/" in i.key)
    store_a, key_a = locate(f"{root}/a").pair()
    theirs = sum(i.size for i in store_a.list(key_a + "/") if "/packed/" in i.key)
    assert own * 20 < theirs
    _same(sp.load(f"{root}/b"), s2)
    with pytest.raises(CheckpointReferencedError):
        sp.save(_state(5), f"{root}/a", overwrite=True, backend=PackedBackend())
    from shardpoint_core.commit.routing import default_committer

    with pytest.raises(CheckpointReferencedError):
        default_committer().remove(f"{root}/a")
    _same(sp.load(f"{root}/b"), s2)


def _two_rank_incremental(rank, world, root):
    import torch

    import shardpoint as sp2
    from shardpoint_core.transactions.packed import PackedBackend as Packed

    def state(step):
        frozen = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
        mine = torch.full((4,), float(rank + 10 * step))
        return {
            "frozen": sp2.ShardedTensor(
                frozen[rank * 32 : (rank + 1) * 32].clone(), (64, 8), (rank * 32, 0)
            ),
            "mine": sp2.ShardedTensor(mine, (8,), (rank * 4,)),
            "step": step,
        }

    opts = sp2.SaveOptions(plan=sp2.PlanOptions(max_chunk_bytes=256, chunk_overhead_bytes=0))
    sp2.save(state(1), f"{root}/s1", backend=Packed(hashes=True), options=opts)
    sp2.save(state(2), f"{root}/s2", incremental="s1", options=opts)
    return True


@pytest.mark.slow  # fast variant: test_packed_bases.py::test_two_writers_parts_with_...
def test_two_ranks_each_refer_to_the_base_chunks_they_own(tmp_path):
    """Real gloo ranks: each writer compares the chunks it owns and refers to the base's;
    the coordinator gathers both ranks' references into one index."""
    from shardpoint_testing.launch import run_world

    root = str(tmp_path)
    assert run_world(2, _two_rank_incremental, root, timeout=120, pg_timeout=30) == [True, True]
    m = _manifest(os.path.join(root, "s2"))
    sh = m.packed.sharing()
    assert sh["bases"]["s1"]["chunks"] >= 4 and sh["own"]["chunks"] == 2, sh
    kinds = [m.packed.base_of(i) for i in range(len(m.packed.objects))]
    assert kinds.count(0) == 2 and kinds.count(None) == 2  # both ranks' objects, both saves
    got = sp.load(os.path.join(root, "s2"))
    assert np.array_equal(
        np.asarray(got["frozen"]), np.arange(512, dtype=np.float32).reshape(64, 8)
    )
    assert list(np.asarray(got["mine"])) == [20.0] * 4 + [21.0] * 4


def test_manager_on_s3_keeps_the_bases_of_what_it_keeps(s3_env):
    root = s3_env.url(s3_env.fresh_prefix("incr-mgr") + "/run")
    with pytest.raises(InvalidOptionError, match="name the base"):
        sp.save(_state(1), f"{root}/x", incremental=True)
    mgr = sp.CheckpointManager(root, max_to_keep=1, incremental=True)
    for step in range(1, 4):
        last = _state(step)
        mgr.save(step, last)
    assert mgr.all_steps() == [1, 3] and not mgr.retention_warnings
    _same(sp.load(mgr.path(3)), last)


def test_zarr_python_reads_an_incremental_checkpoint_bit_for_bit(tmp_path):
    zarr = pytest.importorskip("zarr")
    from shardpoint_core.transactions.packed_zarr import zarr_store

    s2 = _state(2)
    sp.save(_state(1), str(tmp_path / "a"), backend=PackedBackend(hashes=True))
    sp.save(s2, str(tmp_path / "b"), incremental="a")
    store = zarr_store(str(tmp_path / "b"))
    m = _manifest(str(tmp_path / "b"))
    for key, want in (("frozen/big", s2["frozen"]["big"]), ("train", s2["train"])):
        z = zarr.open_array(store, path=m.tensors[key].array, mode="r")
        assert np.asarray(z[...]).tobytes() == want.tobytes()
