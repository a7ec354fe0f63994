"""``shardpoint convert`` into s3:// against a real S3 server (moto, on loopback): the output is
published by the object-store commit like ``sp.save`` (format.md 9.1), bit for bit, and the
overwrite rules hold: only a committed checkpoint is replaced (with consent), objects that are
not a checkpoint of ours never ([SP-COMMIT-13]), and the source never."""

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")
torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

import shardpoint as sp  # noqa: E402
from shardpoint.tools.convert import convert  # noqa: E402
from shardpoint_core.stores.s3 import S3Store  # noqa: E402
from shardpoint_core.verify import verify_checkpoint  # noqa: E402
from shardpoint_testing.tensors import same_bits  # noqa: E402


def tensors(gen):
    g = torch.Generator().manual_seed(gen)
    return {
        "w": torch.randn(33, 7, generator=g),
        "b": torch.randn(5, generator=g).half(),
        "i": torch.arange(12, dtype=torch.int64).reshape(3, 4) + gen,
    }


def saved_file(tmp_path, gen):
    path = tmp_path / f"m{gen}.safetensors"
    safetensors_torch.save_file(tensors(gen), str(path))
    return str(path)


def save_prefixes(url):
    return {o.key.split("/")[0] for o in S3Store.from_url(url).list() if o.key.startswith("save-")}


def test_convert_into_s3_commits_like_a_save(s3_env, tmp_path):
    dst = s3_env.url(s3_env.fresh_prefix("conv") + "/ck")
    rep = convert(saved_file(tmp_path, 0), dst, max_chunk_bytes=256)  # many chunks
    assert rep.dst_format == "shardpoint" and rep.dst == dst
    out = sp.load(dst)
    assert all(same_bits(out[k], v) for k, v in tensors(0).items())
    assert verify_checkpoint(dst).ok
    assert len(save_prefixes(dst)) == 1  # [SP-COMMIT-11]
    # shardpoint -> shardpoint from S3 to S3 (a copy into another prefix)
    copy = s3_env.url(s3_env.fresh_prefix("conv") + "/copy")
    convert(dst, copy, to="shardpoint")
    assert all(same_bits(sp.load(copy)[k], v) for k, v in tensors(0).items())


def test_overwrite_rules_on_s3(s3_env, tmp_path):
    root = s3_env.url(s3_env.fresh_prefix("conv"))
    dst = f"{root}/ck"
    convert(saved_file(tmp_path, 0), dst)
    first = save_prefixes(dst)
    with pytest.raises(sp.CheckpointExistsError, match="overwrite"):
        convert(saved_file(tmp_path, 1), dst)
    convert(saved_file(tmp_path, 1), dst, overwrite=True)  # a committed one: replaced
    assert all(same_bits(sp.load(dst)[k], v) for k, v in tensors(1).items())
    assert save_prefixes(dst).isdisjoint(first) and len(save_prefixes(dst)) == 1
    # the source is never replaced: not as the target, nor inside it
    with pytest.raises(sp.ShardpointError, match="same path"):
        convert(dst, dst, to="shardpoint", overwrite="any")
    with pytest.raises(sp.CheckpointExistsError, match="input of this command"):
        convert(dst, root, to="shardpoint", overwrite="any")
    # objects that are not a checkpoint of ours: refused even with overwrite="any", kept
    other = f"{root}/notours"
    S3Store.from_url(other).put("data.bin", b"someone else's")
    with pytest.raises(sp.CheckpointExistsError, match="SP-COMMIT-13"):
        convert(saved_file(tmp_path, 0), other, overwrite="any")
    assert [o.key for o in S3Store.from_url(other).list()] == ["data.bin"]
    assert all(same_bits(sp.load(dst)[k], v) for k, v in tensors(1).items())
    # other formats are not written to an object store (nor into a local folder 's3:')
    with pytest.raises(sp.errors.ConversionError, match="shardpoint output only"):
        convert(dst, f"{root}/x.safetensors", to="safetensors")


def test_a_failed_conversion_leaves_nothing_at_the_target(s3_env, tmp_path):
    """A source that fails mid-way (a truncated file) commits nothing; its prefix is gone."""
    src = saved_file(tmp_path, 0)
    data = open(src, "rb").read()
    open(src, "wb").write(data[:-40])
    dst = s3_env.url(s3_env.fresh_prefix("conv") + "/ck")
    with pytest.raises(sp.ShardpointError):
        convert(src, dst)
    assert list(S3Store.from_url(dst).list()) == []


@pytest.mark.slow  # two spawned worker processes (~20 s on the shared 2-core machine)
def test_parallel_convert_into_s3(s3_env, tmp_path):
    dst = s3_env.url(s3_env.fresh_prefix("conv") + "/par")
    convert(saved_file(tmp_path, 2), dst, procs=2, max_chunk_bytes=256)
    assert all(same_bits(sp.load(dst)[k], v) for k, v in tensors(2).items())
    assert verify_checkpoint(dst).ok and len(save_prefixes(dst)) == 1
