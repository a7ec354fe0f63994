"""The ``shardpoint`` command line: inspect, verify, recover, convert, diff, demo, conformance.

Exit codes: 0 success; 1 the checkpoint is damaged, incomplete or violates the spec (``verify``
lists each problem by requirement ID); 2 nothing to work on (no such path, bad arguments, the
conformance suite not installed); ``diff`` exits 1 when the checkpoints differ and 2 on any
error. Errors print one line on stderr, never a traceback. Long commands draw a progress bar
on stderr when it is a terminal (never under ``--json`` or in a pipe).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Any, Optional

from shardpoint.tools import cli_tools
from shardpoint_core.format import errors
from shardpoint_core.stores.registry import check_path, is_local, local_path
from shardpoint.tools import progress
from shardpoint.tools.textfmt import fit_table, is_array, jsonable, width
from shardpoint.tools.textfmt import fmt_bytes as _fmt_bytes


def _summary(v: Any, limit: int = 70) -> str:
    """A one-line description of a value or sharded-object entry (arrays by dtype/shape)."""
    if is_array(v):
        dt = str(v.dtype).replace("torch.", "")
        return f"{type(v).__module__.split('.')[0]} {dt}[{'x'.join(map(str, v.shape))}]"
    if isinstance(v, (bytes, bytearray)):
        return f"bytes[{len(v)}]"
    if isinstance(v, dict):
        r = "{" + ", ".join(f"{k!r}: {_summary(x, 30)}" for k, x in v.items()) + "}"
    elif isinstance(v, (list, tuple)):
        r = ("[" if isinstance(v, list) else "(") + ", ".join(_summary(x, 30) for x in v)
        r += "]" if isinstance(v, list) else ")"
    else:
        r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _chunks(e) -> int:
    n = 1
    for s, c in zip(e.shape, e.chunk_shape):
        n *= -(-s // c)
    return n


def _tree_rows(m) -> list:
    """(indented name, kind, shape/value, size, chunk grid, where) for every tree node."""
    rows: list = []
    _add_rows(rows, m.tree, "", 0)
    return rows


def _add_rows(rows: list, node: Any, name: str, depth: int) -> None:
    """Rows for ``node`` of the typed tree (module level: a recursive closure is a cycle)."""
    from shardpoint_core.format.statetree import plain_children

    pad = "  " * depth
    kid = plain_children(node)
    if kid is not None:
        kind = "" if kid[0] == "dict" else kid[0]
        if name:
            rows.append((f"{pad}{name}/", kind, f"{len(kid[1])} items" if kind else "", "", "", ""))
        for k, child in kid[1]:
            _add_rows(rows, child, str(k), depth + (1 if name else 0))
    elif node.kind == "tensor":
        e = node.entry
        rows.append(
            (
                pad + name,
                e.dtype,
                "x".join(map(str, e.shape)) or "()",
                _fmt_bytes(e.nbytes),
                f"{_chunks(e)} x {'x'.join(map(str, e.chunk_shape)) or '()'}",
                e.array,
            )
        )
    elif node.kind == "object":
        vals = node.values
        rows.append(
            (pad + name, "object", f"[{len(vals)}] {_summary(vals[0], 50)}", "", "", "(manifest)")
        )
    else:
        rows.append((pad + name, "value", _summary(node.value), "", "", "(manifest)"))


def cmd_inspect(a: argparse.Namespace) -> int:
    from shardpoint_core.transactions.resolve import read_metadata
    from shardpoint_core.format.statetree import iter_leaves

    if a.load_ranks and a.layout is None:
        print(
            "shardpoint inspect: --load-ranks draws the load plan of one tensor: give "
            "--layout KEY too",
            file=sys.stderr,
        )
        return 2
    if a.values is not None or a.layout is not None:
        try:
            return (cli_tools.cmd_values if a.values is not None else cli_tools.cmd_layout)(a)
        except errors.LayoutMismatchError as e:  # no such key: nothing to work on
            print(f"shardpoint inspect: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
    m = read_metadata(a.path)
    total = sum(e.nbytes for e in m.tensors.values())
    chunks = sum(_chunks(e) for e in m.tensors.values())
    if a.json:
        out = {
            "path": a.path,
            "format_version": list(m.format_version),
            "writer": m.writer,
            "created_unix": m.created_unix,
            "save_world_size": m.save_world_size,
            "total_bytes": total,
            "total_chunks": chunks,
            "tensors": {
                k: {
                    "array": e.array,
                    "shape": list(e.shape),
                    "dtype": e.dtype,
                    "chunk_shape": list(e.chunk_shape),
                    "chunks": _chunks(e),
                    "bytes": e.nbytes,
                }
                for k, e in m.tensors.items()
            },
            "objects": {k: {"count": len(v), "values": jsonable(v)} for k, v in m.objects.items()},
            "packed": m.packed.sharing() if m.packed is not None else None,
            "values": {
                v.key: jsonable(v.value) for _p, v in iter_leaves(m.tree) if v.kind == "value"
            },
        }
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"{a.path}: shardpoint format {m.format_version[0]}.{m.format_version[1]}, written by "
        f"{m.writer or '?'} on {m.save_world_size} rank(s)"
    )
    rows = [("name", "dtype", "shape / value", "size", "chunks", "array")]
    rows += _tree_rows(m)
    # Key names are never cut (two keys cut to the same 'e...' told nothing, and grep found
    # nothing in a pipe): on a terminal the other columns shrink and long names wrap; piped,
    # nothing is cut at all.
    cols = width() if sys.stdout.isatty() else 1 << 30
    for line in fit_table(rows, cols, shrink=(2, 5, 4), keep_end=(5,)):
        print(line)
    nvals = sum(1 for _p, v in iter_leaves(m.tree) if v.kind == "value")
    print(
        f"total: {len(m.tensors)} tensors, {_fmt_bytes(total)} in {chunks} chunks; "
        f"{len(m.objects)} sharded objects; {nvals} values"
    )
    if m.packed is not None:  # (1.4) what it stores and what it shares ([SP-PACK-9])
        sh = m.packed.sharing()
        print(
            f"packed: {sh['own']['chunks']} chunks ({_fmt_bytes(sh['own']['bytes'])}) in its "
            f"own objects{'' if sh['hashes'] else ', no chunk hashes (nothing can build on it)'}"
        )
        for name, b in sh["bases"].items():
            print(
                f"  shared with base {name!r} (beside it, identity {b['identity'][:16]}...): "
                f"{b['chunks']} chunks ({_fmt_bytes(b['bytes'])})"
            )
    return 0


def cmd_verify(a: argparse.Namespace) -> int:
    from shardpoint_core.verify import verify_checkpoint

    with progress.bar("verify", None, progress.wanted(a.json)) as adv:
        rep = verify_checkpoint(a.path, strict=a.strict, progress=adv)
    if a.json:
        print(json.dumps(rep.to_dict(), indent=2))
    else:
        extra = [f"{n} in base {b!r}" for b, n in sorted(rep.shared.items())]  # (1.4)
        extra += ["chunk hashes compared"] if rep.hashes else []
        what = (
            f"{rep.tensors} tensors ({_fmt_bytes(rep.bytes)}), {rep.chunks_checked} of "
            f"{rep.chunks} chunks read and checksummed"
            + (f" ({', '.join(extra)})" if extra else "")
            + f", {rep.objects} sharded objects"
        )
        mode = " [strict]" if a.strict else ""
        if rep.ok:
            v = rep.format_version or ("?", "?")  # set whenever the manifest decoded
            print(
                f"OK: {a.path}: shardpoint format {v[0]}.{v[1]}; {what} ({rep.seconds:.2f}s){mode}"
            )
        else:
            print(
                f"FAILED{mode}: {a.path}: {len(rep.problems)} problem(s), violating "
                f"{', '.join(rep.spec_ids)} ({what})"
            )
            for sid, msg in rep.problems:
                print(f"  [{sid}] {msg}")
            print("  (requirement IDs are defined in spec/format.md)")
    return 0 if rep.ok else (1 if rep.found else 2)


def cmd_recover(a: argparse.Namespace) -> int:
    import os

    from shardpoint_core.commit.recovery import recover
    from shardpoint_core.stores.registry import is_local, local_path

    # A typo is not "nothing to recover" (an object store has no directories to look for).
    if is_local(a.path) and not os.path.lexists(local_path(a.path, "recover")):
        raise errors.CheckpointNotFoundError(f"{a.path!r} does not exist")
    acts = recover(a.path, dry_run=a.dry_run, min_age_s=a.min_age)
    if a.json:
        print(json.dumps([x.to_dict() for x in acts], indent=2))
    else:
        verb = {"remove": "removed", "restore": "restored", "skip": "skipped"}
        for x in acts:
            v = ("would " + x.action) if a.dry_run and x.action != "skip" else verb[x.action]
            if not a.dry_run and x.action != "skip" and not x.done:
                v = f"could not {x.action}"
            print(f"{v}: {x.path} ({x.reason})")
        if not acts:
            print(f"nothing to recover at {a.path}")
    failed = not a.dry_run and any(x.action != "skip" and not x.done for x in acts)
    return 1 if failed else 0


def cmd_export_tensorstore(a: argparse.Namespace) -> int:
    from shardpoint_core.transactions.ts_export import SPEC_NAME, export_tensorstore

    spec = export_tensorstore(a.src, a.dst, overwrite=a.overwrite)
    if a.json:
        print(json.dumps(spec, sort_keys=True))
    else:
        print(f"wrote an OCDBT index of {a.src} to {a.dst} (the checkpoint's bytes stay put)")
        print(f"TensorStore kvstore spec: {a.dst.rstrip('/')}/{SPEC_NAME}")
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    from shardpoint.tools.demo import run_demo

    return run_demo(a.dir, keep=a.keep)


def _conformance(argv: list) -> int:
    try:
        found = importlib.util.find_spec("shardpoint_conformance.cli") is not None
    except ImportError:  # the package itself is missing
        found = False
    if not found:
        print(
            "shardpoint conformance: the conformance suite (package shardpoint_conformance) "
            "is not installed; install the project with `pip install -e .` from a checkout",
            file=sys.stderr,
        )
        return 2
    from shardpoint_conformance.cli import main as conf_main

    try:
        return int(conf_main(argv) or 0)
    except SystemExit as e:  # its argparse: --help or a usage error
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardpoint",
        description="Sharded training checkpoints in a framework-neutral format.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""\
examples:
  shardpoint demo                          # save, kill, resume on other world sizes
  shardpoint inspect ckpt/step_100         # the tree: shapes, dtypes, chunks
  shardpoint inspect ckpt/step_100 --layout model/w   # who wrote which chunk
  shardpoint verify ckpt/step_100
  shardpoint COMMAND --help                # each command's options and examples

exit codes: 0 ok, 1 damaged or invalid checkpoint, 2 not found or usage error""",
    )
    from shardpoint_core import __version__
    from shardpoint_core.format.manifest import FORMAT_VERSION

    p.add_argument(
        "--version",
        action="version",
        version=f"shardpoint {__version__} (writes "
        f"format {FORMAT_VERSION[0]}.{FORMAT_VERSION[1]}, reads 1.x; spec 1.2)",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    s = cli_tools.add_command(
        sub,
        "inspect",
        "show a checkpoint's tree: shapes, dtypes, "
        "sizes, chunk grids, array paths, objects and values",
        """
        shardpoint inspect ckpt/step_100
        shardpoint inspect ckpt/step_100 --json
        shardpoint inspect ckpt/step_100 --values 'model/layers.0.weight[0:4, :8]'
        shardpoint inspect ckpt/step_100 --values step
        shardpoint inspect ckpt/step_100 --layout model/layers.0.weight   # its chunks, drawn
        shardpoint inspect ckpt/step_100 --layout model/layers.0.weight --load-ranks 3""",
    )
    s.add_argument("path", help="a shardpoint checkpoint directory")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    g = s.add_mutually_exclusive_group()
    g.add_argument(
        "--values",
        metavar="KEY",
        default=None,
        help="print one entry's values (KEY[10:20, :4] reads only that block of a tensor)",
    )
    g.add_argument(
        "--layout",
        metavar="KEY",
        default=None,
        help="draw one tensor's chunk grid as boxes (by writer rank where recorded)",
    )
    s.add_argument(
        "--load-ranks",
        type=cli_tools.positive_int("a rank count"),
        default=None,
        metavar="N",
        help="with --layout: draw the plan of loading it into N "
        "ranks split along dimension 0 (which rank reads which chunk, who sends "
        "what to whom)",
    )
    s.set_defaults(fn=cmd_inspect)
    s = cli_tools.add_command(
        sub,
        "verify",
        "read every chunk, check checksums, manifest "
        "and arrays against the spec; list every problem by requirement "
        "ID (exit 0 sound, 1 damaged, 2 no such path)",
        """
        shardpoint verify ckpt/step_100
        shardpoint verify ckpt/step_100 --strict --json""",
    )
    s.add_argument("path", help="a shardpoint checkpoint directory")
    s.add_argument(
        "--strict",
        action="store_true",
        help="also check writer rules (array paths, canonical keys, stray arrays)",
    )
    s.add_argument("--json", action="store_true", help="machine-readable report")
    s.set_defaults(fn=cmd_verify)
    s = cli_tools.add_command(
        sub,
        "recover",
        "clean up after crashed saves (SP-COMMIT-6): "
        "remove staging leftovers, restore a previous checkpoint a crash "
        "moved aside; skips saves running on this host (they hold a "
        "lock) and recent files (exit 1 when a removal or restore "
        "failed)",
        """
        shardpoint recover ckpt/ --dry-run          # what would be removed or restored
        shardpoint recover ckpt/step_100 --min-age 0   # no save is running anywhere""",
    )
    s.add_argument("path", help="a checkpoint path, or the directory holding checkpoints")
    s.add_argument("--dry-run", action="store_true", help="only say what would be done")
    s.add_argument(
        "--min-age",
        type=cli_tools.non_negative("an age"),
        default=900.0,
        metavar="SECONDS",
        help="skip leftovers modified more recently than this (default 900)",
    )
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn=cmd_recover)
    s = cli_tools.add_command(
        sub,
        "demo",
        "train a tiny GPT on 4 CPU ranks (TP=2 x DP=2), "
        "SIGKILL it after a checkpoint, resume on 4, 2 and 1 ranks and "
        "check exactness",
        """
        shardpoint demo                      # in a temporary directory, removed afterwards
        shardpoint demo --dir demo/ --keep   # keep the checkpoints to inspect them""",
    )
    s.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    s.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    s.set_defaults(fn=cmd_demo)
    s = cli_tools.add_command(
        sub,
        "export-tensorstore",
        "write a small OCDBT index that lets TensorStore open every tensor of a packed "
        "checkpoint as a Zarr v3 array, reading the chunks where they lie (no copy); "
        "the kvstore spec to open it is written beside it as kvstore.json",
        """
        shardpoint export-tensorstore ckpt/step_100 ckpt/step_100.ts
        shardpoint export-tensorstore s3://bucket/ckpt/step_100 s3://bucket/exports/step_100""",
    )
    s.add_argument("src", help="a packed checkpoint (a directory, s3:// or gs://)")
    s.add_argument("dst", help="a directory of its own for the index (local, s3:// or gs://)")
    s.add_argument("--overwrite", action="store_true", help="replace an export at dst")
    s.add_argument("--json", action="store_true", help="print the kvstore spec as JSON")
    s.set_defaults(fn=cmd_export_tensorstore)
    cli_tools.add_commands(sub)
    sub.add_parser(
        "conformance",
        help="the conformance suite (run, adapter-test, ...); "
        "`shardpoint conformance --help` for its options",
    )
    return p


_PATH_ARGS = ("path", "src", "dst", "a", "b", "dir")
# commands that take s3://... checkpoints too (convert: as its source, and as its destination
# for shardpoint output, published by the object-store commit like sp.save)
_URL_COMMANDS = ("inspect", "verify", "recover", "diff", "convert", "export-tensorstore")


def main(argv: Optional[list] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "conformance":
        return _conformance(argv[1:])
    try:
        a = _parser().parse_args(argv)
    except SystemExit as e:  # --help or a usage error (argparse printed it)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    try:
        for name in _PATH_ARGS:  # a URL nobody registered is never a local path
            v = getattr(a, name, None)
            if isinstance(v, str) and (is_local(v) or a.cmd not in _URL_COMMANDS):
                setattr(a, name, local_path(v, f"shardpoint {a.cmd}"))
            elif isinstance(v, str):
                check_path(v, f"shardpoint {a.cmd}")  # s3://...: kept as a URL
        return a.fn(a)
    except errors.CheckpointNotFoundError as e:
        print(f"shardpoint {a.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except errors.ShardpointError as e:
        print(f"shardpoint {a.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # output piped into head & co.
        return 0
    except OSError as e:
        print(f"shardpoint {a.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"shardpoint {a.cmd}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
