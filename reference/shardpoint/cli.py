"""The ``shardpoint`` command line: inspect, verify, demo, conformance."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional

from . import errors


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def cmd_inspect(a: argparse.Namespace) -> int:
    from .api import read_metadata
    from .model import iter_tree_leaves
    m = read_metadata(a.path)
    total = sum(e.nbytes for e in m.tensors.values())
    if a.json:
        out = {"path": a.path, "format_version": list(m.format_version), "writer": m.writer,
               "save_world_size": m.save_world_size, "total_bytes": total,
               "tensors": {k: {"array": e.array, "shape": list(e.shape), "dtype": e.dtype,
                               "chunk_shape": list(e.chunk_shape), "bytes": e.nbytes}
                           for k, e in m.tensors.items()},
               "objects": {k: {"count": len(v)} for k, v in m.objects.items()},
               "values": {"/".join(map(str, p)): n["value"] for p, n in iter_tree_leaves(m.tree)
                          if "value" in n and isinstance(n["value"], (type(None), bool, int,
                                                                     float, str))}}
        print(json.dumps(out, indent=2))
        return 0
    print(f"{a.path}: shardpoint format {m.format_version[0]}.{m.format_version[1]}, written by "
          f"{m.writer} on {m.save_world_size} rank(s)")
    print(f"{len(m.tensors)} tensors, {_fmt_bytes(total)}; {len(m.objects)} sharded objects")
    rows = [("key", "dtype", "shape", "size", "chunks", "array")]
    for path, node in iter_tree_leaves(m.tree):
        if "tensor" in node:
            e = m.tensors[node["tensor"]]
            n = 1
            for s, c in zip(e.shape, e.chunk_shape):
                n *= -(-s // c)
            rows.append((e.key, e.dtype, "x".join(map(str, e.shape)) or "()",
                         _fmt_bytes(e.nbytes), f"{n} of {list(e.chunk_shape)}", e.array))
        elif "object" in node:
            rows.append((node["object"], "object", f"count {len(m.objects[node['object']])}",
                         "", "", "(manifest)"))
        else:
            rows.append(("/".join(map(str, path)), "value", _short(node["value"]), "", "",
                         "(manifest)"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    return 0


def cmd_verify(a: argparse.Namespace) -> int:
    from .verify import verify_checkpoint
    rep = verify_checkpoint(a.path, strict=a.strict)
    if a.json:
        print(json.dumps(rep.to_dict(), indent=2))
    else:
        what = f"{rep.tensors} tensors ({_fmt_bytes(rep.bytes)}), {rep.objects} sharded objects"
        if rep.ok:
            print(f"OK: {a.path}: {what}; every chunk read and its checksum verified "
                  f"({rep.seconds:.2f}s){' [strict]' if a.strict else ''}")
        else:
            print(f"FAILED: {a.path}: {len(rep.problems)} problem(s) ({what})")
            for sid, msg in rep.problems:
                print(f"  [{sid}] {msg}")
    return 0 if rep.ok else 1


def cmd_demo(a: argparse.Namespace) -> int:
    from .demo import run_demo
    return run_demo(a.dir, keep=a.keep)


def main(argv: Optional[list] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "conformance":
        try:
            from shardpoint_conformance.cli import main as conf_main
        except ImportError as e:  # pragma: no cover - installed with the project
            print(f"shardpoint: the conformance suite is not installed: {e}", file=sys.stderr)
            return 2
        return conf_main(argv[1:])
    p = argparse.ArgumentParser(prog="shardpoint", description="Sharded training checkpoints "
                                "in a framework-neutral format.")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("inspect", help="show a checkpoint's tree, shapes, dtypes, chunk grids")
    s.add_argument("path")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_inspect)
    s = sub.add_parser("verify", help="read every chunk, check checksums and the manifest")
    s.add_argument("path")
    s.add_argument("--strict", action="store_true",
                   help="also check writer rules (array paths, canonical keys, stray arrays)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_verify)
    s = sub.add_parser("demo", help="distributed end-to-end demo on 4 CPU ranks")
    s.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    s.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    s.set_defaults(fn=cmd_demo)
    sub.add_parser("conformance", help="the conformance suite (run, adapter-test, vectors)")
    a = p.parse_args(argv)
    try:
        return a.fn(a)
    except errors.ShardpointError as e:
        print(f"shardpoint {a.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into head & co.
        return 0


if __name__ == "__main__":
    sys.exit(main())
