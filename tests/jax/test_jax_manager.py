"""shardpoint_jax.CheckpointManager: retention, best-k, resume, metrics, overwrite, crash
leftovers (as real crashes leave them, and a real SIGKILL), async saves, one root shared with
the PyTorch reference's manager in both directions (bitwise), and a 2-process JAX job."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

pytest.importorskip("jax", reason="shardpoint_jax needs jax (pip install -e '.[jax]')")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

import shardpoint_jax as spj  # noqa: E402
from shardpoint_jax.launch import run_processes  # noqa: E402
from shardpoint_jax.manager import METRICS_KEY  # noqa: E402
from shardpoint_testing.tensors import same_bits  # noqa: E402


def _steps_on_disk(root) -> list:
    """Everything in ``root``: committed steps only once a save or load cleaned it."""
    return sorted(os.listdir(root))


def _names(*steps) -> list:
    return [f"step_{s:08d}" for s in steps]


def model_keep(steps: dict, max_to_keep, keep_every, keep_best, mode) -> set:
    """The retention rule, written out plainly: ``steps`` maps step -> loss (or None)."""
    order = sorted(steps)
    keep = {order[-1]} | set(order if max_to_keep is None else order[-max_to_keep:])
    keep |= {s for s in order if keep_every and s % keep_every == 0}
    if keep_best:
        sign = 1 if mode == "min" else -1
        scored = sorted(
            (s for s in order if steps[s] is not None), key=lambda s: (sign * steps[s], -s)
        )
        keep |= set(scored[:keep_best])
    return keep


class ManagerMachine(RuleBasedStateMachine):
    """Saves, overwrites, crashes leaving what they leave, restarts and loads, against a
    trivially correct model of what must be committed on disk."""

    @initialize(
        max_to_keep=st.sampled_from([None, 1, 2]),
        keep_every=st.sampled_from([None, 3]),
        best=st.sampled_from([None, ("min", None), ("max", 2)]),
    )
    def setup(self, max_to_keep, keep_every, best):
        self.root = tempfile.mkdtemp(prefix="spj-mgr-")
        mode, keep_best = best or ("min", None)
        self.kw = dict(
            max_to_keep=max_to_keep,
            keep_every=keep_every,
            best_mode=mode,
            best_metric="loss" if best else None,
            keep_best=keep_best,
        )
        self.keep_best = keep_best if best else None  # best_metric alone keeps none extra
        self.mgr = spj.CheckpointManager(self.root, **self.kw)
        self.foreign: list = []  # names a person made in root: never the manager's
        self.disk: dict = {}  # step -> (value, loss): what must be committed
        self.next_step = 1
        self.moved_aside = None  # a step hidden by a crashed overwrite, until put back

    def teardown(self):
        shutil.rmtree(getattr(self, "root", "/nonexistent"), ignore_errors=True)

    def _saved(self):
        keep = model_keep(
            {s: v[1] for s, v in self.disk.items()},
            self.kw["max_to_keep"],
            self.kw["keep_every"],
            self.keep_best,
            self.kw["best_mode"],
        )
        self.disk = {s: v for s, v in self.disk.items() if s in keep}
        self.moved_aside = None
        assert _steps_on_disk(self.root) == sorted(_names(*self.disk) + self.foreign)

    @rule(
        value=st.integers(-100, 100),
        loss=st.one_of(st.none(), st.integers(0, 5)),
        skip=st.integers(1, 3),
    )
    def save(self, value, loss, skip):
        step = self.next_step + skip - 1
        self.next_step = step + 1
        metrics = None if loss is None else {"loss": float(loss)}
        self.mgr.save(step, {"w": jnp.full((3,), value, jnp.int32), "step": step}, metrics=metrics)
        self.disk[step] = (value, None if loss is None else float(loss))
        self._saved()

    @precondition(lambda self: self.disk)
    @rule(value=st.integers(-100, 100))
    def overwrite_latest(self, value):
        step = max(self.disk)
        with pytest.raises(spj.CheckpointExistsError):
            self.mgr.save(step, {"w": jnp.zeros(3, jnp.int32), "step": step})
        self.mgr.save(step, {"w": jnp.full((3,), value, jnp.int32), "step": step}, force=True)
        self.disk[step] = (value, None)
        self._saved()

    @rule(
        kind=st.sampled_from(["staging", "half_step", "half_delete", "mid_overwrite"]),
        data=st.data(),
    )
    def crash_and_restart(self, kind, data):
        """Leave what a process killed at that point leaves, then start a new manager."""
        hidden = os.path.join(self.root, f".step_{self.next_step:08d}.shardpoint-tmp-1a2b3c")
        if kind == "staging":  # killed while writing chunks
            os.makedirs(os.path.join(hidden, "tensors", "w", "c"), exist_ok=True)
            open(os.path.join(hidden, "tensors", "w", "zarr.json"), "w").close()
        elif kind == "half_step":  # files but no manifest, under a step-like name
            name = f"step_{self.next_step}"  # not the manager's step format
            if name not in self.foreign:
                self.foreign.append(name)
            os.makedirs(os.path.join(self.root, name, "tensors", "w"), exist_ok=True)
        visible = sorted(s for s in self.disk if s != self.moved_aside)
        if kind == "half_delete" and visible:  # killed during retention's rmtree
            victim = data.draw(st.sampled_from(visible))
            os.rename(
                self.mgr.path(victim),
                os.path.join(self.root, f".step_{victim:08d}.shardpoint-tmp-dead01"),
            )
            del self.disk[victim]
        elif kind == "mid_overwrite" and visible and self.moved_aside is None:
            victim = data.draw(st.sampled_from(visible))  # between the commit's renames
            os.rename(
                self.mgr.path(victim),
                os.path.join(self.root, f".step_{victim:08d}.shardpoint-old-beef02"),
            )
            self.moved_aside = victim
            os.makedirs(
                os.path.join(self.root, f".step_{victim:08d}.shardpoint-tmp-beef02", "tensors"),
                exist_ok=True,
            )
        self.mgr = spj.CheckpointManager(self.root, **self.kw)

    @rule()
    def load_latest(self):
        if not self.disk:
            with pytest.raises(spj.CheckpointNotFoundError):
                self.mgr.load()
            return
        latest = max(self.disk)
        out = self.mgr.load()
        assert sorted(out) == ["step", "w"] and out["step"] == latest
        assert np.asarray(out["w"]).tolist() == [self.disk[latest][0]] * 3
        self.moved_aside = None
        assert _steps_on_disk(self.root) == sorted(_names(*self.disk) + self.foreign)

    @invariant()
    def disk_matches_model(self):
        if not hasattr(self, "mgr"):
            return
        visible = sorted(s for s in self.disk if s != self.moved_aside)
        assert self.mgr.all_steps() == visible
        assert self.mgr.latest_step() == (visible[-1] if visible else None)
        for s in visible:
            assert self.mgr.metrics(s).get("loss") == self.disk[s][1]
        if self.kw["best_metric"]:
            sign = 1 if self.kw["best_mode"] == "min" else -1
            scored = [s for s in visible if self.disk[s][1] is not None]
            want = min(scored, key=lambda s: (sign * self.disk[s][1], -s)) if scored else None
            assert self.mgr.best_step() == want


ManagerMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=10, deadline=None)
TestManagerStateful = ManagerMachine.TestCase


def test_arguments_are_checked(tmp_path):
    for kw, word in (
        ({"max_to_keep": 0}, "max_to_keep"),
        ({"keep_every": 1.5}, "keep_every"),
        ({"keep_best": 2}, "best_metric"),
        ({"best_metric": "loss", "best_mode": "lowest"}, "best_mode"),
    ):
        with pytest.raises(spj.InvalidRequestError, match=word):
            spj.CheckpointManager(tmp_path, **kw)
    mgr = spj.CheckpointManager(tmp_path)
    with pytest.raises(spj.UnsupportedValueError, match="reserved"):
        mgr.save(1, {METRICS_KEY: 1}, metrics={"loss": 1.0})
    with pytest.raises(spj.UnsupportedValueError, match="dict tree"):
        mgr.save(1, [jnp.zeros(2)], metrics={"loss": 1.0})
    with pytest.raises(spj.UnsupportedValueError, match="shape"):
        mgr.save(1, {"w": jnp.zeros(2)}, metrics={"loss": jnp.zeros(2)})
    for bad in (-1, True, 1.0, "3"):
        with pytest.raises(spj.InvalidKeyError, match="step"):
            mgr.save(bad, {"w": jnp.zeros(2)})
    with pytest.raises(spj.CheckpointNotFoundError, match="nothing to resume"):
        mgr.load()
    assert mgr.all_steps() == [] and mgr.latest_step() is None and mgr.best_step() is None
    assert _steps_on_disk(tmp_path) == []  # refused before anything was written


def test_retention_keeps_newest_and_every_kth(tmp_path):
    with spj.CheckpointManager(tmp_path, max_to_keep=2, keep_every=3) as mgr:
        for step in range(1, 8):
            mgr.save(step, {"w": jnp.full((4,), step, jnp.int32)})
            want = sorted({s for s in range(1, step + 1) if s % 3 == 0} | {step - 1, step} - {0})
            assert mgr.all_steps() == want
    assert _steps_on_disk(tmp_path) == _names(3, 6, 7)


@pytest.mark.parametrize("mode", ["min", "max"])
def test_keep_best_by_metric(tmp_path, mode):
    losses = {1: 0.5, 2: 0.1, 3: float("nan"), 4: 0.9, 5: 0.3, 6: 0.4}
    mgr = spj.CheckpointManager(
        tmp_path, max_to_keep=1, best_metric="loss", best_mode=mode, keep_best=2
    )
    for step, loss in losses.items():
        mgr.save(step, {"w": jnp.ones(2)}, metrics={"loss": loss, "acc": 0.5})
    # the newest (6) always, and the two best finite ones: NaN never ranks
    want = {"min": [2, 5, 6], "max": [1, 4, 6]}[mode]
    assert mgr.all_steps() == want
    assert mgr.best_step() == {"min": 2, "max": 4}[mode]
    default = spj.CheckpointManager(tmp_path, best_metric="loss", best_mode=mode)
    assert default.keep_best is None  # best_metric alone only ranks (issue 21)
    assert default.retained([1, 2, 4, 5, 6]) == {1, 2, 4, 5, 6}


def test_resume_latest_with_a_target_and_metrics_round_trip(tmp_path):
    w = jax.random.normal(jax.random.key(0), (16, 8), jnp.bfloat16)
    with spj.CheckpointManager(tmp_path) as mgr:
        mgr.save(10, {"w": w, "step": 10}, metrics={"loss": 2.5})
        mgr.save(
            20,
            {"w": w * 2, "step": 20},
            metrics={
                "loss": jnp.float32(1.5),
                "lr": np.float64(1e-3),
                "tokens": 123,
                "tag": "warm",
                "grad": np.array(0.25, np.float32),
            },
        )
    again = spj.CheckpointManager(tmp_path, best_metric="loss")  # a restarted job
    assert again.latest_step() == 20 and again.all_steps() == [10, 20]
    m = again.metrics(20)
    assert m == {"loss": 1.5, "lr": 1e-3, "tokens": 123, "tag": "warm", "grad": 0.25}
    assert all(type(v) in (float, int, str) for v in m.values())  # plain values
    assert again.metrics(10) == {"loss": 2.5} and again.best_step() == 20
    out = again.load()
    assert sorted(out) == ["step", "w"] and out["step"] == 20  # metrics not returned
    assert same_bits(out["w"], w * 2) and out["w"].dtype == jnp.bfloat16
    tgt = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype), "step": 0}
    got = again.load(10, tgt)
    assert same_bits(got["w"], w) and got["step"] == 10
    asked = again.load(20, {"step": 0, METRICS_KEY: {"loss": 0.0}})  # unless the target asks
    assert asked == {"step": 20, METRICS_KEY: {"loss": 1.5}}
    with pytest.raises(spj.LayoutMismatchError):
        again.load(20, {"missing": 0})
    assert again.load(20, {"missing": 7}, strict=False) == {"missing": 7}
    with pytest.raises(spj.CheckpointNotFoundError, match=r"committed steps: \[10, 20\]"):
        again.load(15)
    # metrics live in the manifest, no side file
    assert _steps_on_disk(tmp_path / "step_00000020") == [
        "manifest.msgpack",
        "packed",
    ]  # the packed layout (the default): its data objects
    assert len(_steps_on_disk(tmp_path / "step_00000020" / "packed")) == 1


def test_force_overwrites_and_refusal_keeps_the_step(tmp_path):
    mgr = spj.CheckpointManager(tmp_path)
    mgr.save(3, {"w": jnp.ones(4)}, metrics={"loss": 1.0})
    with pytest.raises(spj.CheckpointExistsError, match="force=True"):
        mgr.save(3, {"w": jnp.zeros(4)})
    assert same_bits(mgr.load(3)["w"], jnp.ones(4)) and mgr.metrics(3) == {"loss": 1.0}
    mgr.save(3, {"w": jnp.zeros(4)}, metrics={"loss": 0.5}, force=True)
    assert same_bits(mgr.load(3)["w"], jnp.zeros(4)) and mgr.metrics(3) == {"loss": 0.5}
    assert _steps_on_disk(tmp_path) == _names(3)


@pytest.mark.parametrize("where", ["files", "memory"])
def test_the_manager_removes_and_locks_through_its_saves_committer(tmp_path, where):
    """One committer per root: the one the manager's saves publish through (the shared
    backend of the root's kind, the torch front end's too), not another one of its own."""
    from shardpoint_core.transactions.resolve import backend_for
    from shardpoint_core.transactions.writer import CheckpointWriter

    root = str(tmp_path) if where == "files" else f"memory://jax-mgr-{os.getpid()}/run"
    mgr = spj.CheckpointManager(root, max_to_keep=1)
    with CheckpointWriter.begin(mgr.path(1)) as w:  # the writer a save begins
        assert mgr._steps.committer is w.backend.committer is backend_for(mgr.root).committer
    mgr.save(1, {"w": jnp.ones(2)})
    mgr.save(2, {"w": jnp.zeros(2)})
    assert mgr.all_steps() == [2]


def _crash_copy(src: str, dst: str, manifest: bool) -> None:
    """A real checkpoint's files under ``dst``, as a crash leaves them (with or without the
    manifest, which a save writes last)."""
    shutil.copytree(src, dst)
    if not manifest:
        os.remove(os.path.join(dst, "manifest.msgpack"))


def test_crash_leftovers_are_ignored_then_cleaned(tmp_path):
    root = tmp_path / "root"
    mgr = spj.CheckpointManager(root)
    for s in (1, 2, 3):
        mgr.save(s, {"w": jnp.full((8,), s, jnp.float32), "step": s})
    spj.save(str(tmp_path / "full"), {"w": jnp.full((8,), 9.0), "step": 9})
    full = str(tmp_path / "full")
    # killed while writing step 4: its staging directory, chunks but no manifest
    _crash_copy(full, str(root / ".step_00000004.shardpoint-tmp-1a2b3c"), manifest=False)
    # killed between the two renames of an overwrite of step 2: the old step moved aside,
    # the new one complete in staging, nothing at step_00000002
    os.rename(root / "step_00000002", root / ".step_00000002.shardpoint-old-beef02")
    _crash_copy(full, str(root / ".step_00000002.shardpoint-tmp-beef02"), manifest=True)
    # killed during retention's rmtree of step 1: renamed to a hidden name first
    os.rename(root / "step_00000001", root / ".step_00000001.shardpoint-tmp-dead01")
    # a step directory whose save never committed (made by hand or by another tool): no
    # commit leaves one (a commit renames a whole checkpoint into place), so it is not the
    # manager's and stays
    _crash_copy(full, str(root / "step_00000005"), manifest=False)
    before = _steps_on_disk(root)

    again = spj.CheckpointManager(root)
    assert again.all_steps() == [3] and again.latest_step() == 3  # only committed ones
    assert _steps_on_disk(root) == before  # constructing and reading never clean
    assert again.load()["step"] == 3  # a load cleans first
    assert _steps_on_disk(root) == _names(2, 3, 5)  # step 2 put back, leftovers gone
    assert again.load(2)["step"] == 2  # the previous version, as it was
    os.rename(root / "step_00000003", root / ".step_00000003.shardpoint-old-feed03")
    again.save(4, {"step": 4})  # and a save cleans too
    assert _steps_on_disk(root) == _names(2, 3, 4, 5) and again.load(3)["step"] == 3


_KILLED = textwrap.dedent("""
    import sys, jax.numpy as jnp, shardpoint_jax as spj
    mgr = spj.CheckpointManager(sys.argv[1], max_to_keep=2)
    start = (mgr.latest_step() or 0) + 1
    for step in range(start, start + 1000):
        mgr.save(step, {"w": jnp.full((128, 128), float(step)), "step": step},
                 metrics={"loss": 1.0 / step})
        print(step, flush=True)
