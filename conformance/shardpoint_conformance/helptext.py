"""The help text of the conformance commands: each sub-command's ``--help`` repeats its
summary and ends with examples (one module that the command modules import, so that none of
them imports the command line)."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any


def examples(text: str) -> str:
    """An ``examples:`` epilog (one command per line, ``#`` comments kept)."""
    return "examples:\n" + textwrap.indent(textwrap.dedent(text).strip(), "  ")


def add_command(sub: Any, name: str, help: str, example: str) -> argparse.ArgumentParser:
    """A sub-command whose ``--help`` repeats its summary and ends with examples."""
    return sub.add_parser(
        name,
        help=help,
        description=textwrap.fill(help[0].upper() + help[1:] + "."),
        epilog=examples(example),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
