"""``torch.distributed.checkpoint`` with shardpoint storage: ``dcp.save``/``dcp.async_save``/
``dcp.load`` with ``ShardpointWriter``/``ShardpointReader`` in place of DCP's file system
classes, on real gloo ranks and in one process (``no_dist``).

The cases follow what DCP's own CPU tests of its file-system storage exercise: uneven and
enumerable (ShardedTensor) shard layouts, loading row-wise into column-wise, ``BytesIO`` and
``Stateful`` entries, nested dicts, DTensor state from FSDP2 and from tensor parallelism,
thread counts, ``no_dist``; and what makes them shardpoint checkpoints: ``shardpoint verify
--strict`` passes, no DCP ``.metadata`` pickle exists, ``sp.load`` reads them at other world
sizes, ``shardpoint_jax`` reads them, and the reader loads checkpoints written by ``sp.save``.
One 2-rank world runs all distributed cases, to keep the time down.
"""

import io
import os
import subprocess
import sys
import warnings

import pytest
import torch

from shardpoint_testing.launch import run_world
from shardpoint_testing.tensors import seeded_randn

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def _no_pickle_metadata(path):
    found = [
        os.path.join(r, f)
        for r, _d, fs in os.walk(path)
        for f in fs
        if f.endswith(".metadata") or f.endswith(".distcp") or f.endswith(".pt")
    ]
    assert found == [], found