""")


def test_sigkill_mid_save_keeps_the_last_step_and_the_restart_cleans(tmp_path):
    """Real SIGKILLs at random moments of a save loop; each restart resumes from the newest
    committed step, cleans what the kill left and keeps retention going."""
    import time

    rnd = random.Random(3)
    root = str(tmp_path / "ckpt")
    for _round in range(2):
        p = subprocess.Popen(
            [sys.executable, "-c", _KILLED, root],
            stdout=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )
        try:
            seen = [int(p.stdout.readline()) for _ in range(rnd.randint(2, 4))]
            time.sleep(rnd.uniform(0.0, 0.02))  # somewhere inside one of the next saves
            p.send_signal(signal.SIGKILL)
        finally:
            p.kill()
            p.wait(timeout=30)
        mgr = spj.CheckpointManager(root, max_to_keep=2)
        latest = mgr.latest_step()
        assert latest is not None and latest >= seen[-1]
        assert mgr.load()["step"] == latest
        assert all(not n.startswith(".") for n in os.listdir(root))  # cleaned by the load
        for s in mgr.all_steps():
            out = mgr.load(s)
            assert out["step"] == s
            assert same_bits(out["w"], jnp.full((128, 128), float(s)))
            assert mgr.metrics(s) == {"loss": 1.0 / s}
        assert len(mgr.all_steps()) <= 3  # at most one extra: the kill fell before retention


def test_async_saves_retain_after_commit_and_wait_on_close(tmp_path):
    host = np.zeros((256, 256), np.float32)
    with spj.CheckpointManager(tmp_path, max_to_keep=1, async_save=True) as mgr:
        for step in (1, 2, 3):
            w = jnp.full((256, 256), float(step))
            host[...] = step
            h = mgr.save(step, {"w": w, "host": host, "step": step}, metrics={"loss": float(step)})
            assert isinstance(h, spj.AsyncSave)
            w.delete()  # the caller drops its arrays right away
            host[...] = -1.0  # and mutates its numpy state
            if step > 1:  # save(step) waited for save(step - 1), then applied retention
                assert step - 1 in mgr.all_steps() and step - 2 not in mgr.all_steps()
        mgr.wait()
        assert h.done() and mgr.all_steps() == [3]
        h4 = mgr.save(4, {"step": 4})
    assert h4.done()  # leaving the block waited for the last save
    assert mgr.all_steps() == [4] and _steps_on_disk(tmp_path) == _names(4)
    mgr.save(5, {"w": jnp.full((256, 256), 5.0), "host": host, "step": 5})
    mgr.close()
    out = mgr.load()
    assert out["step"] == 5 and same_bits(out["w"], jnp.full((256, 256), 5.0))
    assert (out["host"] == -1.0).all() and mgr.all_steps() == [5]


def test_one_root_shared_with_the_pytorch_manager_both_ways(tmp_path):
    torch = pytest.importorskip("torch")
    sp = pytest.importorskip("shardpoint")
    g = torch.Generator().manual_seed(0)
    tw = torch.randn(6, 10, generator=g).to(torch.bfloat16)
    tb = torch.randn(10, generator=g)
    with sp.CheckpointManager(tmp_path, best_metric="loss") as tmgr:
        tmgr.save(100, {"model": {"w": tw, "b": tb}, "step": 100}, metrics={"loss": 0.75})
        tmgr.save(200, {"model": {"w": tw * 2, "b": tb}, "step": 200}, metrics={"loss": 0.25})
    # torch -> JAX: the same steps, metrics and bytes
    jmgr = spj.CheckpointManager(tmp_path, max_to_keep=2, best_metric="loss")
    assert jmgr.all_steps() == [100, 200] and jmgr.best_step() == 200
    assert jmgr.metrics(100) == {"loss": 0.75}
    got = jmgr.load(100)
    assert sorted(got) == ["model", "step"] and got["step"] == 100
    assert same_bits(got["model"]["w"], tw)
    assert got["model"]["w"].dtype == jnp.bfloat16
    assert same_bits(got["model"]["b"], tb)
    # JAX -> torch: a JAX step in the same root; the JAX manager's retention drops step 100
    jw = jax.random.normal(jax.random.key(1), (6, 10), jnp.bfloat16)
    jmgr.save(
        300,
        {"model": {"w": jw, "b": jnp.asarray(tb.numpy())}, "step": 300},
        metrics={"loss": jnp.float32(0.5)},
    )
    assert jmgr.all_steps() == [200, 300] and _steps_on_disk(tmp_path) == _names(200, 300)
    tmgr = sp.CheckpointManager(tmp_path, best_metric="loss", best_mode="max")
    assert tmgr.all_steps() == [200, 300] and tmgr.latest_step() == 300
    assert tmgr.metrics(300) == {"loss": 0.5} and tmgr.best_step() == 300
    out = tmgr.load()
    assert sorted(out) == ["model", "step"] and out["step"] == 300
    assert out["model"]["w"].dtype == torch.bfloat16
    assert same_bits(out["model"]["w"], jw)
    assert torch.equal(out["model"]["b"], tb)
    # and the torch manager's retention counts the JAX step as one of its own
    tmgr2 = sp.CheckpointManager(tmp_path, max_to_keep=1)
    tmgr2.save(400, {"step": 400})
    assert jmgr.all_steps() == [400]
    assert ml_dtypes.bfloat16 == np.asarray(jw).dtype


_MP = """
import json
import numpy as np, shardpoint_jax as spj
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
pid = jax.process_index()
mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("dp", "tp"))
def full(step):
    return np.arange(64, dtype=np.float32).reshape(8, 8) * step
