"""The ``convert`` and ``diff`` commands and ``inspect --values``: the command-line faces of
:mod:`shardpoint.tools.convert`, :mod:`shardpoint.tools.diff` and :mod:`shardpoint.api.lazy`."""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from types import EllipsisType
from typing import Any, Callable

from shardpoint_core.format import errors
from shardpoint.tools import progress
from shardpoint_core.format.keys import similar_keys
from shardpoint.tools.textfmt import fmt_bytes, jsonable


def add_command(sub: Any, name: str, help: str, examples: str = "") -> argparse.ArgumentParser:
    """A sub-command whose own ``--help`` repeats its one-line summary and shows examples
    (``examples``: one command per line, ``#`` comments kept)."""
    return sub.add_parser(
        name,
        help=help,
        description=textwrap.fill(help[0].upper() + help[1:] + "."),
        epilog="examples:\n" + textwrap.indent(textwrap.dedent(examples).strip(), "  ")
        if examples
        else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def non_negative(what: str) -> Callable[[str], float]:
    """An argparse type for a finite number >= 0 called ``what`` (a negative or NaN tolerance
    made every tensor differ; a negative age was taken as 0)."""

    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            v = float("nan")
        if not 0 <= v < float("inf"):
            raise argparse.ArgumentTypeError(f"{s!r}: {what} is a finite number >= 0")
        return v

    return parse


def positive_int(what: str) -> Callable[[str], int]:
    """An argparse type for an integer >= 1 called ``what`` (``--procs 0`` was a runtime
    error, exit 1, instead of a usage error, exit 2)."""

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            v = 0
        if v < 1:
            raise argparse.ArgumentTypeError(f"{s!r}: {what} is an integer >= 1")
        return v

    return parse


def add_commands(sub: Any) -> None:
    """Register ``convert`` and ``diff`` on the ``shardpoint`` sub-command parser."""
    from shardpoint.tools.formats import SOURCES, TARGETS

    s = add_command(
        sub,
        "convert",
        "convert from DCP, Megatron torch_dist, torch.save, "
        "safetensors or Orbax to shardpoint, or from shardpoint to DCP or "
        "safetensors",
        """
        shardpoint convert outputs/checkpoint/step-1000 ckpt/step_1000 --trust-pickle  # DCP
        shardpoint convert iter_0001000 ckpt/megatron --trust-pickle   # Megatron torch_dist
        shardpoint convert model.pt ckpt/from_pt               # torch.save (weights_only)
        shardpoint convert Llama-3-8B/ ckpt/llama              # HF safetensors directory
        shardpoint convert orbax_ckpts/1000 ckpt/jax           # Orbax (a CheckpointManager step)
        shardpoint convert ckpt/llama out/ --to safetensors --max-shard-size 5GB
        shardpoint convert ckpt/step_1000 dcp_again/ --to dcp""",
    )
    s.add_argument("src", help="the checkpoint to read (a directory or a file)")
    s.add_argument("dst", help="where to write it (must not exist unless --overwrite)")
    s.add_argument(
        "--from", dest="from_", choices=SOURCES, help="source format (default: detected)"
    )
    s.add_argument(
        "--to",
        choices=TARGETS,
        help="target format (default: safetensors for a .safetensors path, else shardpoint)",
    )
    s.add_argument(
        "--max-shard-size",
        default=None,
        help="safetensors: split into shards "
        "of at most this size (e.g. 5GB, 2GiB) with model.safetensors.index.json",
    )
    s.add_argument(
        "--procs",
        type=positive_int("a process count"),
        default=1,
        metavar="N",
        help="convert with N worker "
        "processes, each reading its share of the source (shardpoint and "
        "safetensors output; DCP output is written by one process); the result is "
        "the same bytes as with 1",
    )
    s.add_argument(
        "--max-chunk-size",
        default="256MiB",
        help="shardpoint output: chunks of "
        "at most this size (e.g. 64MiB; also the unit of work shared by --procs)",
    )
    s.add_argument(
        "--overwrite",
        action="store_true",
        help="replace DST if it is a finished "
        "output of the target format (a checkpoint) or an empty directory",
    )
    s.add_argument(
        "--overwrite-any",
        action="store_true",
        help="also replace a DST directory "
        "that is not one, deleting what it holds (never a file, a directory of "
        "checkpoints or one holding SRC)",
    )
    s.add_argument(
        "--skip-common",
        action="store_true",
        help="Megatron: convert the sharded "
        "state even when common.pt needs more than weights_only unpickling",
    )
    s.add_argument(
        "--trust-pickle",
        action="store_true",
        help="allow a DCP or Megatron "
        "source, whose .metadata is read by unpickling it (code in it runs): only "
        "for checkpoints you trust",
    )
    s.add_argument("--json", action="store_true", help="machine-readable report")
    s.set_defaults(fn=cmd_convert)
    s = add_command(
        sub,
        "diff",
        "compare two checkpoints key by key and chunk by chunk "
        "(exit 0 equal, 1 different, 2 error)",
        """
        shardpoint diff ckpt/step_100 ckpt/step_200            # bitwise
        shardpoint diff ckpt/llama Llama-3-8B/ --atol 1e-6     # any two readable formats
        shardpoint diff ckpt/a ckpt/b --json""",
    )
    s.add_argument("a", help="a checkpoint of any readable format (detected)")
    s.add_argument("b", help="the checkpoint to compare it with")
    s.add_argument(
        "--atol",
        type=non_negative("a tolerance"),
        default=None,
        help="absolute tolerance (default: bitwise comparison)",
    )
    s.add_argument(
        "--rtol", type=non_negative("a tolerance"), default=None, help="relative tolerance"
    )
    s.add_argument(
        "--from-a", choices=SOURCES, default=None, help="format of A (default: detected)"
    )
    s.add_argument(
        "--from-b", choices=SOURCES, default=None, help="format of B (default: detected)"
    )
    s.add_argument(
        "--trust-pickle",
        action="store_true",
        help="allow DCP and Megatron "
        "sides, whose .metadata is read by unpickling it (code in it runs): only "
        "for checkpoints you trust",
    )
    s.add_argument("--json", action="store_true", help="machine-readable report")
    s.set_defaults(fn=cmd_diff)


def cmd_convert(a: argparse.Namespace) -> int:
    from shardpoint.tools.convert import convert
    from shardpoint.tools.convert.base import limit_heap_growth
    from shardpoint.tools.convert.hf_safetensors import parse_size

    limit_heap_growth()
    with progress.bar("convert", None, progress.wanted(a.json)) as adv:
        rep = convert(
            a.src,
            a.dst,
            from_=a.from_,
            to=a.to,
            overwrite="any" if a.overwrite_any else a.overwrite,
            max_shard_size=a.max_shard_size,
            skip_common=a.skip_common,
            procs=a.procs,
            max_chunk_bytes=parse_size(a.max_chunk_size, "--max-chunk-size"),
            trust_pickle=a.trust_pickle,
            progress=adv,
            on_open=lambda s: adv.set_total(s.total_bytes),
        )
    if a.json:
        print(json.dumps(rep.to_dict(), indent=2))
        return 0
    print(
        f"converted {rep.src} ({rep.src_format}) -> {rep.dst} ({rep.dst_format}): "
        f"{rep.tensors} tensors ({fmt_bytes(rep.bytes)}), {rep.values} values, "
        f"{rep.objects} sharded objects in {rep.seconds:.2f}s"
        + (f" with {rep.procs} processes" if rep.procs > 1 else "")
    )
    if rep.skipped:
        print(f"not converted ({len(rep.skipped)}):")
        for k, r in rep.skipped:
            print(f"  {k}: {r}")
    return 0


def cmd_diff(a: argparse.Namespace) -> int:
    from shardpoint.tools.convert.base import limit_heap_growth
    from shardpoint.tools.diff import diff_checkpoints

    limit_heap_growth()
    try:
        with progress.bar("diff", None, progress.wanted(a.json)) as adv:

            def opened(sa: Any, sb: Any) -> None:
                from shardpoint.tools.convert.base import flat_name

                names = {n for u in sb.tensors for n in (u.path, flat_name(u.path))}
                adv.set_total(
                    sum(
                        t.nbytes
                        for t in sa.tensors
                        if t.path in names or flat_name(t.path) in names
                    )
                )

            rep = diff_checkpoints(
                a.a,
                a.b,
                atol=a.atol,
                rtol=a.rtol,
                from_a=a.from_a,
                from_b=a.from_b,
                progress=adv,
                on_open=opened,
                trust_pickle=a.trust_pickle,
            )
    except (errors.ShardpointError, OSError) as e:
        print(f"shardpoint diff: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(rep.to_dict(), indent=2))
        return 0 if rep.equal else 1
    how = "bitwise" if rep.exact else f"atol={rep.atol:g}, rtol={rep.rtol:g}"
    for k in rep.only_a:
        print(f"only in A: {k}")
    for k in rep.only_b:
        print(f"only in B: {k}")
    for k, w in rep.mismatched:
        print(f"differs:   {k}: {w}")
    for k, x, y in rep.values:
        print(f"differs:   {k}: {x} vs {y}")
    for t in rep.tensors:
        m = "" if t.max_abs_diff is None else f", max |a-b| {t.max_abs_diff:.6g}"
        print(
            f"differs:   {t.key}: {t.differing} of {t.elements} elements, first at "
            f"[{', '.join(map(str, t.first_index))}]{m}"
        )
    for k, w in rep.not_comparable:
        print(f"not compared: {k}: {w}")
    if rep.renamed:
        x, y = rep.renamed[0]
        print(
            f"note: {len(rep.renamed)} key(s) matched by flat name across naming "
            f"conventions (e.g. A {x!r} = B {y!r})"
        )
    if rep.nothing_compared:
        print(
            f"NOTHING COMPARED: A has {rep.tensors_a} tensor(s), B {rep.tensors_b}, and no "
            "key names a tensor in both (a different model, or keys under another prefix?)"
        )
    verdict = "equal" if rep.equal else "DIFFERENT"
    print(
        f"{verdict} ({how}): {rep.compared_tensors} of {rep.tensors_a} tensors in A "
        f"({fmt_bytes(rep.compared_bytes)}) compared; {len(rep.only_a)} only in A, "
        f"{len(rep.only_b)} only in B"
    )
    return 0 if rep.equal else 1


_SLICE = re.compile(r"^(?P<key>.*?)\[(?P<idx>[^\[\]]*)\]$")
_PREVIEW_BYTES = 64 << 20


def _parse_index(s: str) -> tuple[int | slice | EllipsisType, ...]:
    out: list[int | slice | EllipsisType] = []
    for part in s.split(","):
        part = part.strip()
        if part in ("...", "…"):
            out.append(Ellipsis)
        elif ":" in part:
            bits = [int(b) if b.strip() else None for b in part.split(":")]
            if len(bits) > 3:
                raise ValueError(part)
            out.append(slice(*bits))
        else:
            out.append(int(part))
    return tuple(out)


def cmd_values(a: argparse.Namespace) -> int:
    """``inspect PATH --values KEY`` (``KEY[10:20, :4]`` reads only that block)."""
    import torch

    from shardpoint.api.lazy import TensorView, open

    with open(a.path) as ckpt:
        key, idx = a.values, None
        m = _SLICE.match(key)
        if m and key not in ckpt and m["key"] in ckpt:
            try:
                key, idx = m["key"], _parse_index(m["idx"])
            except ValueError:
                raise errors.LayoutMismatchError(
                    f"{a.values!r}: the index must be ints and slices like [10:20, :4]"
                ) from None
        if key not in ckpt:
            near = similar_keys(key, ckpt.keys())
            raise errors.LayoutMismatchError(
                f"{key!r} is not a key of {a.path!r}; "
                + (f"similar keys: {', '.join(map(repr, near))}; " if near else "")
                + "`shardpoint inspect` lists them"
            )
        v = ckpt[key]
        if not isinstance(v, TensorView):
            print(
                json.dumps({"key": key, "value": jsonable(v)}, indent=2)
                if a.json
                else f"{key} = {v!r}"
            )
            return 0
        note = ""
        if idx is not None:
            try:
                v = v[idx]
            except (IndexError, TypeError) as e:
                raise errors.LayoutMismatchError(f"{a.values!r}: {e}") from None
        elif v.nbytes > _PREVIEW_BYTES:
            v = v[tuple(slice(0, 4) for _ in v.shape)]
            note = (
                f" (first {list(v.shape)} of {fmt_bytes(ckpt[key].nbytes)}; give a slice, "
                f"e.g. {key}[0:8])"
            )
        t = v.to_torch()
        if a.json:
            vals = (
                t.to(torch.float64)
                if t.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
                else t
            )
            print(
                json.dumps(
                    {
                        "key": key,
                        "dtype": v.entry.dtype,
                        "shape": list(v.shape),
                        "values": jsonable(vals.tolist()),
                    },
                    indent=2,
                )
            )
            return 0
        torch.set_printoptions(linewidth=80)
        print(f"{key}: {v.entry.dtype}[{'x'.join(map(str, v.shape))}]{note}")
        print(t)
    return 0


def cmd_layout(a: argparse.Namespace) -> int:
    """``inspect PATH --layout KEY [--load-ranks N]``: the tensor's chunk grid as boxes, or
    the plan of loading it into N ranks split along dimension 0."""
    from shardpoint.planning.load_planner import plan_load
    from shardpoint.planning.plans import TensorLayout
    from shardpoint.tools import layout as lay
    from shardpoint.tools.textfmt import width
    from shardpoint_core.transactions.resolve import read_metadata

    m = read_metadata(a.path)
    key = a.layout
    e = m.tensors.get(key)
    if e is None:
        from shardpoint_core.format.statetree import iter_leaves

        kinds = {v.key: v.kind for _p, v in iter_leaves(m.tree) if v.kind != "tensor"}
        near = similar_keys(key, list(m.tensors))
        what = {"value": "is a value", "object": "is a sharded object"}.get(
            kinds.get(key, ""), "names no tensor"
        )
        raise errors.LayoutMismatchError(
            f"{key!r} {what} in {a.path!r}: --layout draws a tensor; "
            + (f"similar keys: {', '.join(map(repr, near))}; " if near else "")
            + "`shardpoint inspect` lists the tensors"
        )
    cols = min(width(), 100) if sys.stdout.isatty() else 80
    if a.load_ranks:
        t = TensorLayout(key, tuple(e.shape), e.dtype, tuple(e.chunk_shape))
        works = plan_load(lay.even_requests(key, e.dtype, e.shape, a.load_ranks), {key: t})
        d = lay.draw_load_plan(works, t, width=cols - 2)
        d.notes.append(
            f"each of the {a.load_ranks} ranks asks for an even split of "
            "dimension 0 (the read-once plan: each chunk is read by one rank and "
            "sent to the others that need it)"
        )
    else:
        d = lay.draw_chunks(
            key, e.shape, e.dtype, e.chunk_shape, width=cols - 2, save_world_size=m.save_world_size
        )
    if a.json:
        print(
            json.dumps(
                {
                    "key": key,
                    "shape": list(e.shape),
                    "chunk_shape": list(e.chunk_shape),
                    "load_ranks": a.load_ranks,
                    "boxes": [
                        {"lo": list(lo), "hi": list(hi), "label": label}
                        for lo, hi, label in d.boxes
                    ],
                    "notes": d.notes,
                },
                indent=2,
            )
        )
        return 0
    from rich.console import Console

    Console(highlight=False, soft_wrap=True).print(d.text)
    for n in d.notes:
        print(f"note: {n}")
    return 0
