"""What a warm load spends before its first data byte: CPU time (``time.process_time``) of a
load's phases and of opening (parsing and checking) every array of the mixed state.

    python benchmarks/bench_open.py                      # this tree, mixed state at scale 1
    python benchmarks/bench_open.py --compare main       # interleaved with another revision
    python benchmarks/bench_open.py --profile            # cProfile of the opens, top rows

The checkpoint is saved once (by this tree) and read warm, the page cache holding it, so
what is timed is the code, not the disk: the load's phases run one by one as ``run_load``
runs them (manifest, plan, read; the read includes the opens), then all arrays are opened
again alone, and each reader check is timed apart over all arrays. With ``--compare REV``,
REV is exported from git and each measurement alternates between the two trees, each in a
fresh process, so drift of a shared machine falls on both; the medians per tree are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TREE = ("core", "reference", "testing", "conformance", "backends")


def _cpu(fn, repeat: int) -> float:
    """Median CPU seconds of ``fn()`` over ``repeat`` calls."""
    out = []
    for _ in range(repeat):
        t = time.process_time()
        fn()
        out.append(time.process_time() - t)
    return statistics.median(out)


def measure(path: str, repeat: int, profile: bool) -> dict:
    """The CPU medians of one process (this tree on ``sys.path``)."""
    import torch
    import shardpoint as sp
    import bench_states as bs

    try:  # the layout since the layer split
        from shardpoint.api.loading import LoadJob
        from shardpoint.exchange.comm import Comm
        from shardpoint.planning.load_planner import LoadOptions
        from shardpoint_core.format.manifest import decode_manifest
        from shardpoint_core.transactions.resolve import get_backend
    except ImportError:  # before it (f6563d8): the whole load only
        LoadJob = None
        from shardpoint.metadata import decode_manifest
        from shardpoint.storage import get_backend
    try:  # the load transaction (issue 29)
        from shardpoint_core.transactions.reader import CheckpointReader
    except ImportError:  # before it: the backend's calls, as a load made them
        CheckpointReader = None

    state = bs.mixed_state(float(json.load(open(path + ".json"))["scale"]))

    def empty(t):
        return {k: empty(v) for k, v in t.items()} if isinstance(t, dict) else torch.empty_like(t)

    like = empty(state)
    del state
    be = get_backend(None)
    res: dict = {}

    def phases() -> None:
        if LoadJob is None:
            t = time.process_time()
            sp.load(path, like)
            res.setdefault("load", []).append(time.process_time() - t)
            return
        job = LoadJob(path, like, Comm(None), be, True, LoadOptions())
        for name, fn in (
            ("manifest", job.read_manifest),
            ("plan", job.plan),
            ("read", lambda: job.read(job.budget)),
            ("result", job.result),
        ):
            t = time.process_time()
            fn()
            res.setdefault(name, []).append(time.process_time() - t)

    for _ in range(2):
        phases()  # warm: page cache, imports, pools
    res.clear()
    for _ in range(repeat):
        phases()
    out = {k: statistics.median(v) for k, v in res.items()}
    out["load"] = sum(out.values())
    if CheckpointReader is not None:
        reader = CheckpointReader.open(path, backend=be)
        m, open_array = reader.manifest, reader.array
    else:
        m = decode_manifest(be.read_manifest(path))

        def open_array(k):
            e = m.tensors[k]
            return be.open_array_for_read(path, e.array, e.spec, k)

    ents = [(k, e) for k, e in m.tensors.items()]

    def open_all() -> None:
        for k, _e in ents:
            open_array(k)

    out["open"] = _cpu(open_all, repeat)
    try:
        from shardpoint.api.open_ahead import OpenAhead
    except ImportError:
        from shardpoint.open_ahead import OpenAhead
    tensors = dict(ents)

    def open_ahead() -> None:  # as a load opens them: 8 threads ahead of the reads
        with OpenAhead(open_array, tensors) as h:
            for k in tensors:
                h(k)

    out["open, 8 threads (as a load)"] = _cpu(open_ahead, repeat)
    out["arrays"] = len(ents)
    if LoadJob is not None:
        out.update(_checks(path, ents, repeat))
    if profile:
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        for _ in range(5):
            open_all()
        pr.disable()
        pstats.Stats(pr, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    return out


def _checks(path: str, ents: list, repeat: int) -> dict:
    """Each open-time check alone over all arrays, where this tree has it."""
    from shardpoint_core.format.dtypes import from_name
    from shardpoint_core.arrays import checks as ck

    out = {}
    if hasattr(ck, "scan_array"):  # one pass: listing, kinds, zarr.json read
        scans = [ck.scan_array(path, e.array, k) for k, e in ents]
        out["files listed + zarr.json read"] = _cpu(
            lambda: [ck.scan_array(path, e.array, k) for k, e in ents], repeat
        )
        metas = [ck.parse_zarr_json(r, k) for (r, _), (k, _e) in zip(scans, ents)]
        out["zarr.json parse"] = _cpu(
            lambda: [ck.parse_zarr_json(r, k) for (r, _), (k, _e) in zip(scans, ents)], repeat
        )
        out["zarr.json parse+rules, cached"] = _cpu(
            lambda: [
                ck.checked_zarr_json(
                    r, tuple(e.spec.shape), e.spec.dtype, tuple(e.spec.chunk_shape), k
                )
                for (r, _), (k, e) in zip(scans, ents)
            ],
            repeat,
        )
    else:
        metas = [ck.read_zarr_json(path, e.array, k) for k, e in ents]
        out["zarr.json read+parse"] = _cpu(
            lambda: [ck.read_zarr_json(path, e.array, k) for k, e in ents], repeat
        )
        sizes = [
            ck.chunk_file_sizes(m, from_name(e.spec.dtype).itemsize)
            for m, (_k, e) in zip(metas, ents)
        ]
        out["chunk files listed"] = _cpu(
            lambda: [ck.check_array_files(path, e.array, k, s) for s, (k, e) in zip(sizes, ents)],
            repeat,
        )
    out["zarr.json rules"] = _cpu(
        lambda: [
            ck.check_zarr_json(m, tuple(e.spec.shape), e.spec.dtype, tuple(e.spec.chunk_shape), k)
            for m, (k, e) in zip(metas, ents)
        ],
        repeat,
    )
    return out


def _child(paths: list, ckpt: str, repeat: int) -> dict:
    code = (
        "import json, sys; sys.path[:0] = %r; import bench_open as b; "
        "print(json.dumps(b.measure(%r, %d, False)))" % (paths + [HERE], ckpt, repeat)
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900
    )
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def _export(rev: str, into: str) -> list:
    os.makedirs(into)
    archive = subprocess.run(
        ["git", "-C", REPO, "archive", rev], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return [os.path.join(into, n) for n in TREE if os.path.isdir(os.path.join(into, n))]


def _save(ckpt: str, scale: float) -> None:
    import shardpoint as sp
    import bench_states as bs

    if not os.path.exists(ckpt):
        sp.save(bs.mixed_state(scale), ckpt)
    with open(ckpt + ".json", "w") as f:
        json.dump({"scale": scale}, f)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="mixed state scale (1: 1.2 GB)")
    ap.add_argument("--repeat", type=int, default=7, help="timed repeats per process")
    ap.add_argument("--rounds", type=int, default=3, help="--compare: processes per tree")
    ap.add_argument("--compare", default=None, help="git revision to interleave with")
    ap.add_argument("--profile", action="store_true", help="cProfile of the opens (stderr)")
    ap.add_argument("--dir", default=None, help="where to save (default: a temp dir)")
    ap.add_argument("--ckpt", default=None, help="save here once and keep it (reruns reuse it)")
    a = ap.parse_args(argv)
    sys.path[:0] = [os.path.join(REPO, n) for n in TREE] + [HERE]
    base = tempfile.mkdtemp(prefix="sp-open-", dir=a.dir)
    try:
        ckpt = a.ckpt or os.path.join(base, "ckpt")
        _save(ckpt, a.scale)
        here = [os.path.join(REPO, n) for n in TREE]
        if a.compare is None:
            rows = {"this tree": [measure(ckpt, a.repeat, a.profile)]}
        else:
            other = _export(a.compare, os.path.join(base, "other"))
            rows = {a.compare: [], "this tree": []}
            for r in range(a.rounds):
                order = [(a.compare, other), ("this tree", here)]
                for name, paths in order if r % 2 == 0 else order[::-1]:
                    rows[name].append(_child(paths, ckpt, a.repeat))
                print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
        print(
            f"# warm CPU ms (time.process_time), mixed state scale {a.scale}, medians of "
            f"{a.repeat} per process, median (min-max) over processes; load average "
            f"{os.getloadavg()[0]:.2f}\n"
        )
        names = list(rows)
        print("| step | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        steps = list(dict.fromkeys(k for n in names for r in rows[n] for k in r))
        for step in steps:
            if step == "arrays":
                continue
            cells = []
            for n in names:
                vals = [r[step] for r in rows[n] if step in r]
                cells.append(
                    "-"
                    if not vals
                    else f"{1e3 * statistics.median(vals):.1f}"
                    + (f" ({1e3 * min(vals):.1f}-{1e3 * max(vals):.1f})" if len(vals) > 1 else "")
                )
            print(f"| {step} | " + " | ".join(cells) + " |")
        print(f"\n({rows[names[-1]][0]['arrays']} arrays)")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
