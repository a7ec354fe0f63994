"""Async save on real gloo processes: round trip, mutation after return, errors at wait() and
at the next save, ordering of saves, a SIGKILL during the background write; GPU staging where
CUDA exists."""

import os
import time

import pytest
import torch

from shardpoint_conformance import faults
from shardpoint_testing.launch import run_world
from shardpoint_testing.tensors import same_bits, seeded_randn

SHAPE = (12, 5)


def full(name, dtype=torch.float32):
    return seeded_randn(name, SHAPE, dtype)


def state(rank, world, scale=1.0):
    import shardpoint as sp

    a, b = rank * SHAPE[0] // world, (rank + 1) * SHAPE[0] // world
    f0, f1 = (
        rank * 60 // world + (7 if rank else 0),
        (rank + 1) * 60 // world + (7 if rank + 1 < world else 0),
    )  # uneven flattened ranges: the save exchanges bytes
    return {
        "rows": sp.ShardedTensor((full("rows") * scale)[a:b].clone(), SHAPE, (a, 0)),
        "flat": sp.ShardedTensor(
            (full("flat") * scale).reshape(-1)[f0:f1].clone(),
            SHAPE,
            (0, 0),
            local_shape=SHAPE,
            flattened_range=(f0, f1),
        ),
        "rep": (full("rep") * scale).to(torch.bfloat16),
        "obj": sp.ShardedObject({"rank": rank}, rank, world),
        "step": int(scale),
    }


class SlowFlush:
    """The real backend; ``flush`` takes a second longer (a slow disk)."""

    def __init__(self):
        from shardpoint_core.transactions.resolve import get_backend

        self.inner = get_backend()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def flush(self, root):
        time.sleep(1.0)
        self.inner.flush(root)


