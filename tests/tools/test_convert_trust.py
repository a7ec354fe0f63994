"""``convert`` never unpickles a DCP or Megatron ``.metadata`` unless asked to
(``--trust-pickle`` / ``trust_pickle=True``), as ``diff`` does: the same error class and
message, and nothing read or written before the refusal."""

import json
import pickle

import pytest
import torch

import shardpoint as sp
from shardpoint.tools.cli import main as cli
from shardpoint.tools.convert import convert


class Boom:
    """Unpickling it creates the file ``marker`` (it would run any code just as well)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def hostile(tmp_path, kind):
    """A directory that is detected as a ``kind`` checkpoint, whose .metadata writes a marker
    file when unpickled; returns (directory, marker)."""
    src, marker = tmp_path / kind, tmp_path / f"pwned-{kind}"
    src.mkdir()
    (src / ".metadata").write_bytes(pickle.dumps(Boom(marker)))
    if kind == "megatron":
        (src / "metadata.json").write_text(
            json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1})
        )
    return src, marker


@pytest.mark.parametrize("kind", ["dcp", "megatron"])
def test_convert_refuses_a_pickled_metadata_without_trust(tmp_path, capsys, kind):
    src, marker = hostile(tmp_path, kind)
    out = tmp_path / "out"
    for extra in ([], ["--procs", "2"], ["--to", "safetensors"]):
        rc = cli(["convert", str(src), str(out), *extra])
        err = capsys.readouterr().err
        assert rc != 0 and "ConversionError" in err and "--trust-pickle" in err, err
        assert not marker.exists() and not out.exists()
    with pytest.raises(sp.ConversionError, match="trust_pickle=True") as e:
        convert(str(src), str(out))
    assert not marker.exists() and not out.exists()
    # the same refusal as diff's: class and message
    other = str(tmp_path / "sp")
    sp.save({"w": torch.ones(2)}, other)
    assert cli(["diff", str(src), other]) == 2
    diff_err = capsys.readouterr().err
    assert f"ConversionError: {e.value}" in diff_err, (diff_err, str(e.value))
    assert not marker.exists()


def test_convert_with_trust_pickle_reads_the_metadata(tmp_path, capsys):
    """The opt-in does unpickle it (so the refusal above is what kept the marker away)."""
    src, marker = hostile(tmp_path, "dcp")
    rc = cli(["convert", str(src), str(tmp_path / "out"), "--trust-pickle"])
    err = capsys.readouterr().err
    assert marker.exists() and rc != 0 and "not DCP's Metadata" in err, err
    assert not (tmp_path / "out").exists()


def test_the_not_a_checkpoint_hint_names_the_flag(tmp_path):
    """A reader given a DCP directory points at the convert command, flag included."""
    src, marker = hostile(tmp_path, "dcp")
    with pytest.raises(sp.ShardpointError) as e:
        sp.load(str(src))
    assert f"shardpoint convert {src} DST --trust-pickle" in str(e.value), str(e.value)
    assert not marker.exists()
