"""Hostile checkpoints: no input crashes a reader, exhausts its memory or gets past it with
an error outside the documented classes (issue 21: crashes and memory bombs)."""

import os

import msgpack
import pytest
import torch

import shardpoint as sp
from shardpoint_conformance import hostile
from shardpoint_core.format.manifest import decode_manifest
from shardpoint_core.verify import verify_checkpoint
from shardpoint_testing.launch import run_code

# Every reader a user has: the API, the metadata reader, verify, and the CLI's inspect/verify.
# Prints one line per reader: the error class and spec ID (or 'ok'); a crash shows as rc < 0.
READERS = r"""
import sys
import shardpoint as sp
from shardpoint.tools.cli import main as cli
from shardpoint_core.verify import verify_checkpoint
p = sys.argv[1]
for name, fn in (("load", lambda: sp.load(p)), ("read_metadata", lambda: sp.read_metadata(p))):
    try:
        fn()
        print(name, "ok")
    except sp.ShardpointError as e:
        print(name, type(e).__name__, e.spec_id, str(e)[:200].replace("\n", " "))
rep = verify_checkpoint(p)
print("verify", rep.spec_ids)
print("cli-verify", cli(["verify", p]))
print("cli-inspect", cli(["inspect", p]))
"""


def run_readers(path):
    """The readers in another process (forked from the launcher's preloaded fork server): a
    crash there shows as rc < 0 and cannot take this process down."""
    r = run_code(READERS, path, timeout=120)
    assert r.returncode == 0, f"a reader crashed (rc {r.returncode}): {r.stderr[-2000:]}"
    return dict(line.split(" ", 1) for line in r.stdout.splitlines())


def test_tuples_nested_300_deep_are_an_error_not_a_segfault(tmp_ckpt):
    sp.save({"w": torch.ones(3)}, tmp_ckpt)
    hostile.add_deep_value(tmp_ckpt, 300)
    assert os.path.getsize(f"{tmp_ckpt}/manifest.msgpack") < 4096
    out = run_readers(tmp_ckpt)
    assert out["load"].startswith("CorruptCheckpointError SP-MAN-5"), out
    assert out["read_metadata"].startswith("CorruptCheckpointError SP-MAN-5"), out
    assert out["verify"] == "['SP-MAN-5']"
    assert out["cli-verify"] == "1" and out["cli-inspect"] == "1"


@pytest.mark.parametrize("depth,ok", [(150, True), (256, True), (257, False), (5000, False)])
def test_tuple_depth_limit_is_exact_and_iterative(tmp_ckpt, depth, ok):
    # The body is level 1, the ignorable field 2, its outer tuple 3: tuples nested
    # depth - 2 deep reach level ``depth``. Decoded in this process: a regression that
    # recursed in C would crash the run, not fail it.
    sp.save({"w": torch.ones(3)}, tmp_ckpt)
    hostile.add_deep_field(tmp_ckpt, depth - 2)
    if ok:
        assert sp.read_metadata(tmp_ckpt) is not None
        assert torch.equal(sp.load(tmp_ckpt)["w"], torch.ones(3))
    else:
        with pytest.raises(sp.CorruptCheckpointError) as e:
            sp.load(tmp_ckpt)
        assert e.value.spec_id == "SP-MAN-5"


def test_deep_manifest_body_gives_a_reason(tmp_ckpt):
    sp.save({"w": torch.ones(3)}, tmp_ckpt)
    hostile.add_deep_field(tmp_ckpt, 3000, tuples=False)  # past msgpack's own stack (1024)
    with pytest.raises(sp.CorruptCheckpointError) as e:
        sp.read_metadata(tmp_ckpt)
    assert e.value.spec_id == "SP-MAN-5" and "deeper" in str(e.value)


def test_deep_envelope_gives_a_reason():
    data = b"\x91" * 3000 + b"\xc0"
    with pytest.raises(sp.CorruptCheckpointError) as e:
        decode_manifest(data)
    assert e.value.spec_id == "SP-MAN-1" and "StackError" in str(e.value)


def test_deep_zarr_json_is_refused_by_rule(tmp_ckpt):
    # zarr.json is the per-array layout's (a packed checkpoint has none, [SP-PACK-1])
    sp.save({"w": torch.ones(3)}, tmp_ckpt, backend=sp.ZarrBackend())
    hostile.deep_zarr_json(tmp_ckpt, "tensors/w", 100_000)
    with pytest.raises(sp.CorruptCheckpointError) as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-ARRAY-6" and "'w'" in str(e.value)
    assert verify_checkpoint(tmp_ckpt).spec_ids == ["SP-ARRAY-6"]


def test_zarr_json_repeating_a_name_is_refused(tmp_ckpt):
    sp.save({"w": torch.ones(3)}, tmp_ckpt, backend=sp.ZarrBackend())
    p = f"{tmp_ckpt}/tensors/w/zarr.json"
    text = open(p).read()
    open(p, "w").write(text[:-1] + ',"zarr_format":3}')
    with pytest.raises(sp.CorruptCheckpointError) as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-ARRAY-6" and "zarr_format" in str(e.value)


def test_memory_bomb_is_refused_before_allocating(tmp_ckpt):
    os.makedirs(tmp_ckpt)
    declared = hostile.memory_bomb(tmp_ckpt)
    assert declared == 4 << 30
    on_disk = sum(
        os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(tmp_ckpt) for f in fs
    )
    assert on_disk < 3 << 20
    with pytest.raises(sp.CorruptCheckpointError) as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-READ-6" and "'w'" in str(e.value)
    assert verify_checkpoint(tmp_ckpt).spec_ids == ["SP-READ-6"]


