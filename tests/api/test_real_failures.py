"""Real failures, not simulated ones: a tmpfs that fills up or is remounted read-only, real
SIGINT/SIGTERM sent to a process in the middle of a save, a process that exits while its async
save still writes, a gloo rank that dies or runs out of space while its peers save or load.

What is checked each time: the documented error (its type, and a message naming the path, the
cause and the fix), the previous checkpoint intact bit for bit, no leftover that holds space or
blocks the next save, and the next save working.
"""

import glob
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import shardpoint as sp
from shardpoint.tools.cli import main as cli_main
from shardpoint_conformance import faults
from shardpoint_testing.launch import RankFailure, run_world
from shardpoint_testing.tensors import same_bits

MiB = 1 << 20


class Disk:
    """A tmpfs mounted at ``path`` (a real file system that fills up, or goes read-only)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def free(self) -> int:
        v = os.statvfs(self.path)
        return v.f_bavail * v.f_frsize

    def read_only(self) -> None:
        subprocess.run(["mount", "-o", "remount,ro", self.path], check=True)

    def fill(self, leave_pages: int) -> None:
        """Fill the disk with one file until ``leave_pages`` 4 KiB pages remain free."""
        with open(os.path.join(self.path, "fill"), "wb") as f:
            f.write(b"\0" * (self.free() - leave_pages * 4096))

    def entries(self) -> list:
        return sorted(n for n in os.listdir(self.path) if n != "fill")


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size)`` mounts a tmpfs of ``size`` (e.g. "32m") in ``tmp_path`` and returns its
    :class:`Disk`; the test is skipped, with the reason, where mounting is refused (not root),
    and everything mounted is unmounted afterwards."""
    mounted = []

    def mount(size: str) -> Disk:
        path = tmp_path / f"disk{len(mounted)}"
        path.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
        mounted.append(str(path))
        return Disk(str(path))

    try:
        yield mount
    finally:
        for path in mounted:
            subprocess.run(["umount", "-l", path], capture_output=True)


@pytest.fixture
def small_disk(tmpfs):
    """A 32 MiB tmpfs."""
    return tmpfs("32m")


@pytest.fixture
def big_disk(tmpfs):
    """A 512 MiB tmpfs (fast, and off the shared disk)."""
    return tmpfs("512m")


def small_state(v: float = 1.0) -> dict:
    return {
        "w": torch.arange(1000, dtype=torch.float32) * v,
        "b": torch.ones(7, 3, dtype=torch.bfloat16) * v,
        "step": int(v),
    }


def big_state(n: int = 12) -> dict:
    """n MiB x 4 of float32: 48 MiB by default, more than the small disk holds."""
    return {f"t{i}": torch.arange(MiB, dtype=torch.float32) + i for i in range(n)}


def same(a: dict, b: dict) -> bool:
    """Equal trees of tensors (bit for bit, dtype and shape too) and plain values."""
    if a.keys() != b.keys():
        return False
    for k, x in a.items():
        y = b[k]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and same_bits(x, y)):
                return False
        elif x != y:
            return False
    return True


def full_disk_message(msg: str, path: str) -> None:
    assert "No space left on device" in msg, msg
    assert repr(path) in msg or path in msg, msg
    assert "free space" in msg, msg  # what to do about it


# the file a full disk stopped a chunk at, by layout: the packed writer's data object, with
# the tensor whose chunk it was; the per-array layout's chunk file (which names its tensor)
CHUNK_FILE = {
    "packed": r"tensor 't\d+'.*/packed/[0-9a-f]+-0\.bin",
    "per-array": r"/tensors/t\d+/c/",
}


def backend_of(layout: str) -> dict:
    return {"backend": sp.ZarrBackend()} if layout == "per-array" else {}


# ---------------------------------------------------------------------- a full disk
@pytest.mark.parametrize("layout", ["packed", "per-array"])
def test_full_disk_sync_save_names_file_and_fix_and_keeps_the_previous(small_disk, layout):
    """A save bigger than the file system: SaveFailedError naming the checkpoint, the tensor,
    the file it could not write and the fix; the staging directory is gone (the space comes
    back), the previous checkpoint loads bit for bit and the next save works."""
    d = small_disk
    a = os.path.join(d.path, "a")
    sp.save(small_state(), a, **backend_of(layout))
    before = d.free()
    for target, kw in ((os.path.join(d.path, "b"), {}), (a, {"overwrite": True})):
        with pytest.raises(sp.SaveFailedError) as ei:
            sp.save(big_state(), target, **kw, **backend_of(layout))
        full_disk_message(str(ei.value), target)
        assert re.search(CHUNK_FILE[layout], str(ei.value)), str(ei.value)
        assert d.entries() == ["a"] and d.free() == before
    assert same(sp.load(a), small_state())
    sp.save(small_state(2.0), os.path.join(d.path, "c"))
    assert same(sp.load(os.path.join(d.path, "c")), small_state(2.0))


