"""Store options from the environment: ``SHARDPOINT_<STORE>_*`` settings (timeouts,
deadlines, attempts) that a job sets once for every process, parsed in one place."""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Tuple

from shardpoint_core.format.errors import InvalidOptionError


def numbers_from_env(settings: Mapping[str, Tuple[str, Callable[[str], Any]]]) -> dict[str, Any]:
    """``{field: value}`` for each ``field: (variable, kind)`` whose variable is set and not
    blank, converted by ``kind`` (``float``, ``int``); a value that does not convert is an
    :class:`InvalidOptionError` naming the variable."""
    got: dict[str, Any] = {}
    for field, (name, kind) in settings.items():
        v = os.environ.get(name, "").strip()
        if v:
            try:
                got[field] = kind(v)
            except ValueError:
                raise InvalidOptionError(f"{name}={v!r} is not a number") from None
    return got