def test_aliasing_shard_index_is_refused_even_when_sizes_add_up(tmp_ckpt):
    # 16 entries all pointing at one inner chunk, the file padded so the total size backs the
    # declared bytes: only the index rule can tell.
    os.makedirs(tmp_ckpt)
    declared = hostile.memory_bomb(tmp_ckpt, entries=16, inner_elems=1024)
    f = f"{tmp_ckpt}/tensors/w/c/0"
    raw = open(f, "rb").read()
    isz = 16 * 16 + 4
    pad = bytes(declared)
    open(f, "wb").write(raw[:-isz] + pad + raw[-isz:])
    with pytest.raises(sp.CorruptCheckpointError) as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-READ-7" and "alias" in str(e.value)
    assert verify_checkpoint(tmp_ckpt).spec_ids == ["SP-READ-7"]


def test_index_offset_past_2_63_is_a_documented_error(tmp_ckpt):
    os.makedirs(tmp_ckpt)
    hostile.memory_bomb(tmp_ckpt, entries=4, inner_elems=256, alias=False)
    assert torch.equal(sp.load(tmp_ckpt)["w"], torch.zeros(1024))  # sound as built
    assert verify_checkpoint(tmp_ckpt).ok
    f = f"{tmp_ckpt}/tensors/w/c/0"
    raw = bytearray(open(f, "rb").read())
    isz = 16 * 4
    index = bytearray(raw[-isz - 4 : -4])
    index[8 * 2 * 3 : 8 * 2 * 3 + 8] = (1 << 63).to_bytes(8, "little")
    import crc32c

    raw[-isz - 4 :] = bytes(index) + crc32c.crc32c(bytes(index)).to_bytes(4, "little")
    open(f, "wb").write(bytes(raw))
    with pytest.raises(sp.CorruptCheckpointError) as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-READ-3" and "reaches past" in str(e.value)
    assert verify_checkpoint(tmp_ckpt).spec_ids == ["SP-READ-3"]


@pytest.mark.skipif(
    not hostile.supports_memory_cgroup(),
    reason="needs a writable memory cgroup (root, cgroup v1 or v2)",
)
def test_memory_bomb_in_a_1_gib_cgroup(tmp_ckpt):
    """The issue's case for real: before the fix both sp.load and verify were OOM-killed."""
    os.makedirs(tmp_ckpt)
    hostile.memory_bomb(tmp_ckpt)
    code = (
        "import shardpoint as sp\n"
        "from shardpoint_core.verify import verify_checkpoint\n"
        f"p = {tmp_ckpt!r}\n"
        "try:\n    sp.load(p); print('load ok')\n"
        "except sp.ShardpointError as e:\n    print('load', e.spec_id)\n"
        "print('verify', verify_checkpoint(p).spec_ids)\n"
    )
    r = hostile.run_bounded(code, memory_bytes=1 << 30, timeout=120, forked=True)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.split("\n")[:2] == ["load SP-READ-6", "verify ['SP-READ-6']"]


# ------------------------------------------------------------------ targets that alias
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(3).expand(2, 3),
        lambda: torch.zeros(6).as_strided((2, 3), (1, 1)),
        lambda: torch.from_numpy(
            __import__("numpy").lib.stride_tricks.as_strided(
                __import__("numpy").zeros(3, "float32"), (2, 3), (0, 4)
            )
        ),
    ],
    ids=["expand", "as_strided", "numpy-stride-0"],
)
def test_target_whose_elements_share_memory_is_refused(tmp_ckpt, make):
    sp.save({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, tmp_ckpt)
    with pytest.raises(sp.LayoutMismatchError) as e:
        sp.load(tmp_ckpt, like={"w": make()})
    assert "'w'" in str(e.value) and "share memory" in str(e.value)


def test_transposed_and_strided_targets_still_fill(tmp_ckpt):
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    sp.save({"w": w, "v": w[:, ::2].contiguous()}, tmp_ckpt)
    t = torch.empty(4, 3).t()
    big = torch.zeros(3, 4)
    out = sp.load(tmp_ckpt, like={"w": t, "v": big[:, ::2]})
    assert torch.equal(t, w) and torch.equal(big[:, ::2], w[:, ::2])
    assert out["w"] is t


@pytest.mark.parametrize("body", [1.5, True, None, "x", 7])
def test_a_manifest_body_that_is_a_scalar_is_refused_by_rule(body):
    """Found by the fuzzer: a sealed body of one float raised TypeError from the depth check."""
    import hashlib

    raw = msgpack.packb(body)
    data = msgpack.packb({"sha256": hashlib.sha256(raw).digest(), "body": raw})
    with pytest.raises(sp.CorruptCheckpointError) as e:
        decode_manifest(data)
    assert e.value.spec_id == "SP-MAN-2"


def test_the_jax_reader_survives_300_nested_tuples_too(tmp_ckpt):
    """shardpoint_jax decodes manifests with its own hook: it segfaulted the same way (in
    this process: a regression crashes the run, loudly)."""
    spj = pytest.importorskip("shardpoint_jax")
    sp.save({"w": torch.ones(3)}, tmp_ckpt)
    hostile.add_deep_value(tmp_ckpt, 300)
    with pytest.raises(spj.ShardpointError) as e:
        spj.load(tmp_ckpt)
    assert type(e.value).__name__ == "CorruptCheckpointError" and e.value.spec_id == "SP-MAN-5"