def _verify_strict(path):
    r = subprocess.run(
        [sys.executable, "-m", "shardpoint", "verify", "--strict", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.startswith("OK:"), r.stdout + r.stderr


class Counter:
    """A DCP ``Stateful``: DCP calls ``state_dict`` before saving, ``load_state_dict`` after."""

    def __init__(self, n=0):
        self.n = n
        self.seen = torch.full((3,), n, dtype=torch.int32)

    def state_dict(self):
        return {"n": self.n, "seen": self.seen}

    def load_state_dict(self, sd):
        self.n = sd["n"]
        self.seen.copy_(sd["seen"])


DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def _all_dtypes():
    g = torch.Generator().manual_seed(1)
    out = {}
    for dt in DTYPES:
        raw = torch.randint(0, 256, (3, 5), generator=g, dtype=torch.uint8)
        n = torch.tensor([], dtype=dt).element_size()
        out[str(dt).split(".")[1]] = raw.repeat(1, n).view(dt) if dt != torch.bool else raw > 9
    return out


def test_no_dist_round_trip_every_dtype_values_bytesio_stateful(tmp_path):
    import torch.distributed.checkpoint as dcp
    import shardpoint as sp
    from shardpoint.dcp import ShardpointReader, ShardpointWriter

    path = tmp_path / "c"
    state = {
        "model": {"layer.0.weight": torch.randn(4, 3), "dtypes": _all_dtypes()},
        "step": 7,
        "tags": [1, 2, "a"],
        "blob": io.BytesIO(b"\x00raw"),
        "counter": Counter(4),
        "nested": {"a": {"b": {"c": torch.ones(2, 2)}}},
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }
    dcp.save(state, storage_writer=ShardpointWriter(path, thread_count=4), no_dist=True)
    _no_pickle_metadata(path)
    _verify_strict(path)
    back = sp.load(str(path))  # plain shardpoint: the tree under DCP's paths
    assert back["step"] == 7 and back["tags"] == [1, 2, "a"] and back["blob"] == b"\x00raw"
    assert back["counter"]["n"] == 4
    assert torch.equal(back["model"]["layer.0.weight"], state["model"]["layer.0.weight"])

    like = {
        "model": {
            "layer.0.weight": torch.zeros(4, 3),
            "dtypes": {k: torch.zeros_like(v) for k, v in _all_dtypes().items()},
        },
        "step": 0,
        "tags": None,
        "blob": io.BytesIO(),
        "counter": Counter(0),
        "nested": {"a": {"b": {"c": torch.zeros(2, 2)}}},
        "scalar": torch.tensor(0.0),
        "empty": torch.ones(0, 4),
    }
    dcp.load(like, storage_reader=ShardpointReader(path), no_dist=True)
    for k, v in _all_dtypes().items():  # bitwise: compare the bytes
        assert torch.equal(
            like["model"]["dtypes"][k].view(torch.uint8)
            if v.dtype != torch.bool
            else like["model"]["dtypes"][k],
            v.view(torch.uint8) if v.dtype != torch.bool else v,
        ), k
    assert torch.equal(like["model"]["layer.0.weight"], state["model"]["layer.0.weight"])
    assert like["step"] == 7 and like["tags"] == [1, 2, "a"]
    assert like["blob"].getvalue() == b"\x00raw" and like["counter"].n == 4
    assert torch.equal(like["counter"].seen, torch.full((3,), 4, dtype=torch.int32))
    assert torch.equal(like["nested"]["a"]["b"]["c"], torch.ones(2, 2))
    assert like["scalar"].item() == 3.5


def test_reader_loads_a_checkpoint_written_by_sp_save(tmp_path):
    import torch.distributed.checkpoint as dcp
    import shardpoint as sp
    from shardpoint.dcp import ShardpointReader

    w = torch.arange(24.0).reshape(6, 4)
    sp.save(
        {
            "model": {"w": w, "layers": [torch.ones(3), torch.zeros(2)]},
            "step": 11,
            "rng": sp.ShardedObject(5, 0, 1),
        },
        str(tmp_path / "c"),
    )
    like = {"model": {"w": torch.zeros(6, 4), "layers": [torch.zeros(3), torch.ones(2)]}, "step": 0}
    dcp.load(like, storage_reader=ShardpointReader(tmp_path / "c"), no_dist=True)
    assert torch.equal(like["model"]["w"], w) and like["step"] == 11
    assert torch.equal(like["model"]["layers"][0], torch.ones(3))
    # a DCP state dict keyed as a model's (no nesting) asks for what it holds only
    part = {"model": {"w": torch.zeros(6, 4)}}
    dcp.load(
        part, checkpoint_id=str(tmp_path / "c"), storage_reader=ShardpointReader("x"), no_dist=True
    )
    assert torch.equal(part["model"]["w"], w)


def test_unsupported_object_is_refused_with_shardpoint_error(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from shardpoint.dcp import ShardpointWriter

    with pytest.raises(CheckpointException, match="UnsupportedValueError|not a supported"):
        dcp.save(
            {"w": torch.ones(2), "obj": {1, 2}},
            storage_writer=ShardpointWriter(tmp_path / "c"),
            no_dist=True,
        )
    assert not (tmp_path / "c").exists()


# ------------------------------------------------------------------ one 2-rank world
def _two_rank_cases(rank, world, root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard as DShard, distribute_tensor, DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from shardpoint.dcp import ShardpointReader, ShardpointWriter

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (world,))
    done = []

    # 1. uneven DTensor rows (5 over 2) -> load column-wise; a nested dict; values
    w = seeded_randn("w", (5, 6))
    path = os.path.join(root, "rows")
    state = {"model": {"w": distribute_tensor(w, mesh, [DShard(0)])}, "step": 3}
    dcp.save(state, storage_writer=ShardpointWriter(path, thread_count=2))
    cols = {"model": {"w": distribute_tensor(torch.zeros(5, 6), mesh, [DShard(1)])}, "step": 0}
    dcp.load(cols, storage_reader=ShardpointReader(path))
    assert torch.equal(cols["model"]["w"].full_tensor(), w) and cols["step"] == 3
    assert cols["model"]["w"].to_local().shape == (5, 3)
    done.append("rowwise->colwise")

    # 2. enumerable uneven shards (legacy ShardedTensor, 2 rows on rank 0, 3 on rank 1)
    #    loaded into a replicated plain tensor
    e = seeded_randn("e", (5, 4))
    rows = [(0, 2), (2, 5)]
    md = [ShardMetadata([a, 0], [b - a, 4], f"rank:{r}/cpu") for r, (a, b) in enumerate(rows)]
    a, b = rows[rank]
    st = init_from_local_shards([Shard(e[a:b].clone(), md[rank])], [5, 4])
    path = os.path.join(root, "enum")
    dcp.save({"e": st}, storage_writer=ShardpointWriter(path))
    plain = {"e": torch.zeros(5, 4)}
    dcp.load(plain, storage_reader=ShardpointReader(path))
    assert torch.equal(plain["e"], e)
    done.append("enumerable")

    # 3. FSDP2 model + optimizer state through DCP's state_dict helpers, Stateful entry
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    path = os.path.join(root, "fsdp")
    dcp.save({"model": msd, "optim": osd}, storage_writer=ShardpointWriter(path))
    ref = {k: v.full_tensor().clone() for k, v in msd.items()}
    torch.manual_seed(1)
    model2 = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    fully_shard(model2, mesh=mesh)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    model2(torch.randn(4, 5)).sum().backward()
    opt2.step()
    msd2, osd2 = get_state_dict(model2, opt2)
    target = {"model": msd2, "optim": osd2}
    dcp.load(target, storage_reader=ShardpointReader(path))
    set_state_dict(model2, opt2, model_state_dict=target["model"], optim_state_dict=target["optim"])
    for k, v in get_state_dict(model2, opt2)[0].items():
        assert torch.equal(v.full_tensor(), ref[k]), k
    o1 = get_state_dict(model, opt)[1]["state"]
    o2 = get_state_dict(model2, opt2)[1]["state"]
    for k in o1:
        for s in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(o1[k][s].full_tensor(), o2[k][s].full_tensor()), (k, s)
    done.append("fsdp2")

    # 4. tensor parallel (colwise + rowwise Linear), async_save, loaded back with a fresh model
    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(4, 6)
            self.down = torch.nn.Linear(6, 4)

    torch.manual_seed(2)
    tp = parallelize_module(MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    path = os.path.join(root, "tp")
    fut = dcp.async_save({"model": tp.state_dict()}, storage_writer=ShardpointWriter(path))
    fut.result()
    want = {k: v.full_tensor() for k, v in tp.state_dict().items()}
    torch.manual_seed(3)
    tp2 = parallelize_module(MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    sd2 = {"model": tp2.state_dict()}
    dcp.load(sd2, storage_reader=ShardpointReader(path))
    for k, v in sd2["model"].items():
        assert isinstance(v, DTensor) and torch.equal(v.full_tensor(), want[k]), k
    done.append("tp+async")

    # 5. a checkpoint written by sp.save on these ranks, read through DCP into DTensors
    import shardpoint as sp

    h = seeded_randn("h", (4, 6), torch.bfloat16)
    path = os.path.join(root, "native")
    sp.save(
        {
            "h": sp.ShardedTensor(h[:, 3 * rank : 3 * rank + 3].clone(), (4, 6), (0, 3 * rank)),
            "it": 9,
        },
        path,
    )
    into = {
        "h": distribute_tensor(torch.zeros(4, 6, dtype=torch.bfloat16), mesh, [DShard(0)]),
        "it": 0,
    }
    dcp.load(into, storage_reader=ShardpointReader(path))
    assert torch.equal(into["h"].full_tensor(), h) and into["it"] == 9
    done.append("sp.save->dcp.load")

    # 6. no_dist inside a running world: each rank saves and loads its own checkpoint alone
    mine = os.path.join(root, f"solo{rank}")
    dcp.save(
        {"r": torch.full((3,), rank), "tag": f"rank{rank}"},
        storage_writer=ShardpointWriter(mine),
        no_dist=True,
    )
    back = {"r": torch.zeros(3, dtype=torch.int64), "tag": ""}
    dcp.load(back, storage_reader=ShardpointReader(mine), no_dist=True)
    assert torch.equal(back["r"], torch.full((3,), rank)) and back["tag"] == f"rank{rank}"
    done.append("no_dist in a world")
    dist.barrier()
    return done


def _sp_load_three(rank, world, root):
    import shardpoint as sp

    w = seeded_randn("w", (5, 6))
    a, b = rank * 2, min(5, rank * 2 + 2)
    like = {"model": {"w": sp.ShardedTensor(torch.empty(b - a, 6), (5, 6), (a, 0))}}
    out = sp.load(os.path.join(root, "rows"), like=like)
    assert torch.equal(out["model"]["w"], w[a:b])
    # dcp.load at another world size: the 2-rank checkpoint into DTensors on a 3-rank mesh,
    # rows (uneven: 2, 2, 1) and columns
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard as DShard, distribute_tensor
    from shardpoint.dcp import ShardpointReader

    mesh = init_device_mesh("cpu", (world,))
    for dim in (0, 1):
        into = {
            "model": {"w": distribute_tensor(torch.zeros(5, 6), mesh, [DShard(dim)])},
            "step": 0,
        }
        dcp.load(into, storage_reader=ShardpointReader(os.path.join(root, "rows")))
        assert torch.equal(into["model"]["w"].full_tensor(), w) and into["step"] == 3
    return True


@pytest.mark.slow
def test_two_ranks_dcp_cases_then_sp_load_on_three_and_jax(tmp_path):
    """Slow (2-rank then 3-rank worlds and a JAX process); the default suite runs DCP on
    2 gloo ranks in tests/integrations/test_crossover.py."""
    done = run_world(2, _two_rank_cases, str(tmp_path), timeout=300)
    assert (
        done[0]
        == done[1]
        == [
            "rowwise->colwise",
            "enumerable",
            "fsdp2",
            "tp+async",
            "sp.save->dcp.load",
            "no_dist in a world",
        ]
    )
    for name in ("rows", "enum", "fsdp", "tp", "solo0", "solo1"):
        _no_pickle_metadata(tmp_path / name)
    _verify_strict(tmp_path / "rows")
    _verify_strict(tmp_path / "fsdp")
    assert run_world(3, _sp_load_three, str(tmp_path), timeout=120) == [True] * 3
    jax_load = r"""
import sys, numpy as np, shardpoint_jax as spj
out = spj.load(sys.argv[1])
w = np.asarray(out["model"]["w"])
assert w.shape == (5, 6) and out["step"] == 3
np.save(sys.argv[2], w)
"""
    r = subprocess.run(
        [sys.executable, "-c", jax_load, str(tmp_path / "rows"), str(tmp_path / "w.npy")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert r.returncode == 0, r.stderr
    import numpy as np

    assert np.array_equal(np.load(tmp_path / "w.npy"), seeded_randn("w", (5, 6)).numpy())


# ------------------------------- cases DCP's own suite exercised that failed before (issue 22)
def test_filesystem_writer_arguments_accepted_positionally_and_extensions_refused(tmp_path):
    """FileSystemWriter's arguments in its own order (DCP's suite passes ``_extensions`` and
    ``_extension_registry``): accepted; a stream extension (which transforms DCP's own .distcp
    files, which a shardpoint checkpoint has none of) is refused, not ignored (issue 33)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    import shardpoint as sp
    from shardpoint.dcp import ShardpointReader, ShardpointWriter

    class Identity(StreamTransformExtension):  # a DCP stream transform (it changes nothing)
        registry_name = staticmethod(lambda: "identity")
        from_descriptor = staticmethod(lambda version: Identity())
        get_descriptor = lambda self: "identity/1"  # noqa: E731
        transform_to = transform_from = lambda self, stream: stream  # noqa: E731

    state = {"w": torch.arange(6.0), "blob": io.BytesIO(b"payload")}
    w = ShardpointWriter(tmp_path / "c", True, True, 2, 1 << 20, False, True)
    dcp.save(state, storage_writer=w, no_dist=True)
    with pytest.raises(sp.InvalidOptionError, match="Identity.*cannot be applied"):
        ShardpointWriter(path=tmp_path / "z", thread_count=2, _extensions=[Identity()])
    with pytest.raises(sp.InvalidOptionError, match="serialization_format"):
        ShardpointWriter(tmp_path / "z", serialization_format=SerializationFormat.SAFETENSORS)
    ShardpointWriter(tmp_path / "z", serialization_format=SerializationFormat.TORCH_SAVE)
    _no_pickle_metadata(tmp_path / "c")
    like = {"w": torch.zeros(6), "blob": io.BytesIO()}
    dcp.load(
        like, storage_reader=ShardpointReader(tmp_path / "c", ExtensionRegistry()), no_dist=True
    )
    assert torch.equal(like["w"], torch.arange(6.0)) and like["blob"].getvalue() == b"payload"


def test_zstandard_extension_is_honoured_as_zstd_compressed_chunks(tmp_path):
    """DCP's ``_extensions=[ZStandard()]`` (its compression; DCP's own suite saves with it)
    compresses the chunks with Zarr v3's zstd codec (format 1.5) instead of being refused;
    the state loads back bit for bit through DCP, and other extensions beside it are still
    refused (issue 33)."""

    pytest.importorskip("zstandard")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard
    import shardpoint as sp
    from shardpoint.dcp import ShardpointReader, ShardpointWriter

    state = {"w": torch.zeros(64, 64), "r": torch.randn(5, 3), "step": 4}
    w = ShardpointWriter(tmp_path / "c", _extensions=[ZStandard()])
    dcp.save(state, storage_writer=w, no_dist=True)
    m = sp.read_metadata(str(tmp_path / "c"))
    assert tuple(m.format_version) == (1, 5)
    # the packed layout (the default): w's chain is zstd's in the index ([SP-PACK-12]), its
    # one chunk of 16 KiB of zeros stored in a few bytes, and so it opens in zarr-python
    packed = m.tensors["w"].packed
    assert packed.codec is not None and packed.codec["name"] == "zstd"
    assert packed.chunk(0)[2] < 1000
    zarr = pytest.importorskip("zarr")
    z = zarr.open_array(sp.zarr_store(str(tmp_path / "c")), path=m.tensors["w"].array, mode="r")
    assert [c.to_dict()["name"] for c in z.metadata.codecs] == ["bytes", "zstd", "crc32c"]
    like = {"w": torch.ones(64, 64), "r": torch.empty(5, 3), "step": 0}
    dcp.load(like, storage_reader=ShardpointReader(tmp_path / "c"), no_dist=True)
    assert torch.equal(like["w"], state["w"]) and torch.equal(like["r"], state["r"])
    assert like["step"] == 4
    _verify_strict(tmp_path / "c")

    class Rot(ZStandard):  # another transform (DCP's suite has Rot13): refused, not ignored
        registry_name = staticmethod(lambda: "stream.rot13")

    with pytest.raises(sp.InvalidOptionError, match="Rot.*cannot be applied"):
        ShardpointWriter(tmp_path / "z", _extensions=[ZStandard(), Rot()])


def _dcp_view(path, reader):
    """The state DCP rebuilds from a checkpoint's own metadata (no template): what
    ``dcp_to_torch_save`` and ``_load_state_dict_from_keys`` hand users."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    return _load_state_dict_from_keys(storage_reader=reader(path))


def test_untemplated_load_matches_dcp_filesystem_reader_lists_tuples_nesting(tmp_path):
    """Lists (of tensors and values, nested), tuples and dicts come back exactly as DCP's own
    FileSystemReader gives the same state saved by FileSystemWriter."""
    import torch.distributed.checkpoint as dcp
    from shardpoint.dcp import ShardpointReader, ShardpointWriter

    state = {
        "a": [torch.ones(2), 3, "x"],
        "b": [1, 2],
        "e": (1, 2.5),
        "c": {"d": [torch.zeros(1), [torch.full((2,), 7)]], "n": None},
    }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "fs")), no_dist=True)
    dcp.save(state, storage_writer=ShardpointWriter(tmp_path / "sp"), no_dist=True)
    theirs = _dcp_view(str(tmp_path / "fs"), dcp.FileSystemReader)
    ours = _dcp_view(tmp_path / "sp", ShardpointReader)
    assert repr(ours) == repr(theirs) and type(ours["e"]) is tuple
    assert list(ShardpointReader(tmp_path / "sp").read_metadata().state_dict_metadata) == list(
        dcp.FileSystemReader(str(tmp_path / "fs")).read_metadata().state_dict_metadata
    )


def test_sharded_objects_from_sp_save_read_through_dcp_as_their_grid(tmp_path):
    """A sharded object (per-rank values, e.g. RNG states; Megatron's common objects) written
    by ``sp.save`` is one DCP entry holding its grid as nested lists, as ``sp.load`` gives it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    import shardpoint as sp
    from shardpoint.dcp import ShardpointReader

    p = str(tmp_path / "c")
    sp.save(
        {
            "w": torch.ones(2),
            "rng": sp.ShardedObject({"seed": 5}, 0, 1),
            "grid": sp.ShardedObject(b"\x01", (0, 0), (1, 1)),
        },
        p,
    )
    view = _dcp_view(p, ShardpointReader)
    assert view["rng"] == [{"seed": 5}] and view["grid"] == [[b"\x01"]]
    assert view["rng"] == sp.load(p)["rng"]
    like = {"rng": None, "w": torch.zeros(2)}
    dcp.load(like, storage_reader=ShardpointReader(p), no_dist=True)
    assert like["rng"] == [{"seed": 5}] and torch.equal(like["w"], torch.ones(2))
    # DCP's own converter (through our reader) to a torch.save file
    import torch.distributed.checkpoint.format_utils as fu

    old = fu.FileSystemReader
    fu.FileSystemReader = ShardpointReader  # dcp_to_torch_save names its reader class
    try:
        dcp_to_torch_save(p, str(tmp_path / "out.pt"))
    finally:
        fu.FileSystemReader = old
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out["grid"] == [[b"\x01"]] and torch.equal(out["w"], torch.ones(2))


def test_writing_over_a_directory_of_other_files_is_refused_and_keeps_them(tmp_path):
    """DCP's FileSystemWriter writes beside whatever a directory holds (its suite saves into the
    folder holding a torch.save file); shardpoint never deletes what it did not create, so the
    save is refused with CheckpointExistsError naming the path, and the file stays."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from shardpoint.dcp import ShardpointWriter

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "model.pt").write_bytes(b"theirs")
    with pytest.raises(CheckpointException, match="CheckpointExistsError.*SP-COMMIT-5"):
        dcp.save(
            {"w": torch.ones(2)}, storage_writer=ShardpointWriter(tmp_path / "c"), no_dist=True
        )
    assert (tmp_path / "c" / "model.pt").read_bytes() == b"theirs"
    dcp.save(
        {"w": torch.ones(2)}, storage_writer=ShardpointWriter(tmp_path / "empty"), no_dist=True
    )  # an empty directory is fine (DCP's suite uses mkdtemp())


def test_checkpoint_id_detection_accepts_paths_and_registered_stores_only(tmp_path):
    """DCP picks a storage class for a bare ``checkpoint_id`` by asking each one; ours say yes
    to local paths and to registered store URLs, no to a scheme nobody registered (DCP's own
    suite expects "Cannot detect" for ``abc://abc.abc``)."""
    from pathlib import Path
    from shardpoint.dcp import ShardpointReader, ShardpointWriter

    for cls in (ShardpointReader, ShardpointWriter):
        assert cls.validate_checkpoint_id(str(tmp_path / "c"))
        assert cls.validate_checkpoint_id(Path(tmp_path / "c"))
        assert cls.validate_checkpoint_id("file://" + str(tmp_path / "c"))
        assert cls.validate_checkpoint_id("s3://bucket/run/step_1")
        assert not cls.validate_checkpoint_id("abc://abc.abc")
        assert not cls.validate_checkpoint_id(7)


def test_load_into_another_dtype_casts_as_dcp_does(tmp_path):
    """DCP's FileSystemReader copies stored values into the target, casting (a float32
    checkpoint into a bfloat16 model); the shardpoint reader does the same through DCP."""
    import torch.distributed.checkpoint as dcp
    from shardpoint.dcp import ShardpointReader, ShardpointWriter

    w = torch.randn(4, 3)
    dcp.save(
        {"w": w, "i": torch.arange(5, dtype=torch.int32)},
        storage_writer=ShardpointWriter(tmp_path / "c"),
        no_dist=True,
    )
    like = {"w": torch.zeros(4, 3, dtype=torch.bfloat16), "i": torch.zeros(5, dtype=torch.int64)}
    dcp.load(like, storage_reader=ShardpointReader(tmp_path / "c"), no_dist=True)
    assert like["w"].dtype == torch.bfloat16 and torch.equal(like["w"], w.to(torch.bfloat16))
    assert like["i"].dtype == torch.int64 and torch.equal(like["i"], torch.arange(5))


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_an_overwrite_that_is_not_one_of_the_three_values_is_refused_at_once(tmp_path, bad):
    """The writer takes the committers' one overwrite type (False, True, "any"): anything
    else is refused when the writer is made, never read as a truth value at commit."""
    from shardpoint.dcp import ShardpointWriter
    from shardpoint_core.format.errors import InvalidOptionError

    with pytest.raises(InvalidOptionError, match="overwrite="):
        ShardpointWriter(str(tmp_path / "ck"), overwrite=bad)
