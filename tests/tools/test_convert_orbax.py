"""Real Orbax checkpoints (orbax-checkpoint's own StandardCheckpointer, PyTreeCheckpointer and
CheckpointManager, arrays sharded over several CPU devices and saved by several JAX
processes) converted with ``shardpoint convert``, then read back with ``shardpoint.load``
(torch) and ``shardpoint_jax.load``, bit for bit against the arrays Orbax saved."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

ocp = pytest.importorskip(
    "orbax.checkpoint", reason="needs orbax-checkpoint (pip install -e '.[jax-test]')"
)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

optax = pytest.importorskip("optax", reason="the Flax/optax-shaped tree needs optax")

import shardpoint as sp  # noqa: E402
import shardpoint_jax as spj  # noqa: E402
from shardpoint.tools.cli import main as cli  # noqa: E402
from shardpoint.tools.convert import convert, detect_format, write  # noqa: E402
from shardpoint.tools.convert.orbax import OrbaxSource  # noqa: E402
from shardpoint.tree.dtypes import torch_to_numpy  # noqa: E402
from shardpoint_jax.launch import run_processes  # noqa: E402
from shardpoint_testing.tensors import same_bits  # noqa: E402
from google.protobuf import struct_pb2  # noqa: E402  (orbax-checkpoint requires protobuf)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def flax_optax_state():
    """A Flax-linen-shaped params tree in mixed dtypes, a real optax Adam state over it, and
    plain leaves (the step, the learning rate)."""
    rng = np.random.default_rng(0)
    params = {
        "params": {
            "Dense_0": {
                "kernel": jnp.asarray(rng.standard_normal((16, 8)), jnp.bfloat16),
                "bias": jnp.asarray(rng.standard_normal(8), jnp.float32),
            },
            "Embed_0": {"embedding": jnp.asarray(rng.standard_normal((32, 4)), jnp.float16)},
        }
    }
    opt = optax.adam(1e-3).init(params)
    state = {
        "params": params,
        "opt_state": opt,
        "step": 1000,
        "lr": 3e-4,
        "fp8": {
            "e4m3": jnp.asarray(rng.standard_normal(24).astype(ml_dtypes.float8_e4m3fn)),
            "e5m2": jnp.asarray(rng.standard_normal(24).astype(ml_dtypes.float8_e5m2)),
        },
        "ints": {
            "i8": jnp.arange(-5, 5, dtype=jnp.int8),
            "u32": jnp.arange(7, dtype=jnp.uint32),
            "i64": np.arange(2**40, 2**40 + 6, dtype=np.int64),
        },  # numpy: no x64
        "mask": jnp.asarray([True, False, True]),
        "scale": jnp.asarray(0.5, jnp.float32),  # a 0-d array
    }
    return state


def expected_leaves(tree) -> dict:
    """{shardpoint key path: numpy array} of the array leaves of a JAX tree."""
    out = {}
    for kp, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if isinstance(leaf, (jax.Array, np.ndarray)):
            path = tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in kp)
            out[path] = np.asarray(leaf)
    return out


def at(tree, path):
    """The leaf at ``path`` of nested dicts, lists and namedtuples (by field name)."""
    for c in path:
        tree = getattr(tree, c) if isinstance(c, str) and isinstance(tree, tuple) else tree[c]
    return tree


def cli_run(capsys, *argv):
    rc = cli(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_standard_checkpoint_of_flax_and_optax_state_converts_bit_for_bit(tmp_path, capsys):
    state = flax_optax_state()
    src = str(tmp_path / "orbax")
    ck = ocp.StandardCheckpointer()
    ck.save(src, state)
    ck.wait_until_finished()
    assert detect_format(src) == "orbax"

    rc, out, err = cli_run(capsys, "convert", src, str(tmp_path / "ck"), "--json")
    assert rc == 0, err
    rep = json.loads(out)
    want = expected_leaves(state)
    assert rep["src_format"] == "orbax" and rep["skipped"] == [] and rep["tensors"] == len(want)

    got = sp.load(str(tmp_path / "ck"))
    for path, a in want.items():
        assert same_bits(at(got, path), a), path
    assert got["step"] == 1000 and got["lr"] == 3e-4  # Python scalars: values
    rc, out, err = cli_run(capsys, "diff", src, str(tmp_path / "ck"))  # Orbax read directly
    assert rc == 0, out + err
    assert at(got, ("opt_state", 1)) is None  # optax EmptyState

    # shardpoint_jax reads the same bits: jax.Arrays where JAX holds the dtype exactly,
    # numpy buffers filled in place for the 64-bit ones. Orbax records a namedtuple (optax's
    # ScaleByAdamState) as a dict of its fields, so the converted tree has dicts there.
    def abstract(t):
        if not isinstance(t, torch.Tensor):
            return t
        a = torch_to_numpy(t)
        return np.zeros_like(a) if a.dtype.itemsize == 8 else jax.ShapeDtypeStruct(a.shape, a.dtype)

    back = spj.load(str(tmp_path / "ck"), jax.tree_util.tree_map(abstract, got))
    assert back["step"] == 1000 and isinstance(
        back["params"]["params"]["Dense_0"]["kernel"], jax.Array
    )
    for path, a in want.items():
        b = np.asarray(at(back, path))
        assert b.dtype == a.dtype and b.tobytes() == a.tobytes(), path


def test_pytree_checkpointer_strings_none_and_unsupported_dtypes_are_reported(tmp_path, capsys):
    tree = {
        "w": jnp.arange(6.0).reshape(2, 3),
        "name": "llama-tiny",
        "flag": True,
        "none": None,
        "empty": {},
        "cfg": {"layers": 2, "eps": 1e-6},
        "packed": jnp.arange(8, dtype=jnp.int4),
    }
    src = str(tmp_path / "pytree")
    ocp.PyTreeCheckpointer().save(src, tree)
    rep = convert(src, str(tmp_path / "ck"))
    assert [k for k, _ in rep.skipped] == ["packed"], rep.skipped
    assert "int4" in rep.skipped[0][1]  # named, not dropped silently
    got = sp.load(str(tmp_path / "ck"))
    assert got["name"] == "llama-tiny" and got["flag"] is True and got["none"] is None
    assert got["cfg"] == {"layers": 2, "eps": 1e-6} and got["empty"] == {}
    assert same_bits(got["w"], np.arange(6.0, dtype=np.float32).reshape(2, 3))
    assert "packed" not in got
    # a checkpoint of one array (no tree): under the key "array" (shardpoint's root is a dict)
    ocp.PyTreeCheckpointer().save(str(tmp_path / "one"), jnp.arange(3, dtype=jnp.int16))
    convert(str(tmp_path / "one"), str(tmp_path / "ck1"))
    assert same_bits(sp.load(str(tmp_path / "ck1"))["array"], np.arange(3, dtype=np.int16))
    # a target that holds no values says so for each of them, as for every other source
    rep = convert(src, str(tmp_path / "m.safetensors"))
    assert {"name", "flag", "none", "cfg/eps", "packed"} <= {k for k, _ in rep.skipped}, rep.skipped

    # inspect / load / verify given the Orbax directory name the convert command
    for cmd in ("inspect", "verify"):
        rc, out, err = cli_run(capsys, cmd, src)
        assert (
            rc == 2
            and f"an Orbax checkpoint: convert it with `shardpoint convert {src} DST`" in out + err
        ), (out, err)
    with pytest.raises(sp.CheckpointNotFoundError, match=re.escape(f"convert {src} DST")):
        sp.load(src)
    with pytest.raises(spj.IncompleteCheckpointError, match="shardpoint convert"):
        spj.load(src)


def test_checkpoint_manager_steps_items_and_root(tmp_path, capsys):
    params = {"w": jnp.arange(12, dtype=jnp.bfloat16).reshape(3, 4)}
    root = str(tmp_path / "run")
    cfg = struct_pb2.Struct()
    cfg.update({"layers": 2})
    with ocp.CheckpointManager(root, item_names=("state", "metrics", "cfg")) as mgr:
        for step in (1, 2):
            mgr.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave({"params": params, "step": step}),
                    metrics=ocp.args.JsonSave({"loss": 0.25 * step}),
                    cfg=ocp.args.ProtoSave(cfg),
                ),
            )
        mgr.wait_until_finished()
    step2 = os.path.join(root, "2")
    # the manager's root: detected, and the error names the newest step to convert
    with pytest.raises(sp.ConversionError, match=re.escape(f"shardpoint convert {step2} DST")):
        convert(root, str(tmp_path / "x"))
    with pytest.raises(sp.CheckpointNotFoundError, match=re.escape(f"convert {step2} DST")):
        sp.load(root)
    with pytest.raises(spj.IncompleteCheckpointError, match=re.escape(f"convert {step2} DST")):
        spj.load(root)
    rc, out, err = cli_run(capsys, "convert", step2, str(tmp_path / "ck"), "--from", "orbax")
    assert rc == 0, err
    assert "cfg: Orbax item 'cfg' was saved by" in out and "ProtoCheckpointHandler" in out, out
    got = sp.load(str(tmp_path / "ck"))
    assert got["metrics"] == {"loss": 0.5} and got["state"]["step"] == 2 and "cfg" not in got
    assert same_bits(got["state"]["params"]["w"], np.asarray(params["w"]))

    # one unnamed item (default/): its tree at the root, as Orbax restores it
    with ocp.CheckpointManager(str(tmp_path / "one")) as mgr:
        mgr.save(7, args=ocp.args.StandardSave({"params": params}))
        mgr.wait_until_finished()
    rep = convert(str(tmp_path / "one" / "7"), str(tmp_path / "ck1"))
    assert rep.skipped == [] and list(sp.load(str(tmp_path / "ck1"))) == ["params"]


class CountingSource(OrbaxSource):
    """The real source, recording each band of rows it reads from storage."""

    def read_band(self, t, lo, hi):
        self.__dict__.setdefault("bands", []).append((t.key, lo, hi))
        return super().read_band(t, lo, hi)


@pytest.mark.parametrize("zarr3", [False, True])
def test_big_array_is_read_in_bands_of_chunk_rows_and_arrives_whole(tmp_path, zarr3):
    """Orbax's chunks of 64 KiB (Zarr v2: 64 x 256 rows; Zarr v3: 128 x 128 inner chunks of
    one shard), converted into 128 KiB chunks: the source reads 128 rows at a time."""
    big = np.random.default_rng(1).standard_normal((1024, 256)).astype(np.float32)  # 1 MiB
    src = str(tmp_path / "orbax")
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=zarr3)).save(
        src,
        {"big": jnp.asarray(big), "small": jnp.ones(3)},
        save_args={"big": ocp.SaveArgs(chunk_byte_size=64 << 10), "small": ocp.SaveArgs()},
    )
    with CountingSource(src) as s:
        write(s, str(tmp_path / "ck"), "shardpoint", max_chunk_bytes=128 << 10)
        bands = [b for b in s.bands if b[0] == "big"]
    rows = (128 << 10) // (256 * 4)  # a 128 KiB target chunk: 128 rows
    assert len(bands) == 1024 // rows and all(hi - lo <= rows for _, lo, hi in bands), bands
    assert [lo for _, lo, _ in bands] == list(range(0, 1024, rows))
    got = sp.load(str(tmp_path / "ck"))["big"]
    assert same_bits(got, big)


def test_damaged_orbax_checkpoint_is_a_conversion_error_naming_the_array(tmp_path):
    tree = {"layer": {"w": jnp.arange(64.0).reshape(8, 8)}, "b": jnp.ones(4)}
    plain = str(tmp_path / "plain")  # one Zarr array per directory
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)).save(plain, tree)
    os.remove(os.path.join(plain, "layer.w", "0.0"))
    with pytest.raises(sp.ConversionError, match=r"'layer/w'.*damaged") as e:
        convert(plain, str(tmp_path / "out"))
    assert "Traceback" not in str(e.value) and e.value.__cause__ is None
    assert not os.path.exists(tmp_path / "out")

    ocdbt = str(tmp_path / "ocdbt")  # OCDBT: the data file of 'layer/w' cut short
    w = np.random.default_rng(0).standard_normal((128, 128)).astype(np.float32)
    ocp.PyTreeCheckpointer().save(ocdbt, {"layer": {"w": jnp.asarray(w)}, "b": jnp.ones(4)})
    data = max((os.path.join(d, f) for d, _, fs in os.walk(ocdbt) for f in fs), key=os.path.getsize)
    assert os.path.basename(os.path.dirname(data)) == "d" and os.path.getsize(data) > w.nbytes / 2
    os.truncate(data, 1000)
    with pytest.raises(sp.ConversionError, match=r"Orbax array 'layer/w'.*damaged"):
        convert(ocdbt, str(tmp_path / "out2"))
    unfinished = str(tmp_path / "ocdbt.orbax-checkpoint-tmp-1234")  # a save cut short
    os.rename(ocdbt, unfinished)
    with pytest.raises(sp.ConversionError, match="did not finish"):
        convert(unfinished, str(tmp_path / "out4"))
    with open(os.path.join(plain, "_METADATA"), "w") as f:
        f.write("{not json")
    with pytest.raises(sp.ConversionError, match="Orbax cannot read .*_METADATA"):
        convert(plain, str(tmp_path / "out3"))


SHARDED = """
import json, numpy as np, jax, jax.numpy as jnp, orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 7
e = (np.arange(16 * 8) % 251).astype(np.int32).reshape(16, 8)
tree = {"w": jax.device_put(jnp.asarray(w, jnp.bfloat16), NamedSharding(mesh, P("x", "y"))),
        "e": jax.make_array_from_callback(e.shape, NamedSharding(mesh, P("y")), lambda i: e[i]),
        "r": jax.device_put(jnp.arange(5, dtype=jnp.float32), NamedSharding(mesh, P()))}
