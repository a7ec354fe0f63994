"""Packed layout (format 1.4) against the per-array layout and DCP: files or objects per
checkpoint and save/load time for the 444-tensor state of issue 30 (a GPT-2-small-like model
with its AdamW moments, bench_states.gpt2_adamw_state), on local files and on the local S3
server, rounds interleaved.

    python benchmarks/bench_packed.py                      # files and S3, 3 rounds
    python benchmarks/bench_packed.py --quick              # small state, 1 round (smoke)
    python benchmarks/bench_packed.py --no-s3 --rounds 5
    python benchmarks/bench_packed.py --json benchmarks/results/bench_packed.json
    python benchmarks/bench_packed.py --no-s3 --cold      # loads from a dropped page cache

Rows (one process, fsync on; loads from a warm page cache unless ``--cold``, which drops it
before every load of every row, root only):
- per-array: ``sp.save(..., backend=ZarrBackend())`` (format 1.3: a directory, a zarr.json
  and chunk files per tensor) and ``sp.load``;
- packed: ``sp.save`` with the default backend (``PackedBackend``, format 1.4: one data
  object per writer, the index in the manifest) and ``sp.load``;
- DCP (files only): ``dcp.save`` with ``FileSystemWriter(thread_count=8)`` and ``dcp.load``.
On S3 the server is moto's in-memory server on loopback (shardpoint_testing.s3): what it
measures is request count and the server's cost per request, not AWS; DCP through s3fs is
bench_s3.py's (it needs an s3fs installed apart).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_results as br  # noqa: E402
import bench_tools as bt  # noqa: E402
from bench_states import gpt2_adamw_state  # noqa: E402

from shardpoint_core.transactions.backend import ZarrBackend  # noqa: E402
from shardpoint_core.transactions.packed import PackedBackend  # noqa: E402


def _like(tree):
    """Targets for a load: empty tensors of the same shapes, other leaves as they are."""
    if isinstance(tree, dict):
        return {k: _like(v) for k, v in tree.items()}
    return bt.torch.empty_like(tree) if hasattr(tree, "numel") else tree


def _count(root: str) -> tuple:
    files = dirs = 0
    for _d, ds, fs in os.walk(root):
        files += len(fs)
        dirs += len(ds)
    return files, dirs + 1


def _timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def files_rounds(state: dict, like: dict, rounds: int, scratch: str, cold: bool = False) -> dict:
    names = ("per-array", "packed", "DCP", "raw disk")
    out = {k: {"save": [], "load": [], "count": None} for k in names}
    # the raw disk: the same bytes into one file (8 threads of pwrite with early writeback,
    # then fsync) and back with 4 threads of preadv into buffers allocated once
    bufs = [v for v in bt.flat(like).values() if hasattr(v, "numel")]
    tensors = {k: v for k, v in bt.flat(state).items() if hasattr(v, "numel")}
    for r in range(rounds):
        # rotated: what a round runs first does not inherit another layout's writeback
        for name in names[r % len(names) :] + names[: r % len(names)]:
            path = os.path.join(scratch, f"{name}-{r}")
            if name == "raw disk":
                os.makedirs(path)
                out[name]["save"].append(
                    _timed(bt.raw_write, tensors, os.path.join(path, "raw"), 8, True)
                )
                cold and bt.drop_caches()
                out[name]["load"].append(_timed(bt.raw_read, bufs, os.path.join(path, "raw")))
            elif name == "DCP":
                out[name]["save"].append(_timed(bt.dcp_save, state, path, 8))
                cold and bt.drop_caches()
                out[name]["load"].append(_timed(bt.dcp_load, like, path))
            else:
                be = ZarrBackend() if name == "per-array" else None  # None: the default
                out[name]["save"].append(_timed(bt.sp_save, state, path, be))
                cold and bt.drop_caches()
                out[name]["load"].append(_timed(bt.sp_load, like, path))
            out[name]["count"] = _count(path)
            bt.rm(path)
    return out


def s3_rounds(state: dict, like: dict, rounds: int, cap=None) -> dict:
    from shardpoint_testing.s3 import S3Server
    from shardpoint_core.stores.location import locate

    out = {k: {"save": [], "load": [], "count": None} for k in ("per-array", "packed")}
    # moto keeps an object above this size in a temporary file and reads all of it for
    # every ranged GET; real S3 does neither. Held in memory here, for both layouts alike.
    os.environ.setdefault("MOTO_S3_DEFAULT_KEY_BUFFER_SIZE", str(1 << 30))
    with S3Server() as server:
        for k, v in server.env().items():
            os.environ[k] = v
        # moto assembles a multipart upload in Python: a 150 MB object's completion can
        # take longer than the default 10 s read timeout on a busy 2-core machine
        os.environ.setdefault("SHARDPOINT_S3_READ_TIMEOUT_S", "300")
        os.environ.setdefault("SHARDPOINT_S3_DEADLINE_S", "900")
        for _round in range(rounds):
            for name in ("per-array", "packed"):
                url = server.url(server.fresh_prefix(name) + "/ck")
                be = PackedBackend(cap=cap) if name == "packed" else ZarrBackend()
                out[name]["save"].append(_timed(bt.sp_save, state, url, be))
                out[name]["load"].append(_timed(bt.sp_load, like, url))
                store, key = locate(url).pair()
                keys = [i.key for i in store.list(key + "/")]
                out[name]["count"] = (len(keys), 0)
                store.delete(keys)
    return out


def table(rec, name: str, title: str, res: dict, nbytes: int, what: str) -> None:
    print(f"\n{title}")
    print(f"{'layout':<10} {what:>18} {'save s (min-max)':>22} {'load s (min-max)':>22}")
    t_save = rec.table(f"{name}_save", f"{title}: save", nbytes=nbytes)
    t_load = rec.table(f"{name}_load", f"{title}: load", nbytes=nbytes)
    ref = res["per-array"]
    raw = res.get("raw disk")

    def vs_raw(r: dict, op: str) -> dict:
        return {"x raw disk": br.ratio(r[op], raw[op])} if raw and r is not raw else {}

    for layout, r in res.items():
        files, dirs = r["count"]
        shown = f"{files} / {dirs}" if what.endswith("dirs") else f"{files}"
        fmt = lambda v: f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"  # noqa: E731
        x = ""
        if raw and r is not raw:  # per round, then the median
            x = "  x raw disk: save {:.2f}, load {:.2f}".format(
                *(
                    statistics.median(a / b for a, b in zip(r[op], raw[op]))
                    for op in ("save", "load")
                )
            )
        print(f"{layout:<10} {shown:>18} {fmt(r['save']):>22} {fmt(r['load']):>22}{x}")
        rec.row(
            t_save,
            layout,
            r["save"],
            {"vs per-array": br.ratio(r["save"], ref["save"]), **vs_raw(r, "save")},
            files=files,
            dirs=dirs,
        )
        rec.row(
            t_load,
            layout,
            r["load"],
            {"vs per-array": br.ratio(r["load"], ref["load"]), **vs_raw(r, "load")},
            files=files,
            dirs=dirs,
        )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--quick", action="store_true", help="scale 0.1, 1 round")
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--no-files", action="store_true")
    ap.add_argument(
        "--cold",
        action="store_true",
        help="drop the page cache before every load (files; needs root)",
    )
    ap.add_argument(
        "--s3-cap-mib",
        type=float,
        default=None,
        help="PackedBackend(cap=...) on S3 (default: the backend's 64 MiB)",
    )
    ap.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write the figures as data (bench_results.py)",
    )
    a = ap.parse_args(argv)
    if a.quick:
        a.scale, a.rounds = 0.1, 1
    state = gpt2_adamw_state(a.scale)
    like = _like(state)
    n = len(bt.flat(state)) - sum(1 for v in bt.flat(state).values() if not hasattr(v, "numel"))
    nbytes = sum(
        v.numel() * v.element_size() for v in bt.flat(state).values() if hasattr(v, "numel")
    )
    if a.cold and not bt.drop_caches():
        sys.exit("--cold: writing /proc/sys/vm/drop_caches needs root")
    print(f"state: {n} tensors, {nbytes / 1e9:.2f} GB; {a.rounds} rounds, interleaved")
    rec = br.Record(
        "bench_packed.py",
        "Packed layout vs per-array vs DCP",
        argv,
        {"tensors": n, "bytes": nbytes, "rounds": a.rounds, "scale": a.scale, "cold": a.cold},
    )
    if not a.no_files:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as scratch:
            table(
                rec,
                "files",
                "local files" + (", loads from a cold page cache" if a.cold else ""),
                files_rounds(state, like, a.rounds, scratch, a.cold),
                nbytes,
                "files / dirs",
            )
    if not a.no_s3:
        table(
            rec,
            "s3",
            "local S3 server (moto)",
            s3_rounds(state, like, a.rounds, int(a.s3_cap_mib * 2**20) if a.s3_cap_mib else None),
            nbytes,
            "objects",
        )
    if a.json:
        rec.write(a.json)


if __name__ == "__main__":
    main()
