"""Byte stores against TensorStore's kvstore drivers: put/get throughput and request latency,
same run, same data, interleaved rounds (issue 29 item 4: the measured winner is each
scheme's default).

    python benchmarks/bench_stores.py                  # 200 x 64 KiB + 20 x 8 MiB, 5 rounds
    python benchmarks/bench_stores.py --quick          # tiny, one round (the test suite's)
    python benchmarks/bench_stores.py --json benchmarks/results/stores.json

Per scheme, each round writes the same objects to a fresh prefix of every store (the order
of the stores turns each round), then reads them back:
- files: :class:`FileStore` (``pwritev``, one ``syncfs`` at ``make_durable``) against
  ``TensorStoreStore`` on the ``file`` driver, as it comes (an fsync per write) and with
  ``file_sync=False`` (``make_durable`` fsyncs each file); the page cache is dropped before
  every read phase where that is allowed (root), and the table says when it was not;
- s3: :class:`S3Store` (boto3) against ``TensorStoreStore`` on the ``s3`` driver, on moto's
  S3 server on loopback started here (an in-memory Python server: the figures are what a
  client gets from *this* server, not from AWS);
- memory: :class:`MemoryStore` against the ``memory`` driver.
Put: every object through a pool of ``--threads`` threads, then ``make_durable``. Get: the
small objects with ``get``, the big ones with ``read_into`` a reused buffer (what a load
does). Latency: ``--latency-n`` puts, then gets, of one 4 KiB object in sequence. Then the
whole path a user takes: ``sp.save`` and ``sp.load`` of tensors of the same sizes through the
scheme's default store and through ``tensorstore+<scheme>://`` (saves, commits, reader
checks; a store's extra requests for sizes show here, not in the raw rows). Medians with
min-max over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Tuple

MiB = 1 << 20

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_tools import drop_caches  # noqa: E402


def objects(n_small: int, small: int, n_big: int, big: int) -> List[Tuple[str, bytes]]:
    """The workload: ``n_small`` objects of ``small`` bytes and ``n_big`` of ``big`` bytes,
    random (nothing compresses), under keys shaped like a checkpoint's chunks."""
    out = [(f"tensors/s{i % 16}/c/{i}", os.urandom(small)) for i in range(n_small)]
    out += [(f"tensors/b{i}/c/0", os.urandom(big)) for i in range(n_big)]
    return out


def put_all(store, objs, threads: int) -> float:
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda kv: store.put(kv[0], kv[1]), objs))
    store.make_durable()
    return time.perf_counter() - t


def get_all(store, objs, threads: int, small: int) -> float:
    bufs: Dict[int, bytearray] = {}

    def one(kv) -> None:
        key, data = kv
        if len(data) <= small:
            got = store.get(key)
            assert len(got) == len(data), key
            return
        import threading

        b = bufs.setdefault(threading.get_ident(), bytearray(len(data)))
        store.read_into(key, 0, memoryview(b)[: len(data)])

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, objs))
    return time.perf_counter() - t


def latency(store, n: int) -> Tuple[float, float]:
    """Median seconds of one 4 KiB put, then of one get, each in sequence."""
    blob = os.urandom(4096)
    puts, gets = [], []
    for i in range(n):
        t = time.perf_counter()
        store.put(f"lat/{i}", blob)
        puts.append(time.perf_counter() - t)
    for i in range(n):
        t = time.perf_counter()
        store.get(f"lat/{i}")
        gets.append(time.perf_counter() - t)
    return statistics.median(puts), statistics.median(gets)


def check_round_trip(store, objs) -> None:
    """Every byte back, bit for bit (a benchmark of a store that loses bytes means nothing)."""
    for key, data in objs[:3] + objs[-2:]:
        assert store.get(key) == data, key


def stores_for(scheme: str, root: str, s3) -> Dict[str, Callable[[str], object]]:
    """name -> make(prefix): a fresh, empty store of that kind below ``prefix``."""
    from shardpoint_core.stores import FileStore, MemoryStore
    from shardpoint_core.stores.tensorstore import TensorStoreOptions, TensorStoreStore

    if scheme == "files":
        return {
            "FileStore (pwritev, syncfs)": lambda p: FileStore(os.path.join(root, p), create=True),
            "TensorStore file (fsync each write)": lambda p: TensorStoreStore(
                os.path.join(root, p)
            ),
            "TensorStore file (fsync at make_durable)": lambda p: TensorStoreStore(
                os.path.join(root, p), TensorStoreOptions(file_sync=False)
            ),
        }
    if scheme == "s3":
        from shardpoint_core.stores.s3 import S3Options, S3Store

        return {
            "S3Store (boto3)": lambda p: S3Store.from_url(
                s3.url(p), S3Options(endpoint_url=s3.endpoint, max_connections=64)
            ),
            "TensorStore s3": lambda p: TensorStoreStore(
                s3.url(p), TensorStoreOptions(endpoint_url=s3.endpoint, concurrency=64)
            ),
        }
    return {
        "MemoryStore": lambda p: MemoryStore.named(p),
        "TensorStore memory": lambda p: TensorStoreStore(f"memory://{p}"),
    }