def test_full_disk_while_creating_arrays_gets_the_same_message(tmpfs):
    """The disk may fill while the arrays' zarr.json files are created, before any chunk:
    sync and async saves give the same SaveFailedError (the checkpoint, the file, the fix)
    as a full disk at a chunk write; it was the backend's bare 'cannot create array' (seen
    in CI, where timing moved the point at which a 32 MiB disk filled). Per-array layout:
    the packed one writes no zarr.json (its index part and manifest: the test below)."""
    d = tmpfs("64k")
    many = {f"t{i}": torch.zeros(4) for i in range(200)}  # 200 zarr.json files
    target = os.path.join(d.path, "b")
    for kw in ({}, {"async_save": True}):
        with pytest.raises(sp.SaveFailedError) as ei:
            h = sp.save(many, target, backend=sp.ZarrBackend(), **kw)
            if kw:
                h.wait(timeout=60)
        full_disk_message(str(ei.value), target)
        assert "/zarr.json" in str(ei.value)  # the file that did not fit
        assert d.entries() == []


@pytest.mark.parametrize("layout", ["packed", "per-array"])
def test_full_disk_at_the_manifest_is_a_save_failure_too(small_disk, layout):
    """Leave the disk no page, or a page or six (a chunk, the manifest and, per-array, two
    Zarr group files and the array's zarr.json are a page each): every chunk may fit and the
    manifest not. Each outcome is the documented SaveFailedError (it was the base
    ShardpointError with a bare 'OSError: [Errno 28]' when the manifest's own write failed)
    or a complete checkpoint."""
    d = small_disk
    a = os.path.join(d.path, "a")
    old = {"w": torch.arange(1023, dtype=torch.float32)}  # one chunk of exactly one page
    stages = set()
    for leave in range(0, 7):
        sp.save(old, a, overwrite=True, **backend_of(layout))
        d.fill(leave)
        new = {"w": old["w"] + leave}
        try:
            sp.save(new, a, overwrite=True, **backend_of(layout))
            assert same(sp.load(a), new)
            stages.add("saved")
        except sp.ShardpointError as e:
            assert type(e) is sp.SaveFailedError, (type(e), e)
            full_disk_message(str(e), a)
            stages.add("manifest" if "cannot commit" in str(e) else "chunks")
            assert same(sp.load(a), old)
        assert d.entries() == ["a"]
        os.remove(os.path.join(d.path, "fill"))
    assert stages == {"chunks", "manifest", "saved"}, stages


def test_full_disk_async_save_raises_at_wait_or_at_the_next_save(small_disk):
    """An async save that fills the disk: its error (with path and fix) at ``wait()``, or,
    never waited for, at the next save, which then does not run; the one after works."""
    d = small_disk
    a, b = os.path.join(d.path, "a"), os.path.join(d.path, "b")
    sp.save(small_state(), a)
    h = sp.save(big_state(), b, async_save=True)
    with pytest.raises(sp.SaveFailedError) as ei:
        h.wait()
    full_disk_message(str(ei.value), b)
    assert d.entries() == ["a"]
    sp.save(small_state(3.0), os.path.join(d.path, "c"))  # wait() handed it over
    sp.save(big_state(), b, async_save=True)  # never waited for
    with pytest.raises(sp.SaveFailedError) as ei:
        sp.save(small_state(4.0), os.path.join(d.path, "e"))
    full_disk_message(str(ei.value), b)
    assert d.entries() == ["a", "c"]
    sp.save(small_state(4.0), os.path.join(d.path, "e"))
    assert same(sp.load(a), small_state()) and same(
        sp.load(os.path.join(d.path, "e")), small_state(4.0)
    )


