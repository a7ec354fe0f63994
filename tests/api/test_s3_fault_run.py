"""The fault run of the trust issue: saves and overwrites of a few targets on the local S3
server through the fault proxy, with a share of replies lost (the request applied, the
answer dropped or turned into a 500), requests refused before the server saw them, and random
stalls. Afterwards every target loads the content of a save that reported success or of a
later one that reported failure (old or new, never a mix, never missing data), user objects
beside the checkpoints are all there, and recovery leaves exactly the named save prefixes.

Fast by default (8 saves); ``--runslow`` runs the issue's 1,000."""

import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import time

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")
torch = pytest.importorskip("torch")

import shardpoint as sp  # noqa: E402
from shardpoint_core.commit.object_store import ObjectStoreCommitter  # noqa: E402
from shardpoint_core.stores.s3 import S3Store  # noqa: E402
from shardpoint_testing.s3 import LOST_REPLY, FaultProxy  # noqa: E402

SAVER = textwrap.dedent("""
    import json, random, sys, torch, shardpoint as sp
    root, n, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rnd = random.Random(seed)
    for i in range(n):
        t = rnd.randrange(3)
        state = {"w": torch.full((64,), float(i)), "i": i, "rows": torch.arange(300.0) + i}
        try:
            sp.save(state, f"{root}/t{t}", overwrite=True)
            out = "ok"
        except sp.ShardpointError as e:
            out = type(e).__name__
        print(json.dumps([i, t, out]), flush=True)
""")


@pytest.mark.parametrize("saves", [8, pytest.param(1000, marks=pytest.mark.slow)])
def test_saves_and_overwrites_under_lost_replies_and_stalls(s3_env, saves):
    root = s3_env.url(s3_env.fresh_prefix("faultrun"))
    store = S3Store.from_url(root)
    user = {
        "notes.txt": b"a",
        "exports/save-20240101/model.bin": b"b",
        "t1/save-20240101/eval.json": b"c",
    }
    rnd = random.Random(7)
    lock = threading.Lock()

    def rule(method, path, n):
        with lock:
            r = rnd.random()
            stall = rnd.random() < 0.05
        if stall:
            time.sleep(rnd.uniform(0.05, 0.3))
        if r < 0.04:
            return LOST_REPLY  # applied, then the connection dropped
        if r < 0.07:
            return -500  # applied, then an InternalError answer
        if r < 0.10:
            return 0  # dropped before the server saw it
        return None

    with FaultProxy(s3_env, rule) as proxy:
        # user objects, before and beside the checkpoints (written past the proxy)
        for k, v in user.items():
            store.put(k, v)
        env = {**os.environ, **proxy.env(), "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run(
            [sys.executable, "-c", SAVER, root, str(saves), "11"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120 + 3 * saves,
        )
        injected = proxy.injected
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == saves and injected > saves // 10
    for t in range(3):
        mine = [(i, out) for i, tt, out in rows if tt == t]
        ok = [i for i, out in mine if out == "ok"]
        if not ok and ObjectStoreCommitter(store).state(f"t{t}") != "committed":
            continue  # every save of it failed, and none committed
        # the content is the last success, or a later attempt that reported failure
        allowed = set(i for i, _ in mine if not ok or i >= ok[-1])
        got = sp.load(f"{root}/t{t}")
        i = got["i"]
        assert i in allowed, (t, i, ok[-3:], mine[-5:])
        assert torch.equal(got["w"], torch.full((64,), float(i)))
        assert torch.equal(got["rows"], torch.arange(300.0) + i)
    for k, v in user.items():
        assert store.get(k) == v, k
    c = ObjectStoreCommitter(store)
    later = time.time() + 3600
    for lo in c.leftovers("", now=later):
        assert c.discard(lo.path, now=later)
    for t in range(3):
        named = {e.array.split("/")[0] for e in sp.read_metadata(f"{root}/t{t}").tensors.values()}
        tops = {i.key.split("/")[1] for i in store.list(f"t{t}/")}
        assert tops - {"manifest.msgpack", "save-20240101"} == named, (t, tops)