def cleanup(scheme: str, store, root: str, prefix: str) -> None:
    if scheme == "files":
        shutil.rmtree(os.path.join(root, prefix), ignore_errors=True)
    elif scheme == "s3":
        store.delete([i.key for i in store.list()])
    else:
        from shardpoint_core.stores import MemoryStore
        from shardpoint_core.stores.tensorstore import TensorStoreStore

        MemoryStore.drop(prefix)
        TensorStoreStore.drop(prefix)


def checkpoints_for(scheme: str, root: str, s3) -> Dict[str, Callable[[str], str]]:
    """name -> url(prefix): where ``sp.save`` writes a checkpoint of that scheme, through
    the store the scheme opens by default and through TensorStore's driver."""
    if scheme == "files":
        return {
            "checkpoint, plain path (FileStore, rename commit)": lambda p: os.path.join(
                root, p, "ck"
            ),
            "checkpoint, tensorstore+file://": lambda p: (
                f"tensorstore+file://{os.path.join(root, p, 'ck')}"
            ),
        }
    if scheme == "s3":
        return {
            "checkpoint, s3:// (S3Store)": lambda p: s3.url(f"{p}/ck"),
            "checkpoint, tensorstore+s3://": lambda p: "tensorstore+" + s3.url(f"{p}/ck"),
        }
    return {
        "checkpoint, memory:// (MemoryStore)": lambda p: f"memory://{p}/ck",
        "checkpoint, tensorstore+memory://": lambda p: f"tensorstore+memory://{p}/ck",
    }