@pytest.mark.parametrize("async_save", [False, True])
def test_manager_full_disk_keeps_latest_and_retention_right(small_disk, async_save):
    """A manager step that does not fit: its error once (from ``save``, or from the handle's
    ``wait()``: the next ``save`` used to raise it a second time and so lose that step too),
    ``latest_step`` and retention unchanged, the next step saved and retention applied."""
    root = os.path.join(small_disk.path, "run")
    mgr = sp.CheckpointManager(root, max_to_keep=2, async_save=async_save)
    mgr.save(1, small_state(1.0))
    mgr.save(2, small_state(2.0))
    mgr.wait()
    with pytest.raises(sp.SaveFailedError) as ei:
        r = mgr.save(3, big_state())
        if async_save:
            r.wait()
    full_disk_message(str(ei.value), mgr.path(3))
    assert mgr.all_steps() == [1, 2] and mgr.latest_step() == 2
    mgr.save(4, small_state(4.0))
    mgr.close()
    assert mgr.all_steps() == [2, 4] and sorted(os.listdir(root)) == mgr_dirs(mgr, [2, 4])
    assert same(mgr.load(2), small_state(2.0)) and same(mgr.load(), small_state(4.0))


def mgr_dirs(mgr, steps):
    return sorted(os.path.basename(mgr.path(s)) for s in steps)


@pytest.mark.parametrize("to", ["shardpoint", "dcp"])
def test_convert_into_a_full_disk_is_a_conversion_error(small_disk, tmp_path, to):
    """safetensors -> shardpoint and shardpoint -> DCP into a disk too small: ConversionError
    saying the disk is full (DCP's writer reports only 'unexpected pos', so the free space is
    checked), nothing at the destination, the space back (they raised a bare OSError and
    DCP's CheckpointException)."""
    from safetensors.torch import save_file
    from shardpoint.tools.convert import convert

    if to == "shardpoint":
        src = str(tmp_path / "m.safetensors")
        save_file(big_state(), src)
    else:
        src = str(tmp_path / "src")
        sp.save(big_state(), src)
    dst = os.path.join(small_disk.path, "out")
    with pytest.raises(sp.ConversionError) as ei:
        convert(src, dst, to=to)
    msg = str(ei.value)
    assert ("No space left on device" in msg or "bytes free" in msg) and dst in msg, msg
    assert "free space" in msg, msg
    assert small_disk.entries() == []


def _one_rank_out_of_space(rank, world, root):
    """Rank 1 holds all of a 48 MiB tensor, rank 0 an empty piece of it: only rank 1 writes
    chunks, and they do not fit."""
    rows = 12 if rank == 1 else 0
    st = {
        "w": sp.ShardedTensor(torch.ones(rows, MiB), (12, MiB), (0, 0)),
        "r": sp.ShardedObject(rank, rank, world),
    }  # a per-rank value (plain ones must agree)
    sp.save({"w": sp.ShardedTensor(torch.full((rows, 8), 2.0), (12, 8), (0, 0))}, f"{root}/a")
    try:
        sp.save(st, f"{root}/b")
        return "saved"
    except sp.ShardpointError as e:
        return [type(e).__name__, str(e)]


def test_two_ranks_one_runs_out_of_space_both_raise(small_disk):
    """A real gloo pair where only rank 1's writes hit the full disk: both ranks raise the same
    SaveFailedError naming rank 1, the cause and the fix; neither hangs; the previous
    checkpoint is intact and nothing else is left."""
    got = run_world(2, _one_rank_out_of_space, small_disk.path, timeout=120, pg_timeout=30)
    for name, msg in got:
        assert name == "SaveFailedError" and msg.startswith("rank 1:"), msg
        full_disk_message(msg, os.path.join(small_disk.path, "b"))
    assert small_disk.entries() == ["a"]
    assert torch.equal(sp.load(os.path.join(small_disk.path, "a"))["w"], torch.full((12, 8), 2.0))


