"""The CLI on s3:// checkpoints against a real S3 server: inspect, verify (strict too), diff,
recover (a crashed save's prefix removed, the committed one kept), convert from S3 to a local
file and from a local file to S3; a scheme nobody registered refused, never a local folder."""

import json
import uuid

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")
torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

import shardpoint as sp  # noqa: E402
from shardpoint.tools.cli import main  # noqa: E402
from shardpoint_core.stores.s3 import S3Store  # noqa: E402
from shardpoint_testing.probes import crashed_save  # noqa: E402


def test_cli_on_s3(s3_env, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = s3_env.url(s3_env.fresh_prefix("cli"))
    a, b = f"{root}/a", f"{root}/b"
    w = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    sp.save({"w": w, "step": 1}, a)
    sp.save({"w": w + 1, "step": 1}, b)
    capsys.readouterr()

    assert main(["inspect", "--json", a]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tensors"]["w"]["shape"] == [8, 4]
    assert info["tensors"]["w"]["array"].startswith("save-")  # [SP-COMMIT-11]
    assert main(["verify", a]) == 0 and main(["verify", "--strict", a]) == 0
    assert "OK: " + a in capsys.readouterr().out
    assert main(["diff", a, a]) == 0 and main(["diff", a, b]) == 1
    assert main(["verify", f"{root}/none"]) == 2

    crashed = f"save-{uuid.uuid4().hex}"  # a dead save: its lease expired
    crashed_save(S3Store.from_url(a), crashed, {"tensors/w/c/0/0": b"partial"})
    capsys.readouterr()
    assert main(["recover", "--dry-run", a]) == 0
    assert "skipped" in capsys.readouterr().out  # too young
    user = "save-20240101/notes.txt"  # named like a save prefix, a user's
    S3Store.from_url(a).put(user, b"user data")
    assert main(["recover", "--min-age", "0", root]) == 0
    assert "SP-COMMIT-15" in capsys.readouterr().out
    assert not any(o.key.startswith(crashed) for o in S3Store.from_url(a).list())
    assert S3Store.from_url(a).get(user) == b"user data"
    assert main(["verify", a]) == 0

    out = tmp_path / "w.safetensors"
    assert main(["convert", "--to", "safetensors", a, str(out)]) == 0  # S3 -> local
    assert out.exists()
    capsys.readouterr()
    assert main(["convert", str(out), f"{root}/c"]) == 0  # local -> S3
    assert main(["verify", f"{root}/c"]) == 0
    capsys.readouterr()
    assert main(["convert", "--to", "safetensors", a, f"{root}/d.safetensors"]) == 1
    assert "shardpoint output only" in capsys.readouterr().err
    assert main(["convert", str(out), "nostore://b/c"]) == 1
    assert "UnsupportedStoreError" in capsys.readouterr().err
    assert not list(tmp_path.glob("s3*")) and not list(tmp_path.glob("nostore*"))


@pytest.mark.slow  # two spawned worlds (~40 s on a busy 2-core machine)
def test_conformance_run_on_s3(s3_env, capsys):
    """``shardpoint conformance run --store s3://...``: random cases saved by 2 gloo ranks
    and loaded by 1 in another layout, on the object store, checked bit for bit."""
    from shardpoint_conformance.cli import main as conformance

    root = s3_env.url(s3_env.fresh_prefix("conformance"))
    rc = conformance(
        [
            "run",
            "--store",
            root,
            "--cases",
            "2",
            "--seed",
            "3",
            "--save-world-sizes",
            "2",
            "--load-world-sizes",
            "1",
            "--no-vectors",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "2/2 case(s) passed" in out
    assert not [o for o in S3Store.from_url(root).list() if o.key.endswith("manifest.msgpack")]
