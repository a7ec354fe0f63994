"""MkDocs hook: the pages that are generated, never copied by hand.

* ``spec/``: the specification's own files (spec/*.md, the vectors' README, the JSON schema),
  added to the site as they are in the repository, so the rendered spec is the normative text.
* ``<!-- generated: cli -->``: the help of ``shardpoint`` and of each subcommand (and of
  ``shardpoint conformance``'s), formatted by the argparse parsers the command runs.
* ``<!-- generated: benchmark NAME -->`` (or ``NAME:TABLE,TABLE``): the tables and bar
  charts of ``benchmarks/results/NAME.json``, the file a benchmark script wrote with
  ``--json`` (its command, date, commit and machine said beside them).
"""

from __future__ import annotations

import argparse
import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = os.path.join(ROOT, "spec")
# repository file -> where it appears on the site
SPEC_FILES = {
    "README.md": "spec/index.md",
    "format.md": "spec/format.md",
    "versioning.md": "spec/versioning.md",
    "security.md": "spec/security.md",
    "rationale.md": "spec/rationale.md",
    "CHANGELOG.md": "spec/CHANGELOG.md",
    "vectors/README.md": "spec/vectors/index.md",
    "schema/manifest.schema.json": "spec/schema/manifest.schema.json",
}
MARK = re.compile(r"^([ \t]*)<!-- generated: (\w+)(?: (\S+))? -->", re.M)


# A requirement ID in brackets, "[SP-READ-3]": plain text on the site. (Two in a row,
# "[SP-VER-2] [SP-VER-3]", would otherwise read as a reference-style link.)
REQUIREMENT = re.compile(r"(?<!\\)\[(SP-[A-Z]+-\d+)\]")


SCHEMA = "shardpoint-bench/1"  # benchmarks/bench_results.py writes it


def on_files(files, config):
    from mkdocs.structure.files import File

    for src, uri in SPEC_FILES.items():
        with open(os.path.join(SPEC, src), encoding="utf-8") as f:
            text = f.read()
        if uri.endswith(".md"):
            text = _plain_ids(text).replace("](vectors/)", "](vectors/index.md)")
        files.append(File.generated(config, uri, content=text))
    return files


CODE = re.compile(r"(```.*?```|`[^`\n]*`)", re.S)


def _plain_ids(text: str) -> str:
    """Escape requirement IDs outside code (inside code a backslash would show)."""
    parts = CODE.split(text)
    return "".join(p if i % 2 else REQUIREMENT.sub(r"\\[\1]", p) for i, p in enumerate(parts))


def on_page_markdown(markdown, page, config, files):
    def render(m: re.Match) -> str:  # indented like the marker (inside a list item)
        text = _render(m.group(2), m.group(3))
        return "\n".join(m.group(1) + line if line else line for line in text.splitlines())

    return MARK.sub(render, markdown)


def _render(kind: str, arg: str | None) -> str:
    if kind == "cli":
        return cli_reference()
    if kind == "benchmark":
        return benchmark_table(arg)
    raise ValueError(f"unknown generated block {kind!r}")


def _subcommands(parser: argparse.ArgumentParser) -> dict:
    for action in parser._actions:  # argparse keeps subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_reference() -> str:
    """Every command's ``--help``, as the installed command prints it (100 columns)."""
    os.environ["COLUMNS"] = "100"
    from shardpoint.tools.cli import _parser as main_parser
    from shardpoint_conformance.cli import _parser as conformance_parser

    top = main_parser()
    out = ["## shardpoint", "", "```text", top.format_help().rstrip(), "```", ""]
    for name, sub in _subcommands(top).items():
        if name == "conformance":
            continue
        out += [f"## shardpoint {name}", "", "```text", sub.format_help().rstrip(), "```", ""]
    conf = conformance_parser()
    out += ["## shardpoint conformance", "", "```text", conf.format_help().rstrip(), "```", ""]
    for name, sub in _subcommands(conf).items():
        out += [
            f"### shardpoint conformance {name}",
            "",
            "```text",
            sub.format_help().rstrip(),
            "```",
            "",
        ]
    return "\n".join(out)


