"""``shardpoint conformance ...``: run the suite here, under torchrun, or against an adapter.

``main(argv)`` takes the arguments after the word ``conformance`` and returns an exit code:
0 when everything passed, 1 when a case failed, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
import time
from typing import Optional

from shardpoint_conformance.helptext import add_command, examples

PROFILE_CASES = {"ci": 16, "large": 320}
PROFILE_WORLDS = {"ci": [1, 2, 3, 4], "large": [1, 2, 3, 4, 5, 6, 7, 8]}


def _ints(s: str) -> list:
    """World sizes: ``1-4``, ``1,2,8`` or a mix; each >= 1 (argparse prints the refusal)."""
    out = []
    try:
        for part in s.split(","):
            if "-" in part or ".." in part:
                a, b = part.replace("..", "-").split("-")
                out += list(range(int(a), int(b) + 1))
            elif part:
                out.append(int(part))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: give world sizes as 1-4 or 1,2,8") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: world sizes are integers >= 1")
    return out


def _positive(s: str) -> int:
    try:
        n = int(s)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: give an integer >= 1")
    return n


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardpoint conformance",
        description=textwrap.fill(
            "shardpoint conformance suite: round trips across world sizes, golden vectors, "
            "other implementations (adapters), fuzzing of the readers. Exit 0 when everything "
            "passed, 1 when a case failed, 2 on a usage error."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=examples("""
        shardpoint conformance run                     # CI profile: 16 cases, worlds 1..4
        shardpoint conformance vectors                 # the golden vectors in spec/vectors/
        shardpoint conformance adapter-test --adapter "python my_adapter.py"
        shardpoint conformance fuzz --cases 200
        shardpoint conformance run --help              # each command's options"""),
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    r = add_command(
        sub,
        "run",
        "save/load round trips across world sizes and layouts",
        """
        shardpoint conformance run                      # CI profile: 16 cases, worlds 1..4
        shardpoint conformance run --profile large      # 320 cases, worlds 1..8
        shardpoint conformance run --save-world-sizes 2,4 --load-world-sizes 1-3 --cases 40
        shardpoint conformance run --replay 1013 --save-world-sizes 3 --load-world-sizes 2
        torchrun --nproc-per-node 8 -m shardpoint_conformance.cli run --seed 42 \\
            --dir /shared/scratch/sp-conformance        # on a cluster: a shared --dir""",
    )
    r.add_argument("--profile", choices=sorted(PROFILE_CASES), default="ci")
    r.add_argument("--save-world-sizes", type=_ints, default=None, help="e.g. 1-4 or 1,2,8")
    r.add_argument("--load-world-sizes", type=_ints, default=None, help="e.g. 1-3")
    r.add_argument("--cases", type=_positive, default=None, help="number of cases")
    r.add_argument("--seed", type=int, default=None, help="seed of the first case")
    r.add_argument(
        "--replay",
        type=int,
        default=None,
        metavar="SEED",
        help="run the one case drawn from SEED (with the first world sizes given)",
    )
    r.add_argument("--dir", default=None, help="where checkpoints go (shared FS under torchrun)")
    r.add_argument(
        "--hosts",
        type=_positive,
        default=None,
        help="run on a test cluster of this machine: this many hosts (network "
        "namespaces; needs root). On a real cluster, launch this command "
        "with torchrun or srun instead (see the README)",
    )
    r.add_argument(
        "--ranks-per-host",
        type=_positive,
        default=1,
        help="ranks on each host of --hosts (the world is hosts x ranks)",
    )
    r.add_argument(
        "--link-mbit",
        type=float,
        default=None,
        help="with --hosts: shape each host's link to this many Mbit/s",
    )
    r.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="save and load the cases on an object store instead (s3://bucket/"
        "prefix; endpoint and credentials from the AWS environment). With "
        "--hosts: 's3' (or s3://bucket/prefix) runs an S3-compatible server "
        "on the test cluster's storage host, reached over the shaped links",
    )
    r.add_argument(
        "--backend",
        default=None,
        choices=["gloo", "nccl"],
        help="process-group backend under torchrun (default: nccl with CUDA)",
    )
    r.add_argument("--keep", action="store_true", help="keep checkpoints of passing cases")
    r.add_argument("--json", default=None, help="also write the results as JSON here")
    r.add_argument("--no-vectors", action="store_true", help="skip the golden-vector step")
    r.add_argument("--print-case", action="store_true", help="print the case JSON and exit")
    a = add_command(
        sub,
        "adapter-test",
        "producer x consumer matrix against an adapter "
        "(another implementation driven through the adapter protocol)",
        """
        shardpoint conformance adapter-test --adapter "python my_jax_adapter.py"
        shardpoint conformance adapter-test --adapter "python -m shardpoint_jax.adapter" \\
            --cases 4 --json adapter.json""",
    )
    a.add_argument("--adapter", required=True, help="command line of the adapter")
    a.add_argument("--cases", type=_positive, default=8)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--dir", default=None)
    a.add_argument("--json", default=None)
    a.add_argument("--timeout", type=float, default=120.0, help="seconds per adapter call")
    a.add_argument("--keep", action="store_true", help="keep the files of passing cases")
    v = add_command(
        sub,
        "vectors",
        "check the golden vectors in spec/vectors/",
        """
        shardpoint conformance vectors
        shardpoint conformance vectors --dir spec/vectors""",
    )
    v.add_argument("--dir", default=None, help="vectors directory (default: the repo's)")
    from shardpoint_conformance.fuzz import add_parser as add_fuzz

    add_fuzz(sub)
    return p