def put(a):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, P("dp", "tp")),
                                        lambda i: a[i])
res = {}
mgr = spj.CheckpointManager(ROOT, max_to_keep=2, keep_every=2, best_metric="loss")
for step in range(1, 6):
    mgr.save(step, {"w": put(full(step)), "step": step}, metrics={"loss": 1.0 / step})
    res.setdefault("after", []).append(mgr.all_steps())   # retention done on every process
for kind, call in (("exists", lambda: mgr.save(5, {"w": put(full(0))})),
                   ("differ", lambda: mgr.save(6 + pid, {"step": 6})),
                   ("bad", lambda: mgr.save(-1 if pid else 6, {"step": 6}))):
    try:
        call()
        res[kind] = None
    except spj.ShardpointError as e:
        res[kind] = type(e).__name__
amgr = spj.CheckpointManager(ROOT, max_to_keep=2, keep_every=2, async_save=True)
amgr.save(6, {"w": put(full(6)), "step": 6})
amgr.save(7, {"w": put(full(7)), "step": 7})
amgr.close()
res["final"] = amgr.all_steps()
tgt = {"w": jax.ShapeDtypeStruct((8, 8), np.float32,
                                 sharding=NamedSharding(mesh, P("tp", None))), "step": 0}
got = amgr.load(target=tgt)
res["step"] = got["step"]
res["ok"] = all(np.asarray(s.data).tobytes() == full(7)[s.index].tobytes()
                for s in got["w"].addressable_shards)