def _load_results(name: str) -> tuple:
    path = os.path.join(ROOT, "benchmarks", "results", f"{name}.json")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if data.get("schema") != SCHEMA:
        raise ValueError(
            f"{path}: schema {data.get('schema')!r}, expected {SCHEMA!r} (a file "
            "a benchmark script wrote with --json)"
        )
    return path, data


def benchmark_table(spec: str | None) -> str:
    """Markdown for ``benchmarks/results/<name>.json`` (``spec`` is ``name`` or
    ``name:table,table``): which command wrote it, when, on what machine; then per table its
    rows (median, min-max, rate, ratios) and a bar chart of the medians with min-max
    whiskers."""
    name, _, only = (spec or "").partition(":")
    path, data = _load_results(name)
    return render_results(
        data, f"benchmarks/results/{name}.json", only.split(",") if only else None
    )


def _dur(v: float | None, unit: str) -> str:
    if v is None:
        return "n/a"
    if unit == "bytes":
        return f"{v / 1e6:.1f} MB" if v >= 1e5 else f"{v / 1e3:.1f} kB"
    if unit == "s":
        return f"{v:.3f}" if v >= 0.001 or v == 0 else f"{v:.1e}"
    return f"{v:.2f}"


def _footnote(i: int) -> str:
    return "†‡§¶"[i % 4] * (1 + i // 4)


def _ratio(r: dict) -> str:
    pr = r.get("per_round")
    if pr and pr["min"] != pr["max"]:
        return f"{pr['median']:.2f}x ({pr['min']:.2f}-{pr['max']:.2f})"
    return f"{(pr or r)['median' if pr else 'value']:.2f}x"


def _machine(m: dict) -> str:
    out = [f"{m.get('nproc')} CPUs"]
    if m.get("memory_bytes"):
        out.append(f"{m['memory_bytes'] / 2**30:.0f} GiB memory")
    out.append(m.get("kernel", "?"))
    if m.get("load_average"):
        out.append(f"load average {m['load_average'][0]:g} at the start")
    out += [
        f"{k} {v}"
        for k, v in m.items()
        if k not in ("nproc", "memory_bytes", "kernel", "load_average", "arch")
    ]
    return ", ".join(out)


def render_results(data: dict, where: str, only: list | None = None) -> str:
    """A results file (``benchmarks/bench_results.py``'s schema) as markdown and inline SVG."""
    commit = data.get("commit") or "?"
    cfg = ", ".join(f"{k} {v}" for k, v in data.get("config", {}).items())
    out = [
        f"*{data['title']}.* Source: `{data['source']}`, run {data['date']} at commit "
        f"`{commit}`{' (with local changes)' if data.get('dirty') else ''}; machine: "
        f"{_machine(data.get('machine', {}))}; configuration: {cfg} "
        f"(data: `{where}`).",
        "",
    ]
    if data.get("config", {}).get("quick"):
        out += [
            "**A `--quick` smoke run: tiny sizes, one round, warm cache; these figures mean "
            "nothing.**",
            "",
        ]
    for t in data["tables"]:
        if only and t["name"] not in only:
            continue
        rows, unit = t["rows"], t["unit"]
        names = list(dict.fromkeys(k for r in rows for k in r.get("ratios", {})))
        rate = unit == "s" and (t.get("bytes") or any(r.get("bytes") for r in rows))
        mem = any(r.get("peak_extra_bytes") is not None for r in rows)
        files = any(r.get("files") for r in rows)
        u = {"s": "s", "bytes": "", "GB/s": "GB/s"}.get(unit, unit)
        cols = (
            [f"median {u}".strip(), f"min-max {u}".strip()]
            + (["MB/s"] if rate else [])
            + names
            + (["peak extra mem"] if mem else [])
            + (["files / dirs"] if files else [])
        )
        out += [
            f"**{t['title']}**" + (f" ({t['note']})" if t.get("note") else ""),
            "",
            "| | " + " | ".join(cols) + " |",
            "|---" * (len(cols) + 1) + "|",
        ]
        notes: list = []
        for r in rows:
            mark = " *" if r.get("reference") else ""
            if r.get("note"):
                notes += [] if r["note"] in notes else [r["note"]]
                mark += " " + _footnote(notes.index(r["note"]))
            cells = [
                _dur(r["median"], unit),
                f"{_dur(r['min'], unit)}-{_dur(r['max'], unit)}" if len(r["values"]) > 1 else "",
            ]
            if rate:
                b = r.get("bytes") or t.get("bytes")
                cells.append(f"{b / r['median'] / 1e6:.1f}" if b and r["median"] else "")
            cells += [_ratio(r["ratios"][n]) if n in r.get("ratios", {}) else "" for n in names]
            if mem:
                m = r.get("peak_extra_bytes")
                cells.append("" if m is None else f"{m / 2**20:.0f} MiB")
            if files:  # "files / dirs" as the writer counted them, or a count
                f, d = r.get("files"), r.get("dirs")
                cells.append("" if f is None else f"{f} / {d}" if d is not None else str(f))
            out.append(f"| {r['label']}{mark} | " + " | ".join(cells) + " |")
        out.append("")
        for i, n in enumerate(notes):
            out += [f"{_footnote(i)} {n}", ""]
        if any(r.get("reference") for r in rows):
            out += ["\\* the reference of its family (the setting with the lowest median).", ""]
        if len(rows) > 1 and unit == "s":
            out += [bar_chart(t), ""]
    tg = data.get("targets")
    if tg and tg.get("rows") and not only:
        out += [
            "**Targets, from this run** (ratios: medians of per-round ratios)",
            "",
            "| target | " + " | ".join(tg["columns"]) + " |",
            "|---" * (len(tg["columns"]) + 1) + "|",
        ]
        out += [f"| {r['label']} | " + " | ".join(r["cells"]) + " |" for r in tg["rows"]]
        out.append("")
    out.append(
        "Ratios: the median of the per-round ratios (min-max) where the script pairs "
        "rounds, else the ratio of the medians."
    )
    return "\n".join(out)


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def bar_chart(table: dict) -> str:
    """A horizontal bar chart as inline SVG (no plotting library): one bar per row, its
    median, with a whisker from its min to its max."""
    rows, width, left, step = table["rows"], 760, 330, 22
    top = max(r["max"] for r in rows if r["max"] is not None) * 1.08 or 1.0
    x = lambda v: left + (width - left - 70) * v / top  # noqa: E731
    h = step * len(rows) + 34
    unit = table["unit"]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" '
        f'role="img" aria-label="{_esc(table["title"])}: medians with min-max" '
        'style="font: 11px sans-serif">'
    ]
    for i, r in enumerate(rows):
        if r["median"] is None:
            continue
        y = 6 + i * step
        label = r["label"] if len(r["label"]) <= 52 else r["label"][:50] + "..."
        out.append(
            f'<text x="{left - 6}" y="{y + 13}" text-anchor="end">{_esc(label)}</text>'
            f'<rect x="{left}" y="{y + 3}" width="{x(r["median"]) - left:.1f}" '
            f'height="13" fill="{"#ef6c00" if "shardpoint" in r["label"] else "#5c6bc0"}"/>'
            f'<line x1="{x(r["min"]):.1f}" y1="{y + 9.5}" x2="{x(r["max"]):.1f}" '
            f'y2="{y + 9.5}" stroke="#222"/><line x1="{x(r["min"]):.1f}" y1="{y + 5}" '
            f'x2="{x(r["min"]):.1f}" y2="{y + 14}" stroke="#222"/><line '
            f'x1="{x(r["max"]):.1f}" y1="{y + 5}" x2="{x(r["max"]):.1f}" y2="{y + 14}" '
            f'stroke="#222"/><text x="{x(r["max"]) + 4:.1f}" y="{y + 13}">'
            f"{_dur(r['median'], unit)}</text>"
        )
    out.append(
        f'<line x1="{left}" y1="{h - 26}" x2="{x(top):.1f}" y2="{h - 26}" '
        f'stroke="#999"/><text x="{left}" y="{h - 10}">0</text><text x="{x(top):.1f}" '
        f'y="{h - 10}" text-anchor="end">{_dur(top, unit)} {unit}</text></svg>'
    )
    return (
        "".join(out) + f"\n\n*{_esc(table['title'])}: medians (bars) with min-max "
        "(whiskers); shardpoint's rows in orange.*"
    )
