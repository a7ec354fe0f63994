"""The code blocks of README.md and docs/**/*.md, with how the tests run each.

An HTML comment on the line right before a fence says how (docs/repository.md lists the
keys): ``<!-- test: needs=jax,flax devices=4 -->``, ``<!-- test: skip="why" -->``, ...
A block with no comment runs as it is: ``python`` in one process, ``sh`` with ``bash -e``.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = {
    "name",
    "after",
    "file",
    "needs",
    "ranks",
    "devices",
    "processes",
    "s3",
    "gcs",
    "by",
    "skip",
}
FENCE = re.compile(r"^([ \t]*)```(\w*)[^\n]*$")
COMMENT = re.compile(r"^[ \t]*<!-- test: (.*) -->[ \t]*$")
# import name -> the extra that brings it (for skip reasons)
EXTRA = {
    "jax": "jax",
    "flax": "flax",
    "optax": "flax",
    "orbax.checkpoint": "orbax",
    "tensorstore": "tensorstore",
    "safetensors": "convert",
    "boto3": "s3",
    "moto": "test",
    "megatron.core": "megatron",
    "google.cloud.storage": "gcs",
    "zarr": "zarr",
}


@dataclass
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    opts: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def needs(self) -> list:
        return [m for m in self.opts.get("needs", "").split(",") if m]


def pages() -> list:
    """README.md and every page under docs/, as paths relative to the repository root."""
    found = sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    return ["README.md"] + [os.path.relpath(p, ROOT) for p in found]


def parse_options(text: str, where: str) -> dict:
    opts = {}
    for word in shlex.split(text):
        key, _, value = word.partition("=")
        if key not in KEYS:
            raise ValueError(f"{where}: unknown test option {key!r} (known: {sorted(KEYS)})")
        opts[key] = value if value else True
    if opts.get("skip") is True:
        raise ValueError(f'{where}: skip needs a reason: skip="why"')
    return opts


def blocks(page: str) -> list:
    """Every fenced block of ``page``, its indentation removed, with its test options."""
    lines = open(os.path.join(ROOT, page), encoding="utf-8").read().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2), i
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        body = [x[len(indent) :] if x.startswith(indent) else x for x in lines[i + 1 : j]]
        c = COMMENT.match(lines[start - 1]) if start else None
        opts = parse_options(c.group(1), f"{page}:{start + 1}") if c else {}
        out.append(Block(page, start + 1, lang, "\n".join(body) + "\n", opts))
        i = j + 1
    return out


def all_blocks() -> list:
    return [b for p in pages() for b in blocks(p)]


def named(page: str, name: str) -> Block:
    """The block of ``page`` that ``after=name`` means (``name=`` or ``file=``)."""
    for b in blocks(page):
        if b.opts.get("name") == name or b.opts.get("file") == name:
            return b
    raise LookupError(f"{page}: no block named {name!r}")


def find(page: str, marker: str) -> Block:
    """The python block of ``page`` whose code contains ``marker``."""
    found = [b for b in blocks(page) if b.lang == "python" and marker in b.code]
    assert len(found) == 1, f"{page}: {len(found)} python blocks contain {marker!r}"
    return found[0]
