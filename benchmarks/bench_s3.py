"""S3 save/load benchmark: shardpoint against the server's raw PUT/GET limit and PyTorch DCP
through fsspec/s3fs, same run, same server.

    python benchmarks/bench_s3.py                      # mixed (scale 0.25) + uniform 16 x 4 MiB
    python benchmarks/bench_s3.py --scale 1 --uniform 32x32 --repeat 5
    python benchmarks/bench_s3.py --endpoint http://host:9000 --bucket b   # a server of yours
    python benchmarks/bench_s3.py --latency-ms 20      # + 20 ms per request, every client
    python benchmarks/bench_s3.py --packed --cap-mib 1 # packed, each state over many objects
    python benchmarks/bench_s3.py --json benchmarks/results/bench_s3.json   # + as data

The server is moto's standalone S3 server on loopback, started here (or ``--endpoint``): an
in-memory Python server, so the figures measure what a client gets from *this* server, not
from AWS; the raw limit row says what that is. Rows, interleaved run by run (medians, min-max):
- raw: the objects of shardpoint's own checkpoint (same count, same sizes: its chunk objects,
  zarr.json and manifest objects), PUT and then GET with boto3 at the same concurrency as
  shardpoint (``--concurrency``): the server's limit for this checkpoint; and "raw, chunks
  only": the chunk objects alone (one per tensor here), what a format with no per-array
  metadata objects would need;
- shardpoint: ``sp.save(state, "s3://...")`` to a fresh path each round (as DCP and the raw
  rows write fresh keys; ``overwrite=True`` would add the deletion of the old checkpoint,
  one LIST and a DELETE per 1,000 objects after the commit) and ``sp.load`` of the whole
  state; requests per checkpoint and bytes moved are counted on the client;
- DCP: ``dcp.save`` with ``FsspecWriter`` (s3fs) at its best ``thread_count`` of 1/4/8/16
  (each run in every round) and ``dcp.load`` with ``FsspecReader``, in a child process. s3fs
  needs an aiobotocore whose botocore pin clashes with boto3's, so it is imported from
  ``--s3fs-path`` (``pip install --target DIR s3fs``), a directory of its own; without one the
  DCP rows are skipped and the table says so.

Round trips ("depth"): each request's start and end are logged on the client, and a request
is one round trip deeper than the deepest one that had ended when it started; a save's or a
load's depth is its longest such chain (the raw rows are 1 deep). ``--latency-ms`` adds that
much before every request of every client (shardpoint's, the raw rows', not DCP's), as a
distant server's round trip would: on loopback a round trip costs what the server takes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import bench_results as br  # noqa: E402
import bench_tools as bt  # noqa: E402

DCP_CHILD = r"""
import json, os, sys, time
sys.path.insert(0, os.environ["S3FS_PATH"])
import torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
sys.path.insert(0, os.environ["BENCH_DIR"])
import bench_tools as bt
spec = json.loads(sys.argv[1])
state = bt.mixed_state(spec["scale"], layers=spec["layers"]) if spec["state"] == "mixed" else \
    bt.uniform_state(spec["n"], spec["mib"])
flat = bt.flat(state)
out = {}
warm = spec["url"] + "-warm"
dcp.save({"x": torch.zeros(4)}, storage_writer=FsspecWriter(warm, thread_count=1,
                                                            sync_files=False))
for t in spec["threads"]:
    url = f"{spec['url']}-t{t}"
    t0 = time.perf_counter()
    dcp.save(flat, storage_writer=FsspecWriter(url, thread_count=t, sync_files=False))
    out[f"save_t{t}"] = time.perf_counter() - t0