# ---------------------------------------------------------------------- read-only
def test_read_only_file_system_loads_and_reports(small_disk, capsys):
    """Remounted read-only, with a crashed save's leftovers in it: loads (plain and through the
    manager, which cleans leftovers first and raised a bare OSError) work and write nothing;
    verify and inspect work; saves raise SaveFailedError naming the cause; recover reports
    what it could not remove, with the fix, and exits 1 (it stopped at the first leftover)."""
    d = small_disk
    a = os.path.join(d.path, "a")
    sp.save(small_state(), a)
    mgr = sp.CheckpointManager(os.path.join(d.path, "run"))
    mgr.save(1, small_state(1.0))
    os.makedirs(os.path.join(mgr.root, "step_00000002"))  # crashed: no manifest
    stale = os.path.join(mgr.root, ".step_00000003.shardpoint-tmp-0a1b2c")  # crashed staging
    os.makedirs(stale)
    os.utime(stale, (time.time() - 7200,) * 2)
    d.read_only()
    assert same(sp.load(a, like=small_state()), small_state()) and same(sp.load(a), small_state())
    assert same(mgr.load(like=small_state()), small_state(1.0))
    assert same(sp.CheckpointManager(mgr.root).load(), small_state(1.0))
    for call in (
        lambda: sp.save(small_state(), os.path.join(d.path, "new")),
        lambda: sp.save(small_state(), a, overwrite=True),
        lambda: mgr.save(4, small_state()),
    ):
        with pytest.raises(sp.SaveFailedError, match="Read-only file system"):
            call()
    capsys.readouterr()
    assert cli_main(["verify", a]) == 0 and cli_main(["inspect", a]) == 0
    capsys.readouterr()
    assert cli_main(["recover", mgr.root]) == 1
    out = capsys.readouterr().out
    assert "could not remove" in out and stale in out and "read-only" in out, out
    acts = sp.recover(mgr.root, min_age_s=0)
    assert [(x.action, x.done) for x in acts] == [("remove", False)]
    assert os.path.isdir(stale) and same(sp.load(a), small_state())


# ---------------------------------------------------------------------- interrupts
_SAVE_LOOP = """
import signal, sys, torch, shardpoint as sp
if sys.argv[2] == "TERM":      # a launcher's preemption handler
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
state = {f"t{i}": torch.arange(1 << 20, dtype=torch.float32) + i for i in range(32)}
print("ready", flush=True)
while True:                     # every save replaces b: any one may be the one interrupted
    sp.save(state, sys.argv[1], overwrite=True)
"""


