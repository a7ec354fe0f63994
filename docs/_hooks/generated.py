"""MkDocs hook: the pages that are generated, never copied by hand.

* ``spec/``: the specification's own files (spec/*.md, the vectors' README, the JSON schema),
  added to the site as they are in the repository, so the rendered spec is the normative text.
* ``<!-- generated: cli -->``: the help of ``shardpoint`` and of each subcommand (and of
  ``shardpoint conformance``'s), formatted by the argparse parsers the command runs.
* ``<!-- generated: benchmark NAME -->``: a table rendered from ``benchmarks/results/NAME.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import re

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = os.path.join(ROOT, "spec")
# repository file -> where it appears on the site
SPEC_FILES = {
    "README.md": "spec/index.md", "format.md": "spec/format.md",
    "versioning.md": "spec/versioning.md", "security.md": "spec/security.md",
    "rationale.md": "spec/rationale.md", "CHANGELOG.md": "spec/CHANGELOG.md",
    "vectors/README.md": "spec/vectors/index.md",
    "schema/manifest.schema.json": "spec/schema/manifest.schema.json",
}
MARK = re.compile(r"^([ \t]*)<!-- generated: (\w+)(?: (\S+))? -->", re.M)


# A requirement ID in brackets, "[SP-READ-3]": plain text on the site. (Two in a row,
# "[SP-VER-2] [SP-VER-3]", would otherwise read as a reference-style link.)
REQUIREMENT = re.compile(r"(?<!\\)\[(SP-[A-Z]+-\d+)\]")


def on_files(files, config):
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
    def render(m: re.Match) -> str:     # indented like the marker (inside a list item)
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
    for action in parser._actions:     # argparse keeps subparsers only here
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
        out += [f"### shardpoint conformance {name}", "", "```text",
                sub.format_help().rstrip(), "```", ""]
    return "\n".join(out)


def benchmark_table(name: str | None) -> str:
    """A markdown table from ``benchmarks/results/<name>.json``: ``columns``, ``rows`` (each
    a label and one cell per column) and ``source`` (the run the figures come from)."""
    path = os.path.join(ROOT, "benchmarks", "results", f"{name}.json")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    cols = data["columns"]
    lines = ["| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for row in data["rows"]:
        cells = row["cells"]
        if len(cells) != len(cols):
            raise ValueError(f"{path}: row {row['label']!r} has {len(cells)} cells, "
                             f"{len(cols)} columns")
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    lines += ["", f"*{data['title']}.* Source: {data['source']} "
              f"(data: `benchmarks/results/{name}.json`)."]
    if "plot" in data:
        lines += ["", bar_chart(data["plot"])]
    return "\n".join(lines)


def bar_chart(plot: dict) -> str:
    """A horizontal bar chart as inline SVG (no plotting library): one bar per value, a line
    at 1.0 (as fast as the peer)."""
    bars, width, left, row = plot["bars"], 640, 190, 26
    top = max([1.0] + [b["value"] for b in bars]) * 1.1
    x = lambda v: left + (width - left - 50) * v / top       # noqa: E731
    h = row * len(bars) + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" '
           f'role="img" aria-label="{plot["title"]}" style="font: 12px sans-serif">']
    for i, b in enumerate(bars):
        y = 10 + i * row
        out.append(f'<text x="{left - 8}" y="{y + 15}" text-anchor="end">{b["label"]}</text>'
                   f'<rect x="{left}" y="{y + 3}" width="{x(b["value"]) - left:.1f}" '
                   f'height="16" fill="#5c6bc0"/><text x="{x(b["value"]) + 4:.1f}" '
                   f'y="{y + 15}">{b["value"]:.2f}x</text>')
    out.append(f'<line x1="{x(1.0):.1f}" y1="6" x2="{x(1.0):.1f}" y2="{h - 14}" '
               f'stroke="#333" stroke-dasharray="3,3"/><text x="{x(1.0):.1f}" y="{h - 2}" '
               f'text-anchor="middle">1.0</text></svg>')
    return "".join(out) + f"\n\n*{plot['title']}.*"
