"""The names a save leaves beside its target and what each one is ([SP-COMMIT-4], [SP-COMMIT-6]).

A save of ``<name>`` stages into ``.<name>.shardpoint-tmp-<token>``; a replacement without an
atomic exchange moves the previous checkpoint aside to ``.<name>.shardpoint-old-<token>``.
One codec for those names, used by every committer, by ``recover`` and by both managers.

Example::

    n = leftover_name("step_00000042", "tmp", "a1b2c3")    # '.step_00000042.shardpoint-tmp-a1b2c3'
    assert parse_leftover(n) == ("step_00000042", "tmp", "a1b2c3")
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

KINDS = ("tmp", "old")
_NAME = re.compile(r"^\.(?P<name>.+)\.shardpoint-(?P<kind>tmp|old)-(?P<token>[0-9a-zA-Z]+)$")
_TOKEN = re.compile(r"^[0-9a-zA-Z]+$")


def leftover_name(name: str, kind: str, token: str) -> str:
    """The hidden name of a ``kind`` ('tmp' or 'old') directory of the save ``token`` of
    target ``name`` (a base name, no separator)."""
    if kind not in KINDS or not _TOKEN.match(token) or not name or "/" in name:
        raise ValueError(f"no leftover name for ({name!r}, {kind!r}, {token!r})")
    return f".{name}.shardpoint-{kind}-{token}"


def parse_leftover(name: str) -> Optional[tuple[str, str, str]]:
    """``(target name, kind, token)`` for a leftover's base name, None for any other name."""
    m = _NAME.match(name)
    return None if m is None else (m["name"], m["kind"], m["token"])


@dataclass(frozen=True)
class Leftover:
    """A hidden directory a save left beside its target ``<name>`` ([SP-COMMIT-6]): ``kind``
    is 'tmp' (staging, or a checkpoint an exchange replaced) or 'old' (the previous checkpoint
    of a non-atomic replacement). ``newest_mtime`` is the latest modification time of anything
    in it (a hint that a save may still be writing it); ``in_use`` is True when a running save
    on this host holds the directory's lock, False when none does, None when the store or
    file system cannot tell."""

    path: str
    target: str
    kind: str
    token: str
    has_manifest: bool
    newest_mtime: float
    in_use: Optional[bool] = None
