"""sp.save / sp.load / sp.open and the CheckpointManager on gs:// against a local GCS emulator
(gcp-storage-emulator, on loopback): bitwise round trips through the object-store commit
(format.md 9.1), in the plain-PUT mode the emulator allows (it ignores preconditions)."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("google.cloud.storage")

import shardpoint as sp  # noqa: E402
from shardpoint_core.stores.gcs import GcsStore  # noqa: E402
from shardpoint_core.verify import verify_checkpoint  # noqa: E402
from shardpoint_testing.tensors import same_bits  # noqa: E402


def state(gen):
    g = torch.Generator().manual_seed(gen)
    return {
        "w": torch.randn(12, 5, generator=g),
        "h": torch.randn(7, generator=g).bfloat16(),
        "u8": torch.arange(256, dtype=torch.uint8).reshape(16, 16),
        "step": gen,
    }


def test_save_load_open_round_trip_on_gcs(gcs_env):
    url = gcs_env.url(gcs_env.fresh_prefix("api") + "/ck")
    sp.save(state(0), url)
    out = sp.load(url)
    assert all(same_bits(out[k], v) for k, v in state(0).items() if k != "step")
    assert out["step"] == 0 and verify_checkpoint(url).ok
    with sp.open(url) as ck:
        assert same_bits(ck["u8"][2:5].to_torch(), state(0)["u8"][2:5])
    with pytest.raises(sp.CheckpointExistsError):
        sp.save(state(1), url)
    sp.save(state(1), url, overwrite=True)
    assert same_bits(sp.load(url)["w"], state(1)["w"])
    keys = [o.key for o in GcsStore.from_url(url).list()]
    assert len({k.split("/")[0] for k in keys if k.startswith("save-")}) == 1  # old deleted


def test_manager_on_gcs(gcs_env):
    """Async saves, retention after each commit, metrics and resume on gs://."""
    root = gcs_env.url(gcs_env.fresh_prefix("mgr"))
    with sp.CheckpointManager(root, max_to_keep=2, async_save=True) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step), metrics={"loss": 1.0 / step})
        mgr.wait()  # the last save commits, then retention
        assert mgr.all_steps() == [2, 3] and mgr.metrics(3) == {"loss": 1.0 / 3}
    assert GcsStore.from_url(root).list_children() == ["step_00000002", "step_00000003"]
    assert same_bits(sp.CheckpointManager(root).load()["w"], state(3)["w"])