def main(argv: Optional[list] = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.cmd == "run":
        return _run(args)
    if args.cmd == "adapter-test":
        from shardpoint_conformance.harness import run_adapter_test

        return run_adapter_test(
            args.adapter,
            cases=args.cases,
            seed=args.seed,
            workdir=args.dir,
            json_out=args.json,
            timeout=args.timeout,
            keep=args.keep,
        )
    if args.cmd == "fuzz":
        from shardpoint_conformance.fuzz import main_args

        return main_args(args)
    if args.cmd == "vectors":
        ok, text = run_vectors(args.dir)
        print(text)
        return 0 if ok else 1
    return 2


def run_vectors(directory: Optional[str] = None) -> tuple:
    """The golden-vector step: delegate to ``shardpoint_conformance.vectors`` if it exists.
    Returns (ok, text); a missing module or vector folder is a skip, not a failure."""
    try:
        from shardpoint_conformance import vectors
    except ImportError as e:
        return True, f"vectors: skipped (shardpoint_conformance.vectors not available: {e})"
    for name in ("run_vectors", "check_vectors", "check_all", "run"):
        fn = getattr(vectors, name, None)
        if callable(fn):
            break
    else:
        return True, "vectors: skipped (vectors module has no run_vectors/check_vectors entry)"
    try:
        res = fn(directory) if directory else fn()
    except Exception as e:  # noqa: BLE001 - a crash is a failure of the step
        return False, f"vectors: FAILED ({type(e).__name__}: {e})"
    if isinstance(res, tuple) and len(res) == 2 and isinstance(res[0], bool):
        return res[0], f"vectors: {'ok' if res[0] else 'FAILED'} {res[1]}"
    if isinstance(res, list):  # a list of failures / problems
        bad = [x for x in res if not (isinstance(x, dict) and x.get("ok", False))]
        return not bad, f"vectors: {len(res) - len(bad)} ok, {len(bad)} failed" + "".join(
            f"\n  {x}" for x in bad[:20]
        )
    if isinstance(res, int):
        return res == 0, f"vectors: exit code {res}"
    return bool(res) if res is not None else True, f"vectors: {res!r}"


def _in_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ and "MASTER_ADDR" in os.environ


def _run(args) -> int:
    from shardpoint_conformance import runner
    from shardpoint_conformance.strategies import case_plan, generate_case

    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    if _in_torchrun():
        return _run_torchrun(args, seed)
    if args.hosts:
        from shardpoint_testing.cluster import unavailable_reason

        why = unavailable_reason()
        if why:
            print(f"shardpoint conformance run --hosts: {why}", file=sys.stderr)
            return 2
        world = args.hosts * args.ranks_per_host
        if (args.save_world_sizes or args.load_world_sizes) and {
            *(args.save_world_sizes or [world]),
            *(args.load_world_sizes or [world]),
        } != {world}:
            print(
                f"--hosts {args.hosts} --ranks-per-host {args.ranks_per_host} runs worlds "
                f"of {world}: leave out --save-world-sizes/--load-world-sizes",
                file=sys.stderr,
            )
            return 2
        args.save_world_sizes = args.load_world_sizes = [world]
    sw = args.save_world_sizes or PROFILE_WORLDS[args.profile]
    lw = args.load_world_sizes or PROFILE_WORLDS[args.profile]
    if args.replay is not None:
        cases = [generate_case(args.replay, sw[0], lw[0], args.profile, case_id="replay")]
    else:
        cases = case_plan(seed, args.cases or PROFILE_CASES[args.profile], sw, lw, args.profile)
    if args.print_case:
        print(json.dumps(cases, indent=1))
        return 0
    if args.store and not args.hosts and "://" not in args.store:
        print(
            f"--store {args.store!r}: give an object store URL (s3://BUCKET/PREFIX); "
            "--store s3 alone means the storage host of a test cluster (--hosts)",
            file=sys.stderr,
        )
        return 2
    if args.hosts and args.store:
        store = _cluster_store(args.store, seed)
        if store is None:
            print(
                f"--hosts with --store {args.store!r}: the test cluster serves s3:// from "
                "its storage host; give --store s3 or --store s3://BUCKET/PREFIX",
                file=sys.stderr,
            )
            return 2
        args.store = store
    own = not (args.store or args.dir)
    root = args.store or args.dir or tempfile.mkdtemp(prefix="shardpoint-conformance-")
    if not args.store:
        os.makedirs(root, exist_ok=True)
    print(
        f"shardpoint conformance run: {len(cases)} case(s), profile {args.profile}, "
        f"seed {seed}, save worlds {sw}, load worlds {lw}, dir {root}"
    )
    t0 = time.perf_counter()
    if args.hosts:
        rows = runner.run_cases_cluster(
            cases,
            root,
            args.hosts,
            args.ranks_per_host,
            link_mbit=args.link_mbit,
            s3_url=args.store,
        )
    else:
        rows = runner.run_cases_local(cases, root)
    ok = runner.passed(rows)
    print(runner.format_table(rows))
    vec_ok = True
    if not args.no_vectors and args.replay is None:
        vec_ok, text = run_vectors()
        print(text)
    print(_summary(rows, time.perf_counter() - t0))
    _write_json(args.json, rows)
    if not args.keep and not (args.hosts and args.store):  # that server is gone already
        runner.cleanup(root, rows, own_root=own)
    return 0 if ok and vec_ok else 1


def _cluster_store(store: str, seed: int) -> Optional[str]:
    """``--store`` with ``--hosts`` as an ``s3://BUCKET/PREFIX`` URL on the cluster's storage
    host (``s3``: a bucket and a prefix of the run's own); None when it names no S3."""
    if store == "s3":
        return f"s3://shardpoint-conformance/run-{seed}"
    if store.startswith("s3://") and store[5:].strip("/"):
        return store.rstrip("/")
    return None


def _summary(rows: list, secs: float) -> str:
    failed = sum(not r["ok"] for r in rows)
    return (
        f"{sum(r['ok'] for r in rows)}/{len(rows)} case(s) passed, {failed} failed in {secs:.1f}s"
    )


def _write_json(path: Optional[str], rows: list) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def _run_torchrun(args, seed: int) -> int:
    import torch
    import torch.distributed as dist
    from shardpoint_conformance import runner
    from shardpoint_conformance.strategies import case_plan, generate_case

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = "cpu"
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not args.dir and not args.store and world > 1:
        if rank == 0:
            print(
                "under torchrun, --dir must name a directory every rank can reach "
                "(a shared file system)",
                file=sys.stderr,
            )
        return 2
    own = not (args.store or args.dir)
    root = args.store or args.dir or tempfile.mkdtemp(prefix="shardpoint-conformance-")
    if args.seed is None and rank == 0:
        print("note: pass --seed so every rank draws the same cases", file=sys.stderr)
    dist.init_process_group(backend)
    try:
        # Every rank must draw the same cases: take rank 0's seed (as msgpack, no pickle).
        import msgpack
        from shardpoint.exchange.comm import Comm

        seed = msgpack.unpackb(Comm().broadcast_bytes(msgpack.packb(seed)))
        if args.replay is not None:
            cases = [generate_case(args.replay, world, world, args.profile, case_id="replay")]
        else:
            cases = case_plan(
                seed, args.cases or PROFILE_CASES[args.profile], [world], [world], args.profile
            )
        if rank == 0 and not args.store:
            os.makedirs(root, exist_ok=True)
            print(
                f"shardpoint conformance run under torchrun: world {world}, backend "
                f"{backend}, {len(cases)} case(s), seed {seed}, dir {root}"
            )
        dist.barrier()
        t0 = time.perf_counter()
        rows = runner.run_in_job(cases, root, device)
        ok = runner.passed(rows)
        if rank == 0:
            print(runner.format_table(rows))
            print(_summary(rows, time.perf_counter() - t0))
            _write_json(args.json, rows)
            if not args.keep:
                runner.cleanup(root, rows, own_root=own)
        dist.barrier()
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
