"""The CLI on gs:// checkpoints against the local GCS emulator: inspect, verify, recover (a
crashed save's prefix removed, the committed one kept) and convert into gs://."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("google.cloud.storage")
safetensors_torch = pytest.importorskip("safetensors.torch")

import shardpoint as sp  # noqa: E402
from shardpoint.tools.cli import main  # noqa: E402
from shardpoint_core.stores.gcs import GcsStore  # noqa: E402
from shardpoint_testing.probes import crashed_save  # noqa: E402


@pytest.mark.slow  # the same CLI code as tests/tools/test_s3_cli.py; the store differs
def test_cli_on_gcs(gcs_env, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = gcs_env.url(gcs_env.fresh_prefix("cli"))
    w = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    sp.save({"w": w}, f"{root}/a")
    capsys.readouterr()
    assert main(["inspect", "--json", f"{root}/a"]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"]["w"]["shape"] == [8, 4]
    assert main(["verify", "--strict", f"{root}/a"]) == 0
    # a dead save: its lease expired (a prefix with no lease may be a user's: never removed)
    store = GcsStore.from_url(f"{root}/a")
    crashed_save(store, "save-0123456789ab", {"packed/0-0.bin": b"partial"})
    store.put("save-20240101/notes.txt", b"user data")  # named like a save prefix, a user's
    assert main(["recover", "--min-age", "0", f"{root}/a"]) == 0
    assert "SP-COMMIT-15" in capsys.readouterr().out
    assert not any(o.key.startswith("save-0123456789ab") for o in store.list())
    assert store.get("save-20240101/notes.txt") == b"user data"
    assert not [o for o in GcsStore.from_url(f"{root}/a").list() if "0123456789ab" in o.key]
    src = tmp_path / "w.safetensors"
    safetensors_torch.save_file({"w": w}, str(src))
    assert main(["convert", str(src), f"{root}/c"]) == 0
    assert torch.equal(sp.load(f"{root}/c")["w"], w)
    assert main(["verify", f"{root}/a"]) == 0 and list(tmp_path.iterdir()) == [src]