@pytest.mark.parametrize("sig", ["INT", "TERM"])
def test_signal_in_the_middle_of_a_save_leaves_no_staging_behind(big_disk, sig):
    """A real SIGINT (KeyboardInterrupt), or a SIGTERM whose handler raises SystemExit, sent
    while a 128 MiB save is writing: the staging directory is removed (it stayed, with the
    lock, holding up to a checkpoint of space until `recover` ran 15 minutes later), the last
    committed checkpoint loads bit for bit, and the next save works."""
    d = big_disk
    a, b = os.path.join(d.path, "a"), os.path.join(d.path, "b")
    sp.save(small_state(), a)
    p = subprocess.Popen(
        [sys.executable, "-c", _SAVE_LOOP, b, sig],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while not glob.glob(os.path.join(glob.escape(d.path), ".b.shardpoint-tmp-*/packed")):
            if time.monotonic() > deadline or p.poll() is not None:
                p.kill()  # its stderr ends only when it does: read it after
                pytest.fail(f"no save was seen writing within 60 s: {p.communicate()[1]}")
            time.sleep(0.002)
        p.send_signal(getattr(signal, f"SIG{sig}"))
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
        p.wait()
    assert p.returncode != 0
    assert ("KeyboardInterrupt" in err) if sig == "INT" else p.returncode == 143, err
    left = [e for e in d.entries() if e not in ("a", "b")]
    assert left == [], [(r, f) for e in left for r, _, f in os.walk(os.path.join(d.path, e))]
    assert sp.recover(d.path, min_age_s=0) == []
    assert same(sp.load(a), small_state())
    state = {f"t{i}": torch.arange(MiB, dtype=torch.float32) + i for i in range(32)}
    if os.path.exists(b):
        assert same(sp.load(b), state)
    sp.save(small_state(5.0), b, overwrite=True)
    assert same(sp.load(b), small_state(5.0))


_ASYNC_THEN_EXIT = """
import sys, torch, shardpoint as sp
state = {f"t{i}": torch.arange(1 << 16, dtype=torch.float32) + i for i in range(160)}
sp.save(state, sys.argv[1], async_save=True)
print("returned", flush=True)    # the script ends here: the save is still writing
"""


@pytest.mark.parametrize("fits", [True, False])
def test_async_save_still_writing_at_exit(tmpfs, fits):
    """A script that ends right after an async save: the exit hook commits it (it failed with
    'cannot schedule new futures after interpreter shutdown': the hook ran after the thread
    pools stopped taking work). One that cannot commit says so on stderr, naming its path."""
    disk = tmpfs("128m" if fits else "32m")
    path = os.path.join(disk.path, "b")
    r = subprocess.run(
        [sys.executable, "-c", _ASYNC_THEN_EXIT, path], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and r.stdout.strip() == "returned", r.stderr
    if fits:
        assert "failed" not in r.stderr, r.stderr
        back = sp.load(path)
        assert len(back) == 160 and all(
            torch.equal(back[f"t{i}"], torch.arange(1 << 16, dtype=torch.float32) + i)
            for i in range(160)
        )
    else:
        assert f"the async save to {path!r} still running at exit failed" in r.stderr, r.stderr
        full_disk_message(r.stderr, path)
    assert disk.entries() == (["b"] if fits else [])


# ---------------------------------------------------------------------- changed under a reader
_OVERWRITE_LOOP = """
import sys, torch, shardpoint as sp
print("ready", flush=True)       # torch imported: the overwrites start now
for k in range(1, 9):
    sp.save({f"t{i:02d}": torch.full((1 << 16,), float(k)) for i in range(48)}, sys.argv[1],
            overwrite=True)
"""


def test_a_load_overlapping_an_overwrite_fails_instead_of_mixing_two_checkpoints(big_disk):
    """Another process saves over the checkpoint (overwrite=True) again and again while this
    one loads it: every load returns one checkpoint whole, or fails with LoadFailedError
    saying it was replaced. Before, chunk files opened after the commit's rename came from the
    new checkpoint and the load returned tensors of two steps without a word."""
    a = os.path.join(big_disk.path, "a")
    sp.save({f"t{i:02d}": torch.zeros(1 << 16) for i in range(48)}, a)
    saver = subprocess.Popen(
        [sys.executable, "-c", _OVERWRITE_LOOP, a], stdout=subprocess.PIPE, text=True
    )
    whole = replaced = 0
    try:
        assert saver.stdout.readline() == "ready\n"  # no loads while it imports torch
        while saver.poll() is None:
            try:
                got = sp.load(a)
            except sp.LoadFailedError as e:
                assert "was replaced" in str(e) and a in str(e), e
                replaced += 1
                continue
            steps = {float(t[0]) for t in got.values()} | {float(t[-1]) for t in got.values()}
            assert len(steps) == 1, f"one load returned tensors of steps {sorted(steps)}"
            whole += 1
    finally:
        saver.kill()
        saver.wait()
    assert saver.returncode == 0 and whole > 0 and replaced > 0, (whole, replaced)


def test_a_lazy_view_of_a_replaced_checkpoint_fails_instead_of_reading_the_new_one(tmp_path):
    """``sp.open`` reads its manifest once: a tensor read after another save replaced the
    checkpoint raises LoadFailedError (it returned the new checkpoint's bytes under the old
    manifest, e.g. a value of step 1 beside a tensor of step 2)."""
    a = str(tmp_path / "a")
    sp.save({"w": torch.zeros(100), "step": 1}, a)
    with sp.open(a) as ckpt:
        assert torch.equal(ckpt["w"].to_torch(), torch.zeros(100))
        sp.save({"w": torch.ones(100), "step": 2}, a, overwrite=True)
        assert ckpt["step"] == 1
        with pytest.raises(sp.LoadFailedError, match="was replaced"):
            ckpt["w"].to_torch()
    with sp.open(a) as ckpt:
        assert ckpt["step"] == 2 and torch.equal(ckpt["w"].to_torch(), torch.ones(100))


# ---------------------------------------------------------------------- a rank dies
class _DieOnRead:
    """The real backend; rank 1 dies (``os._exit``) on its first chunk read."""

    def __init__(self):
        from shardpoint_core.transactions.resolve import get_backend

        self.inner = get_backend()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def read_into(self, handle, offset, out):
        import torch.distributed as dist

        if dist.get_rank() == 1:
            os._exit(3)
        return self.inner.read_into(handle, offset, out)


def _rank_dies(rank, world, root, what):
    import torch.distributed as dist

    st = {
        "w": sp.ShardedTensor(torch.full((4, 1000), float(rank)), (8, 1000), (4 * rank, 0)),
        "x": torch.ones(10),
    }
    sp.save(st, f"{root}/a")
    dist.barrier()
    try:
        if what == "load":
            sp.load(f"{root}/a", like=st, backend=_DieOnRead())
        else:  # rank 1 SIGKILLs itself after its first chunk write
            sp.save(
                st,
                f"{root}/a",
                overwrite=True,
                backend=faults.KillingBackend(spec="1:write:1"),
                async_save=what == "async",
            )
            sp.save({}, f"{root}/c")  # an async save's error surfaces here at the latest
        out = "no error"
    except BaseException as e:  # noqa: BLE001 - the outcome is the test's subject
        out = f"{type(e).__name__}: {e}"
    with open(f"{root}/rank{rank}.txt", "w") as f:
        f.write(out)


@pytest.mark.parametrize("what", ["load", pytest.param("save", marks=pytest.mark.slow), "async"])
def test_a_rank_that_dies_fails_the_others_with_rank_lost(tmp_path, what):
    """Rank 1 of a real gloo pair dies (os._exit in a load's read, SIGKILL after a save's first
    chunk write, sync or async): rank 0 raises RankLostError (a LoadFailedError and a
    SaveFailedError) saying another rank died and what to do, at once, where it got gloo's
    bare RuntimeError; a save's staging directory is removed, the previous checkpoint loads."""
    with pytest.raises(RankFailure, match="rank 1: process exited with code"):
        run_world(2, _rank_dies, str(tmp_path), what, timeout=120, pg_timeout=30)
    deadline = time.monotonic() + 30
    while not (tmp_path / "rank0.txt").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    got = (tmp_path / "rank0.txt").read_text()
    assert got.startswith("RankLostError: rank 0 of 2: the ") and "another rank" in got, got
    assert "restart every rank" in got, got
    if what == "load":  # a load loses nothing: it must not speak of a save cut short
        assert "save" not in got and "load again" in got, got
    cls = sp.LoadFailedError if what == "load" else sp.SaveFailedError
    assert issubclass(sp.RankLostError, cls)
    assert sorted(os.listdir(tmp_path)) == ["a", "rank0.txt"]
    back = sp.load(str(tmp_path / "a"))
    assert torch.equal(back["w"], torch.cat([torch.zeros(4, 1000), torch.ones(4, 1000)]))


def _rank_hangs(rank, world, root):
    if rank == 1:
        time.sleep(12)  # never joins the save; returns after rank 0 gave up
        return None
    try:
        sp.save({"x": torch.ones(3)}, f"{root}/a")
        return "saved"
    except sp.ShardpointError as e:
        return [type(e).__name__, str(e)]


@pytest.mark.slow
def test_a_hung_rank_fails_the_others_after_the_group_timeout(tmp_path):
    """Rank 1 never joins the save: rank 0 raises RankLostError once the group's timeout
    (5 s) passes, naming that timeout; nothing is left behind."""
    name, msg = run_world(2, _rank_hangs, str(tmp_path), timeout=60, pg_timeout=5)[0]
    assert name == "RankLostError" and "group's timeout (5 s)" in msg, msg
    assert os.listdir(tmp_path) == []


class _FailsMidSubmit:
    """The real backend, except that its first chunk write is still running (held back in
    a thread) when the second one fails as it is submitted, as a full disk can fail a
    directory made on the submitting thread."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor
        from shardpoint_core.transactions.resolve import get_backend

        self.inner, self.calls, self.done = get_backend(), 0, []
        self._pool = ThreadPoolExecutor(1)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def write(self, handle, offset, data):
        self.calls += 1
        if self.calls == 1:

            def late():
                time.sleep(0.5)
                self.inner.write(handle, offset, data).result()
                self.done.append(True)

            return self._pool.submit(late)
        raise OSError(28, "No space left on device")


def test_a_failed_save_waits_for_its_writes_in_flight_before_it_returns(tmp_ckpt):
    """A write that fails while others are in flight: the save removes its staging
    directory only after they finished (one still writing would hold its file's space
    on a full disk, or write into a removed directory), then raises."""
    be = _FailsMidSubmit()
    with pytest.raises(sp.SaveFailedError):
        sp.save({"a": torch.ones(64), "b": torch.zeros(64)}, tmp_ckpt, backend=be)
    assert be.done == [True], "the save returned while a write was still running"
    parent = os.path.dirname(tmp_ckpt)
    assert not [n for n in os.listdir(parent) if "shardpoint-tmp" in n]