def async_job(rank, world, base):
    import shardpoint as sp
    import torch.distributed as dist

    out = {}
    # 1. round trip; the caller overwrites its tensors right after the call returns
    st = state(rank, world)
    h = sp.save(st, f"{base}/a", async_save=True)
    out["handle"] = isinstance(h, sp.AsyncSave) and h.staging_bytes > 0
    for k in ("rows", "flat"):
        st[k].data.fill_(-7.0)
    st["rep"].fill_(-7.0)
    r = h.wait(timeout=60)
    out["first_alloc"] = "staging_alloc" in r.timings and r.timings["staging_bytes"] > 0
    back = sp.load(f"{base}/a")
    out["bitwise"] = all(
        same_bits(back[k], full(k, back[k].dtype)) for k in ("rows", "flat", "rep")
    )
    out["values"] = back["step"]
    # 2. same structure again: the pool is reused, nothing allocated
    h2 = sp.save(state(rank, world, 2.0), f"{base}/a", overwrite=True, async_save=True)
    r2 = h2.result()
    out["reused"] = (
        r2.timings["staging_alloc"] == 0.0
        and r2.timings["staging_bytes"] == r.timings["staging_bytes"]
        and h2.staging_bytes == h.staging_bytes
    )
    out["second"] = torch.equal(sp.load(f"{base}/a")["rows"], full("rows") * 2.0)
    # 3. a new save first waits for the previous async one
    h3 = sp.save(state(rank, world, 3.0), f"{base}/b", async_save=True, backend=SlowFlush())
    sp.save(state(rank, world, 4.0), f"{base}/c")
    out["waited"] = h3.done()
    out["b"] = torch.equal(sp.load(f"{base}/b")["rows"], full("rows") * 3.0)
    # 4. a write failing on rank 1 in the background: wait() raises on every rank
    h4 = sp.save(
        state(rank, world, 5.0),
        f"{base}/a",
        overwrite=True,
        async_save=True,
        backend=faults.FailingWrites(1),
    )
    try:
        h4.wait(timeout=60)
        out["wait_err"] = "saved"
    except sp.ShardpointError as e:
        out["wait_err"] = f"{type(e).__name__}: {e}"
    # 5. ... and an error nobody waited for comes out of the next save, once
    sp.save(
        state(rank, world, 6.0),
        f"{base}/a",
        overwrite=True,
        async_save=True,
        backend=faults.FailingWrites(1),
    )
    try:
        sp.save(state(rank, world, 7.0), f"{base}/d")
        out["next_err"] = "saved"
    except sp.ShardpointError as e:
        out["next_err"] = f"{type(e).__name__}: {e}"
    # 6. rank 0 waited for a failed save, rank 1 did not: the next save raises on both ranks
    #    (were only rank 1 to raise, rank 0 would go on into the save's collectives alone)
    h6 = sp.save(
        state(rank, world, 6.5),
        f"{base}/a",
        overwrite=True,
        async_save=True,
        backend=faults.FailingWrites(1),
    )
    if rank == 0:
        try:
            h6.wait(timeout=60)
        except sp.ShardpointError:
            pass
    try:
        sp.save(state(rank, world, 7.5), f"{base}/d")
        out["mixed_err"] = "saved"
    except sp.ShardpointError as e:
        out["mixed_err"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    out["prev_intact"] = torch.equal(sp.load(f"{base}/a")["rows"], full("rows") * 2.0)
    out["d_missing"] = not os.path.exists(f"{base}/d")
    sp.save(state(rank, world, 8.0), f"{base}/d", async_save=True).wait(timeout=60)
    out["after"] = torch.equal(sp.load(f"{base}/d")["rows"], full("rows") * 8.0)
    out["timeout_type"] = _timeout_raises(rank, world, base)
    dist.barrier()
    out["leftovers"] = sorted(n for n in os.listdir(base) if "shardpoint-" in n)
    return out


def _timeout_raises(rank, world, base):
    import shardpoint as sp

    h = sp.save(state(rank, world, 9.0), f"{base}/e", async_save=True, backend=SlowFlush())
    try:
        h.wait(timeout=0.01)
        got = "returned"
    except TimeoutError as e:  # says what happened and that the save goes on
        got = "TimeoutError" + (" still writing" if "still writing" in str(e) else "")
    h.wait(timeout=60)
    return got


def test_async_save_round_trip_mutation_errors_and_ordering(tmp_path):
    res = run_world(2, async_job, str(tmp_path), timeout=180, pg_timeout=30)
    for out in res:
        assert out["handle"] and out["first_alloc"] and out["bitwise"], out
        assert out["values"] == 1, out
        assert out["reused"] and out["second"], out
        assert out["waited"] and out["b"], out
        assert out["wait_err"].startswith("SaveFailedError") and "rank 1" in out["wait_err"]
        assert "No space left" in out["wait_err"], out
        assert out["next_err"].startswith("SaveFailedError") and "rank 1" in out["next_err"]
        assert out["mixed_err"].startswith("SaveFailedError") and "rank 1" in out["mixed_err"]
        assert out["prev_intact"] and out["d_missing"] and out["after"], out
        assert out["timeout_type"] == "TimeoutError still writing", out
        assert out["leftovers"] == [], out


def test_sigkill_during_background_write_keeps_previous_and_hides_new(tmp_path):
    """[SP-COMMIT-1] [SP-COMMIT-3]: rank 1 SIGKILLed by its own background write thread."""
    r = faults.kill_during_save(
        str(tmp_path / "k"), 2, 1, "write", 1, overwrite=True, async_save=True
    )
    assert r["killed"] and r["ok"], r
    assert r["state"] == "previous", r


def test_stream_device_writes_bounds_bytes_in_flight():
    """The bounded staging loop (CPU tensors stand in for device ones): never more than the
    budget (or one item) staged at once, and every item written once, in order."""
    from shardpoint.api.staging import stream_device_writes

    sizes = [10, 300, 40, 40, 40, 500, 8, 8]
    items = [(torch.full((n,), i, dtype=torch.uint8), i) for i, n in enumerate(sizes)]
    live, peak, written = {}, [0], []

    class Op:
        def __init__(self, i, n):
            self.i, self.n = i, n

    def write(host, i):
        live[i] = host.numel()
        peak[0] = max(peak[0], sum(live.values()))
        written.append((i, bool((host == i).all())))
        return Op(i, host.numel())

    def wait(op):
        live.pop(op.i)

    pending = stream_device_writes(items, write, wait, budget_bytes=100)
    assert written == [(i, True) for i in range(len(sizes))]
    assert peak[0] <= max(100, max(sizes)) and peak[0] >= 300
    assert [op.i for op, _ in pending] == sorted(live)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_sync_save_streams_through_bounded_pinned_buffers(tmp_path):
    import shardpoint as sp

    st = {
        f"w{i}": torch.randn(256, 1024, device="cuda").to(
            torch.bfloat16 if i % 2 else torch.float32
        )
        for i in range(8)
    }
    opts = sp.SaveOptions(device_staging_bytes=1 << 20)  # less than one tensor: one at a time
    sp.save(st, str(tmp_path / "c"), options=opts)
    back = sp.load(str(tmp_path / "c"))
    assert all(same_bits(back[k], v.cpu()) for k, v in st.items())


@cuda
def test_cuda_async_save_stages_into_pinned_pool(tmp_path):
    import shardpoint as sp

    st = {"w": torch.randn(512, 512, device="cuda"), "b": torch.randn(7, device="cuda")}
    want = {k: v.cpu().clone() for k, v in st.items()}
    h = sp.save(st, str(tmp_path / "c"), async_save=True)
    for v in st.values():
        v.fill_(3.0)  # right after return, on the current stream
    r = h.wait(timeout=60)
    back = sp.load(str(tmp_path / "c"))
    assert all(torch.equal(back[k], want[k]) for k in want)
    assert r.timings["staging_bytes"] >= sum(v.numel() * 4 for v in want.values())


def _async_across_group_recreation(rank, world, base):
    """An async save, then the default process group destroyed and made again (as an elastic
    restart or a test harness does in one process), then async saves again: the checkpointer's
    per-group state (the background gloo group) must follow the new group."""
    from datetime import timedelta
    import shardpoint as sp
    import torch.distributed as dist

    sp.save(state(rank, world), f"{base}/before", async_save=True).wait(timeout=60)
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{base}/store2",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),
    )
    st = state(rank, world, 2.0)
    sp.save(st, f"{base}/after", async_save=True).wait(timeout=60)
    sp.save(st, f"{base}/sync")
    like = state(rank, world, 0.0)
    out = sp.load(f"{base}/after", like=like)
    return same_bits(out["rows"], st["rows"].data) and out["step"] == 2


def test_async_save_after_the_default_group_is_destroyed_and_made_again(tmp_path):
    assert run_world(
        2, _async_across_group_recreation, str(tmp_path), timeout=120, pg_timeout=30
    ) == [True, True]