def checkpoint_state(objs) -> dict:
    """Tensors of the workload's sizes (fp32), so a checkpoint moves the same bytes."""
    import torch

    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(len(d) // 4, generator=g) for i, (_, d) in enumerate(objs)}


def save_load(url: str, state: dict, scheme: str, quick: bool) -> Tuple[float, float, bool]:
    """(save s, load s, page cache dropped) of ``state`` at ``url``; every tensor loaded is
    compared bit for bit."""
    import torch

    import shardpoint as sp

    t = time.perf_counter()
    sp.save(state, url)
    ts = time.perf_counter() - t
    dropped = scheme == "files" and not quick and drop_caches()
    t = time.perf_counter()
    got = sp.load(url)
    tl = time.perf_counter() - t
    for k, v in state.items():
        assert torch.equal(got[k].view(torch.int32), v.view(torch.int32)), (url, k)
    return ts, tl, dropped


def cleanup_checkpoint(scheme: str, root: str, prefix: str, s3) -> None:
    if scheme == "files":
        shutil.rmtree(os.path.join(root, prefix), ignore_errors=True)
    elif scheme == "s3":
        from shardpoint_core.stores.s3 import S3Store

        st = S3Store.from_url(s3.url(prefix))
        st.delete([i.key for i in st.list()])
    else:
        from shardpoint_core.stores import MemoryStore
        from shardpoint_core.stores.tensorstore import TensorStoreStore

        MemoryStore.drop(prefix)
        TensorStoreStore.drop(prefix)


def run(a) -> dict:
    """{scheme: {store: {"put": [s...], "get": [...], "lput": [...], "lget": [...]}}}, the
    bytes moved per round, and whether the page cache was dropped."""
    objs = objects(a.small_n, a.small_kib << 10, a.big_n, a.big_mib * MiB)
    total = sum(len(d) for _, d in objs)
    res: Dict[str, Dict[str, Dict[str, list]]] = {}
    dropped = None
    root = tempfile.mkdtemp(prefix="sp-stores-", dir=a.dir)
    s3 = None
    try:
        if "s3" in a.schemes:
            sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "testing"))
            from shardpoint_testing.s3 import S3Server

            s3 = S3Server().start()
            os.environ.update(s3.env())
        for scheme in a.schemes:
            makers = stores_for(scheme, root, s3)
            res[scheme] = {n: {"put": [], "get": [], "lput": [], "lget": []} for n in makers}
            names = list(makers)
            for r in range(a.rounds):
                order = names[r % len(names) :] + names[: r % len(names)]
                for name in order:
                    prefix = f"r{r}-{uuid.uuid4().hex[:8]}"
                    store = makers[name](prefix)
                    row = res[scheme][name]
                    row["put"].append(put_all(store, objs, a.threads))
                    if scheme == "files" and not a.quick:
                        ok = drop_caches()
                        dropped = ok if dropped is None else dropped and ok
                    row["get"].append(get_all(store, objs, a.threads, a.small_kib << 10))
                    check_round_trip(store, objs)
                    lp, lg = latency(store, a.latency_n)
                    row["lput"].append(lp)
                    row["lget"].append(lg)
                    cleanup(scheme, store, root, prefix)
            if not a.checkpoints:
                continue
            state = checkpoint_state(objs)
            urls = checkpoints_for(scheme, root, s3)
            res[scheme].update({n: {"put": [], "get": []} for n in urls})
            names = list(urls)
            for r in range(a.rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    prefix = f"c{r}-{uuid.uuid4().hex[:8]}"
                    ts, tl, ok = save_load(urls[name](prefix), state, scheme, a.quick)
                    if scheme == "files" and not a.quick:
                        dropped = ok if dropped is None else dropped and ok
                    res[scheme][name]["put"].append(ts)
                    res[scheme][name]["get"].append(tl)
                    cleanup_checkpoint(scheme, root, prefix, s3)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if s3 is not None:
            s3.stop()
    return {"results": res, "bytes": total, "dropped": bool(dropped), "count": len(objs)}


def _cell(values: list, scale: Callable[[float], float], fmt: str) -> str:
    v = sorted(scale(x) for x in values)
    return f"{fmt.format(statistics.median(v))} ({fmt.format(v[0])}-{fmt.format(v[-1])})"


def table(out: dict, a) -> dict:
    """Print the markdown table; return it in benchmarks/results/*.json's shape."""
    mib = out["bytes"] / MiB
    cols = [
        "put (sp.save) MiB/s, durable",
        "get (sp.load) MiB/s, cold where dropped",
        "put 4 KiB, ms",
        "get 4 KiB, ms",
    ]
    rows, bars = [], []
    for scheme, per in out["results"].items():
        base: dict = {}
        for name, r in per.items():
            family = "checkpoint" if name.startswith("checkpoint") else "store"
            cells = [
                _cell(r["put"], lambda s: mib / s, "{:.0f}"),
                _cell(r["get"], lambda s: mib / s, "{:.0f}"),
            ]
            cells += (
                [
                    _cell(r["lput"], lambda s: s * 1e3, "{:.3f}"),
                    _cell(r["lget"], lambda s: s * 1e3, "{:.3f}"),
                ]
                if "lput" in r
                else ["-", "-"]
            )
            rows.append({"label": f"{scheme}: {name}", "cells": cells})
            if family not in base:
                base[family] = r
                continue
            if name.endswith("(fsync at make_durable)"):
                continue
            for what, word in (
                (("put", "put"), ("get", "get"))
                if family == "store"
                else (("put", "sp.save"), ("get", "sp.load"))
            ):
                bars.append(
                    {
                        "label": f"{scheme}, {word}",
                        "value": round(
                            statistics.median(base[family][what]) / statistics.median(r[what]), 2
                        ),
                    }
                )
    cache = (
        "dropped before each read"
        if out["dropped"]
        else "NOT dropped" + (" (--quick)" if a.quick else " (not root)")
    )
    print(
        f"\n### Byte stores: {out['count']} objects, {mib:.1f} MiB ({a.small_n} x "
        f"{a.small_kib} KiB + {a.big_n} x {a.big_mib} MiB), {a.threads} threads, "
        f"{a.rounds} interleaved round(s); median (min-max); page cache (files): {cache}\n"
    )
    print("| store | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for row in rows:
        print(f"| {row['label']} | " + " | ".join(row["cells"]) + " |")
    print(
        "\nTensorStore's speed against the store it would replace (its time / TensorStore's; "
        "above 1: TensorStore faster): "
        + ", ".join(f"{b['label']} {b['value']:.2f}x" for b in bars)
    )
    return {
        "title": "Byte stores: shardpoint's own against TensorStore's kvstore drivers, "
        "same data, same run",
        "source": f"python benchmarks/bench_stores.py --rounds {a.rounds} on the 2-core "
        f"development VM: {out['count']} objects, {mib:.1f} MiB per round "
        f"({a.small_n} x {a.small_kib} KiB + {a.big_n} x {a.big_mib} MiB), "
        f"{a.threads} threads; s3 is moto's in-memory server on loopback; "
        f"page cache {cache}",
        "columns": cols,
        "rows": rows,
        "plot": {
            "title": "TensorStore's speed against the default store of the scheme "
            "(default's time / TensorStore's; right of 1: TensorStore "
            "faster)",
            "bars": bars,
        },
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--small-n", type=int, default=200)
    ap.add_argument("--small-kib", type=int, default=64)
    ap.add_argument("--big-n", type=int, default=20)
    ap.add_argument("--big-mib", type=int, default=8)
    ap.add_argument("--latency-n", type=int, default=50)
    ap.add_argument("--schemes", default="files,s3,memory")
    ap.add_argument(
        "--no-checkpoints",
        dest="checkpoints",
        action="store_false",
        help="skip the sp.save/sp.load rows (they need torch)",
    )
    ap.add_argument(
        "--dir",
        default=None,
        help="where the files scheme writes (a tmp dir below it, removed after)",
    )
    ap.add_argument("--json", default=None, help="write the table here (results/*.json shape)")
    a = ap.parse_args(argv)
    if a.quick:
        a.rounds, a.small_n, a.small_kib, a.big_n, a.big_mib, a.latency_n = 1, 8, 16, 2, 1, 5
        a.threads = 4
    a.schemes = [s for s in a.schemes.split(",") if s]
    data = table(run(a), a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
    return data


if __name__ == "__main__":
    main()