res["best"] = spj.CheckpointManager(ROOT, best_metric="loss").best_step()
print(json.dumps(res))
"""


def test_two_processes_save_retain_and_load(tmp_path):
    root = tmp_path / "ckpt"
    outs = run_processes(_MP.replace("ROOT", repr(str(root))), 2, 2, timeout=120)
    res = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    assert res[0]["after"] == res[1]["after"] == [[1], [1, 2], [2, 3], [2, 3, 4], [2, 4, 5]]
    for r in res:  # process 0 decided, every process raised the same error
        assert (r["exists"], r["differ"], r["bad"]) == (
            "CheckpointExistsError",
            "InvalidOptionError",
            "InvalidKeyError",
        )
        assert r["final"] == [2, 4, 6, 7] and r["step"] == 7 and r["ok"]
        assert r["best"] == 4  # 5 was best, but the async manager ranks no metric
    assert _steps_on_disk(root) == _names(2, 4, 6, 7)


@pytest.mark.parametrize("where", ["files", "memory"])
def test_a_checkpoint_saved_by_hand_under_the_root_is_reported_never_counted(
    tmp_path, where, caplog
):
    """``spj.save(tree, root + "/step_7")`` beside a manager's steps: not one of its names
    (step_00000007), so never a step, never removed by retention; reported once (as the torch
    manager does, through the core's StepRoot)."""
    import uuid

    root = str(tmp_path / "run") if where == "files" else f"memory://jm-{uuid.uuid4().hex[:8]}/run"
    mgr = spj.CheckpointManager(root, max_to_keep=1)
    mgr.save(1, {"w": jnp.arange(3)})
    spj.save(root + "/step_7", {"w": jnp.ones(3)})
    with caplog.at_level("WARNING", logger="shardpoint"):
        mgr.save(2, {"w": jnp.arange(3) + 2})
        mgr.save(3, {"w": jnp.arange(3) + 3})
    assert mgr.all_steps() == [3]
    assert mgr.stray == ["step_7"] and mgr.stray_checkpoints() == ["step_7"]
    assert sum("step_7 is a committed checkpoint" in r.getMessage() for r in caplog.records) == 1
    assert same_bits(spj.load(root + "/step_7")["w"], jnp.ones(3))