ck = ocp.StandardCheckpointer()
ck.save(PATH, tree)
ck.wait_until_finished()
print(json.dumps({"procs": jax.process_count(), "devices": jax.device_count()}))
"""


def expected_sharded():
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 7
    return {
        "w": np.asarray(jnp.asarray(w, jnp.bfloat16)),
        "e": (np.arange(16 * 8) % 251).astype(np.int32).reshape(16, 8),
        "r": np.arange(5.0, dtype=np.float32),
    }


def check_sharded(src, dst, **kw):
    rep = convert(src, dst, **kw)
    assert rep.skipped == [] and rep.tensors == 3
    got = sp.load(dst)
    for k, a in expected_sharded().items():
        assert same_bits(got[k], a), k


def test_arrays_sharded_over_four_cpu_devices(tmp_path):
    src = str(tmp_path / "orbax")
    out = run_processes(SHARDED.replace("PATH", repr(src)), 1, 4, timeout=120)
    assert json.loads(out[0].strip().splitlines()[-1]) == {"procs": 1, "devices": 4}
    check_sharded(src, str(tmp_path / "ck"))


@pytest.mark.slow  # two JAX processes, then two conversion workers: 7 s idle, 25 s loaded
def test_checkpoint_saved_by_two_jax_processes_converts_with_two_workers(tmp_path):
    src = str(tmp_path / "orbax")
    out = run_processes(SHARDED.replace("PATH", repr(src)), 2, 2, timeout=240)
    assert json.loads(out[0].strip().splitlines()[-1]) == {"procs": 2, "devices": 4}
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(os.listdir(src))
    check_sharded(src, str(tmp_path / "ck"), procs=2, max_chunk_bytes=1 << 10)


def test_importing_shardpoint_and_detecting_orbax_does_not_import_jax(tmp_path):
    src = str(tmp_path / "orbax")
    ocp.PyTreeCheckpointer().save(src, {"w": jnp.ones(2)})
    code = (
        "import sys, shardpoint, shardpoint.tools.cli, shardpoint.tools.convert as c\n"
        f"assert c.detect_format({src!r}) == 'orbax'\n"
        "assert c.foreign_format_hint(%r)\n"
        % src
        + "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'orbax', 'flax')]\n"
        "assert not bad, bad\n"
    )
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            os.path.join(ROOT, d) for d in ("core", "reference", "testing", "conformance")
        ),
    )
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]


def test_readme_orbax_example_runs(tmp_path, monkeypatch):
    # the docs' Orbax example (docs/how-to/convert.md), run here on a real Orbax checkpoint
    page = open(os.path.join(ROOT, "docs", "how-to", "convert.md")).read()
    block = next(
        b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "orbax_ckpts/1000" in b
    )
    params = {"Dense_0": {"kernel": jnp.arange(8.0, dtype=jnp.bfloat16).reshape(2, 4)}}
    with ocp.CheckpointManager(str(tmp_path / "orbax_ckpts")) as mgr:
        mgr.save(1000, args=ocp.args.StandardSave({"params": params, "step": 1000}))
        mgr.wait_until_finished()
    monkeypatch.chdir(tmp_path)
    scope = {
        "abstract_params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    }
    exec(compile(block, "convert.md", "exec"), scope)
    assert scope["state"]["step"] == 1000
    k = scope["params"]["Dense_0"]["kernel"]
    assert isinstance(k, jax.Array) and k.dtype == jnp.bfloat16
    assert np.asarray(k).tobytes() == np.asarray(params["Dense_0"]["kernel"]).tobytes()