like = {k: torch.empty_like(v) for k, v in flat.items()}
t0 = time.perf_counter()
dcp.load(like, storage_reader=FsspecReader(f"{spec['url']}-t{spec['threads'][-1]}"))
out["load"] = time.perf_counter() - t0
assert all(torch.equal(like[k], flat[k]) for k in flat)
print(json.dumps(out))
"""


def add_latency(client, seconds: float) -> None:
    """Every request of ``client`` waits ``seconds`` before it is sent."""
    if seconds > 0:
        client.meta.events.register("before-send.s3.*", lambda **kw: time.sleep(seconds))


class Counter:
    """Requests and payload bytes a boto3 client sent and received, and each request's start
    and end (botocore events), for the round trips in sequence (:meth:`depth`)."""

    def __init__(self, client) -> None:
        self.requests = 0
        self.sent = 0
        self.received = 0
        self.spans: list = []  # [start, end] per request, in order sent
        self._lock = threading.Lock()
        self._mine = threading.local()
        client.meta.events.register_first("before-send.s3.*", self._send)
        client.meta.events.register("after-call.s3.*", self._done)

    def _send(self, request, **kw):
        body = request.body
        n = (
            len(body)
            if isinstance(body, (bytes, bytearray))
            else int(request.headers.get("Content-Length", 0) or 0)
        )
        span = self._mine.span = [time.perf_counter(), None]
        with self._lock:
            self.requests += 1
            self.sent += n if request.method == "PUT" else 0
            self.spans.append(span)

    def _done(self, http_response, parsed, event_name, **kw):
        self._mine.span[1] = time.perf_counter()
        if event_name.endswith(".GetObject"):
            with self._lock:
                self.received += int(parsed.get("ContentLength", 0) or 0)

    def snap(self):
        with self._lock:
            return self.requests, self.sent, self.received, len(self.spans)

    def depth(self, first: int, stop: int) -> int:
        """Round trips in sequence among the requests of spans ``first`` to ``stop``."""
        with self._lock:
            spans = sorted(self.spans[first:stop], key=lambda s: s[0])
        depth: list = []
        for i, (start, _end) in enumerate(spans):
            depth.append(
                1
                + max(
                    (
                        depth[j]
                        for j in range(i)
                        if spans[j][1] is not None and spans[j][1] <= start
                    ),
                    default=0,
                )
            )
        return max(depth, default=0)


def med(v):
    return statistics.median(v) if v else None


def fmt(v, nbytes):
    if not v:
        return "-"
    m = med(v)
    return f"{m:7.3f} s ({min(v):.3f}-{max(v):.3f})  {nbytes / m / 2**20:7.1f} MiB/s"


def raw_round(
    client, bucket: str, prefix: str, sizes: list, conc: int, counter: "Counter"
) -> tuple:
    """PUT then GET objects of ``sizes`` with ``conc`` threads: the server's limit; (PUT s,
    GET s, PUT round trips in sequence, GET round trips)."""
    blobs = {n: os.urandom(n) for n in set(sizes)}
    keys = [f"{prefix}/raw-{uuid.uuid4().hex[:8]}/{i}" for i in range(len(sizes))]
    with ThreadPoolExecutor(conc) as ex:
        s0 = counter.snap()[3]
        t0 = time.perf_counter()
        list(
            ex.map(
                lambda kn: client.put_object(Bucket=bucket, Key=kn[0], Body=blobs[kn[1]]),
                zip(keys, sizes),
            )
        )
        put = time.perf_counter() - t0
        s1 = counter.snap()[3]
        t0 = time.perf_counter()
        list(ex.map(lambda k: client.get_object(Bucket=bucket, Key=k)["Body"].read(), keys))
        get = time.perf_counter() - t0
        s2 = counter.snap()[3]
    for i in range(0, len(keys), 1000):
        client.delete_objects(
            Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]]}
        )
    return put, get, counter.depth(s0, s1), counter.depth(s1, s2)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=0.25, help="mixed state scale (1: ~1.2 GB)")
    ap.add_argument("--uniform", default="16x4", help="N x MiB tensors of the uniform state")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    ap.add_argument("--threads", default="1,4,8,16", help="DCP thread_count settings")
    ap.add_argument("--s3fs-path", default=os.environ.get("S3FS_PATH", "/tmp/s3_20_s3fs"))
    ap.add_argument("--endpoint", default=None)
    ap.add_argument("--bucket", default=None)
    ap.add_argument(
        "--latency-ms",
        type=float,
        default=0.0,
        help="added before every request (shardpoint and raw rows)",
    )
    ap.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write every row's measurements (seconds, bytes/s), medians, "
        "min-max and ratios, the run's parameters and machine, and the raw "
        "samples (under 'samples') to PATH",
    )
    ap.add_argument(
        "--packed",
        action="store_true",
        help="shardpoint rows in the packed layout (format 1.4, PackedBackend); "
        "the raw rows then PUT/GET its objects (data objects + manifest)",
    )
    ap.add_argument(
        "--cap-mib",
        type=float,
        default=None,
        help="with --packed: the data object size cap in MiB (default: PackedBackend's, "
        "16 MiB on object stores); a smaller one spreads a state over more objects, as a "
        "bigger checkpoint is",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny states (mixed at 1/64 with 2 layers, uniform 4 x 1 MiB), one "
        "round: a smoke test",
    )
    a = ap.parse_args(argv)
    if a.quick:
        a.scale, a.uniform, a.repeat = 1 / 64, "4x1", 1
    layers = 2 if a.quick else 8

    server = None
    if a.endpoint is None:
        from shardpoint_testing.s3 import S3Server

        server = S3Server().start()
        os.environ.update(server.env())
        bucket = server.bucket
    else:
        os.environ["AWS_ENDPOINT_URL"] = a.endpoint
        bucket = a.bucket
    import shardpoint as sp
    from shardpoint_core.transactions.backend import ZarrBackend

    run = f"bench-{uuid.uuid4().hex[:8]}"
    be = ZarrBackend(concurrency=a.concurrency)
    if a.packed:
        from shardpoint_core.transactions.packed import PackedBackend

        be = PackedBackend(be, cap=int(a.cap_mib * 2**20) if a.cap_mib else None)
    store, _ = be.locate(f"s3://{bucket}/x")
    counter = Counter(store.client)
    import boto3
    from botocore.config import Config

    raw_client = boto3.client(
        "s3", config=Config(max_pool_connections=a.concurrency, retries={"mode": "standard"})
    )
    raw_counter = Counter(raw_client)
    add_latency(store.client, a.latency_ms / 1000)
    add_latency(raw_client, a.latency_ms / 1000)
    n, mib = (float(x) for x in a.uniform.split("x"))
    states = [
        ("mixed", {"scale": a.scale}, bt.mixed_state(a.scale, layers=layers)),
        ("uniform", {"n": int(n), "mib": mib}, bt.uniform_state(int(n), mib)),
    ]
    threads = [int(t) for t in a.threads.split(",")]
    dcp_ok = os.path.isdir(os.path.join(a.s3fs_path, "s3fs"))
    sp.save({"x": torch.zeros(4)}, f"s3://{bucket}/{run}/warm", backend=be)  # imports, pools
    sp.load(f"s3://{bucket}/{run}/warm", backend=be)
    results = {}
    for name, _spec, state in states:
        nbytes = sum(v.numel() * v.element_size() for v in bt.flat(state).values())
        base = f"s3://{bucket}/{run}/{name}"
        r = results[name] = {
            "bytes": nbytes,
            "raw_put": [],
            "raw_get": [],
            "save": [],
            "rawc_put": [],
            "rawc_get": [],
            "load": [],
            "dcp_load": [],
            **{f"dcp_save_t{t}": [] for t in threads},
        }
        for i in range(a.repeat):
            c0 = counter.snap()
            t0 = time.perf_counter()
            url = f"{base}-{i}"  # a fresh path, as DCP's and the raw rows' are
            sp.save(state, url, backend=be)
            r["save"].append(time.perf_counter() - t0)
            c1 = counter.snap()
            t0 = time.perf_counter()
            back = sp.load(url, backend=be)
            r["load"].append(time.perf_counter() - t0)
            c2 = counter.snap()
            assert all(
                torch.equal(x, y) for x, y in zip(bt.flat(back).values(), bt.flat(state).values())
            )
            del back
            r["save_requests"], r["save_bytes"] = c1[0] - c0[0], c1[1] - c0[1]
            r["load_requests"], r["load_bytes"] = c2[0] - c1[0], c2[2] - c1[2]
            r.setdefault("save_depth", []).append(counter.depth(c0[3], c1[3]))
            r.setdefault("load_depth", []).append(counter.depth(c1[3], c2[3]))
            prefix = url[len(f"s3://{bucket}/") :]
            every = [o for o in store.list(prefix + "/")]
            sizes = [o.size for o in every if "/c/" in o.key or "/packed/" in o.key]
            r["objects"], r["all_objects"] = len(sizes), len(every)
            put, get, dput, dget = raw_round(
                raw_client,
                bucket,
                f"{run}/{name}-raw",
                [o.size for o in every],
                a.concurrency,
                raw_counter,
            )
            r["raw_put"].append(put)
            r["raw_get"].append(get)
            r["raw_put_depth"], r["raw_get_depth"] = dput, dget
            r["raw_bytes"] = sum(o.size for o in every)
            put, get, _dp, _dg = raw_round(
                raw_client, bucket, f"{run}/{name}-rawc", sizes, a.concurrency, raw_counter
            )
            r["rawc_put"].append(put)
            r["rawc_get"].append(get)
            r["rawc_bytes"] = sum(sizes)
            be.committer.remove(url)  # untimed: an overwrite would also delete the old one
            if dcp_ok:
                env = dict(
                    os.environ,
                    S3FS_PATH=a.s3fs_path,
                    BENCH_DIR=os.path.dirname(os.path.abspath(__file__)),
                )
                child = {
                    "state": name,
                    "url": f"s3://{bucket}/{run}/dcp-{name}-{i}",
                    "threads": threads,
                    "scale": a.scale,
                    "n": int(n),
                    "mib": mib,
                    "layers": layers,
                }
                p = subprocess.run(
                    [sys.executable, "-c", DCP_CHILD, json.dumps(child)],
                    capture_output=True,
                    text=True,
                    env=env,
                    timeout=1800,
                )
                if p.returncode != 0:
                    print(f"DCP failed: {p.stderr[-2000:]}", file=sys.stderr)
                    dcp_ok = False
                else:
                    d = json.loads(p.stdout.strip().splitlines()[-1])
                    for t in threads:
                        r[f"dcp_save_t{t}"].append(d[f"save_t{t}"])
                    r["dcp_load"].append(d["load"])
        best_t = min(threads, key=lambda t: med(r[f"dcp_save_t{t}"]) or float("inf"))
        r["dcp_save"], r["dcp_best_threads"] = r[f"dcp_save_t{best_t}"], best_t
    if server is not None:
        server.stop()

    print(
        f"\nS3 benchmark{' (packed layout)' if a.packed else ''}"
        + (f" (object cap {a.cap_mib:g} MiB)" if a.packed and a.cap_mib else "")
        + f": moto {_moto_version()} "
        f"on loopback, {os.cpu_count()} cores, "
        f"concurrency {a.concurrency}, {a.repeat} interleaved rounds; median (min-max)"
        + (f"; +{a.latency_ms:g} ms per request" if a.latency_ms else "")
    )
    for name, r in results.items():
        b = r["bytes"]
        print(
            f"\n{name}: {b / 2**20:.1f} MiB in {r['objects']} chunk objects, "
            f"{r['all_objects']} objects in all"
        )
        print(
            f"  raw PUT (limit)   {fmt(r['raw_put'], r['raw_bytes'])}   {r['raw_put_depth']} deep"
        )
        print(f"  raw PUT (chunks)  {fmt(r['rawc_put'], r['rawc_bytes'])}")
        print(
            f"  shardpoint save   {fmt(r['save'], b)}   {r['save_requests']} requests, "
            f"{max(r['save_depth'])} deep, {r['save_bytes'] / 2**20:.1f} MiB sent"
        )
        if r["dcp_save"]:
            print(f"  DCP save (t={r['dcp_best_threads']:<2})  {fmt(r['dcp_save'], b)}")
        print(
            f"  raw GET (limit)   {fmt(r['raw_get'], r['raw_bytes'])}   {r['raw_get_depth']} deep"
        )
        print(f"  raw GET (chunks)  {fmt(r['rawc_get'], r['rawc_bytes'])}")
        print(
            f"  shardpoint load   {fmt(r['load'], b)}   {r['load_requests']} requests, "
            f"{max(r['load_depth'])} deep, {r['load_bytes'] / 2**20:.1f} MiB received"
        )
        if r["dcp_load"]:
            print(f"  DCP load          {fmt(r['dcp_load'], b)}")
        ratio = lambda x, y: (med(x) and med(y)) and med(x) / med(y)  # noqa: E731
        print(
            f"  save: {ratio(r['raw_put'], r['save']):.2f}x the raw limit "
            f"({ratio(r['rawc_put'], r['save']):.2f}x chunks only)"
            + (
                f", {ratio(r['dcp_save'], r['save']):.2f}x DCP's speed"
                if r["dcp_save"]
                else ", DCP not run (no s3fs at --s3fs-path)"
            )
        )
        print(
            f"  load: {ratio(r['raw_get'], r['load']):.2f}x the raw limit "
            f"({ratio(r['rawc_get'], r['load']):.2f}x chunks only)"
            + (f", {ratio(r['dcp_load'], r['load']):.2f}x DCP's speed" if r["dcp_load"] else "")
        )
    if a.json:
        record(a, argv, results, dcp_ok, layers).write(a.json)


def record(a, argv, results: dict, dcp_ok: bool, layers: int) -> "br.Record":
    """The printed rows as data: per state, each row's seconds (and the bytes it moved),
    and the save's and load's speed as a fraction of the raw limit, of chunks only and of
    DCP's (their time over ours, per round)."""
    rec = br.Record(
        "bench_s3.py",
        "shardpoint against the S3 server's raw limit and DCP through s3fs",
        argv,
        {
            "server": f"moto {_moto_version()} on loopback"
            if a.endpoint is None
            else "an external endpoint",
            "repeat": a.repeat,
            "concurrency": a.concurrency,
            "latency_ms": a.latency_ms,
            "quick": a.quick,
            "mixed_scale": a.scale,
            "mixed_layers": layers,
            "uniform": a.uniform,
            "packed": a.packed,
            "packed_cap_mib": a.cap_mib if a.packed else None,
            "dcp_threads": a.threads,
            "dcp": "run"
            if dcp_ok and any(r["dcp_save"] for r in results.values())
            else "not run (no s3fs at --s3fs-path)",
        },
    )
    for name, r in results.items():
        b = r["bytes"]
        t = rec.table(
            name,
            f"{name}: {b / 2**20:.1f} MiB in {r['objects']} chunk objects, "
            f"{r['all_objects']} objects in all",
            "s",
            b,
        )
        row = br.Record.row
        row(t, "raw PUT (limit)", r["raw_put"], bytes=r["raw_bytes"], depth=r["raw_put_depth"])
        row(t, "raw PUT (chunks)", r["rawc_put"], bytes=r["rawc_bytes"])
        row(
            t,
            "shardpoint save",
            r["save"],
            {
                "speed x raw limit": br.ratio(r["raw_put"], r["save"]),
                "speed x chunks only": br.ratio(r["rawc_put"], r["save"]),
                "speed x DCP": br.ratio(r["dcp_save"], r["save"]),
            },
            requests=r["save_requests"],
            depth=max(r["save_depth"]),
            sent_bytes=r["save_bytes"],
        )
        if r["dcp_save"]:
            row(t, f"DCP save (thread_count={r['dcp_best_threads']})", r["dcp_save"])
        row(t, "raw GET (limit)", r["raw_get"], bytes=r["raw_bytes"], depth=r["raw_get_depth"])
        row(t, "raw GET (chunks)", r["rawc_get"], bytes=r["rawc_bytes"])
        row(
            t,
            "shardpoint load",
            r["load"],
            {
                "speed x raw limit": br.ratio(r["raw_get"], r["load"]),
                "speed x chunks only": br.ratio(r["rawc_get"], r["load"]),
                "speed x DCP": br.ratio(r["dcp_load"], r["load"]),
            },
            requests=r["load_requests"],
            depth=max(r["load_depth"]),
            received_bytes=r["load_bytes"],
        )
        if r["dcp_load"]:
            row(t, "DCP load", r["dcp_load"])
    rec.data["samples"] = results
    return rec


def _moto_version() -> str:
    try:
        import moto

        return moto.__version__
    except Exception:  # noqa: BLE001 - an external server
        return "(external endpoint)"


if __name__ == "__main__":
    main()
