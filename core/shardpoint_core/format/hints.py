"""Hints for readers given a path that holds something else than a checkpoint (another
format, with the command that converts it). Tools register what they can recognise; the
core asks them on its error paths only, so a load of a sound checkpoint imports none."""

from __future__ import annotations

from typing import Callable

_PATH_HINTS: list[Callable[[str], str]] = []


def register_path_hint(fn: Callable[[str], str]) -> None:
    """Add ``fn(path) -> " (it holds ...)"`` or ``""``, asked in turn by :func:`path_hint`."""
    if fn not in _PATH_HINTS:
        _PATH_HINTS.append(fn)


def path_hint(path: str) -> str:
    """The first registered hint for ``path``, or ``""``."""
    for fn in _PATH_HINTS:
        h = fn(path)
        if h:
            return h
    return ""
