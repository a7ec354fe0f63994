"""shardpoint_jax's asynchronous save: it returns once this process's data is copied, so
the caller may change, delete or donate its arrays at once; the checkpoint appears when the
background write commits; errors surface at wait/result and at the next save; a script that
exits right after the call still commits; the host pool is reused."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("jax", reason="shardpoint_jax needs jax (pip install -e '.[jax]')")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import shardpoint_jax as sj  # noqa: E402
from shardpoint_jax import async_save  # noqa: E402
from shardpoint_testing.tensors import as_bytes, random_array, same_bits  # noqa: E402


def tree(seed=0):
    """Random bytes (NaN payloads included): every bit must come back."""
    return {
        "w": jnp.asarray(random_array(f"w{seed}", (256, 64), np.float32)),
        "b": jnp.asarray(random_array(f"b{seed}", (64,), jnp.bfloat16)),
        "host": random_array(f"host{seed}", (32,), np.int64),
        "step": 7,
    }


def test_the_caller_may_change_donate_and_delete_right_after_the_call(tmp_path):
    t = tree()
    want = {k: as_bytes(v) for k, v in t.items() if k != "step"}
    h = sj.save(str(tmp_path / "ck"), t, async_save=True)
    assert isinstance(h, sj.AsyncSave)
    t["host"][:] = -1  # numpy leaves are mutable
    f = jax.jit(lambda a: a * 0 + 1, donate_argnums=0)
    f(t["w"])  # the buffer is donated
    t["b"].delete()
    assert h.result(timeout=60) == str(tmp_path / "ck") and h.done()
    back = sj.load(str(tmp_path / "ck"))
    assert {k: as_bytes(back[k]) for k in want} == want and back["step"] == 7


def test_the_checkpoint_is_invisible_until_committed_and_the_pool_is_reused(tmp_path):
    async_save.POOL.arena = None  # an earlier test's bigger save (the manager's) grew it
    h = sj.save(str(tmp_path / "a"), tree(1), async_save=True)
    h.wait()
    assert os.path.isfile(tmp_path / "a" / "manifest.msgpack")
    arena = async_save.POOL.arena  # numpy leaves are copied into it,
    assert arena is not None and 32 * 8 <= async_save.POOL.nbytes < 256 * 64 * 4  # not jax
    sj.save(str(tmp_path / "b"), tree(2), async_save=True).wait()
    assert async_save.POOL.arena is arena  # same structure: same memory
    back = sj.load(str(tmp_path / "b"))
    assert same_bits(back["w"], tree(2)["w"])
    assert same_bits(sj.load(str(tmp_path / "a"))["w"], tree(1)["w"])


@pytest.fixture
def tiny_fs(tmp_path):
    """A real 1 MiB file system (tmpfs; needs root), unmounted afterwards."""
    d = tmp_path / "tiny"
    d.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def test_a_full_disk_fails_at_wait_and_otherwise_at_the_next_save(tiny_fs, tmp_path):
    big = {"w": jnp.zeros((1024, 1024), jnp.float32)}  # 4 MiB into 1 MiB
    with pytest.raises(sj.SaveFailedError, match="tensor 'w'.*No space left on device"):
        sj.save(str(tiny_fs / "ck"), big)  # sync: the same error, at once
    assert os.listdir(tiny_fs) == []
    h = sj.save(str(tiny_fs / "ck"), big, async_save=True)
    with pytest.raises(sj.SaveFailedError, match="tensor 'w'.*No space left on device"):
        h.wait(timeout=60)
    assert not os.path.exists(tiny_fs / "ck") and os.listdir(tiny_fs) == []  # nothing left
    sj.save(str(tiny_fs / "ck2"), big, async_save=True)  # nobody looks at this one's error
    with pytest.raises(sj.SaveFailedError, match="previous asynchronous save .*ck2"):
        sj.save(str(tmp_path / "elsewhere"), tree())
    sj.save(str(tmp_path / "elsewhere"), tree())  # reported once, then saves go on
    assert os.path.isfile(tmp_path / "elsewhere" / "manifest.msgpack")


def test_wait_with_a_timeout_says_the_save_is_still_writing(tmp_path):
    h = sj.save(str(tmp_path / "ck"), tree(), async_save=True)
    try:
        h.wait(timeout=0)
    except TimeoutError as e:
        assert "still writing" in str(e)
    h.wait()


def test_a_script_that_exits_right_after_the_call_still_commits(tmp_path):
    script = textwrap.dedent(f"""
        import jax.numpy as jnp, shardpoint_jax as sj
        sj.save({str(tmp_path / "ck")!r}, {{"w": jnp.arange(1 << 20, dtype=jnp.float32)}},
                async_save=True)
    """)
    r = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert r.returncode == 0, r.stderr
    back = sj.load(str(tmp_path / "ck"))
    assert same_bits(back["w"], np.arange(1 << 20, dtype=np.float32))
