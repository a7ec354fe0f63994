"""Text output helpers shared by the commands: byte sizes, and tables that fit the terminal
(80 columns when the output is not a terminal)."""

from __future__ import annotations

import shutil
from typing import Any, Sequence


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def width() -> int:
    """The terminal's width, 80 when the output is piped (``COLUMNS`` overrides)."""
    return max(40, shutil.get_terminal_size((80, 24)).columns)


def _cut(s: str, w: int, keep_end: bool) -> str:
    if len(s) <= w:
        return s
    if w <= 3:
        return s[:w]
    return "..." + s[-(w - 3) :] if keep_end else s[: w - 3] + "..."


def fit_table(
    rows: Sequence[Sequence[str]],
    total: int,
    shrink: Sequence[int],
    keep_end: Sequence[int] = (),
    min_width: int = 10,
) -> list:
    """Lines of a left-aligned table with a rule under the header row, shrinking the columns
    listed in ``shrink`` (in that order, cutting cells with '...') until it fits ``total``."""
    ncol = len(rows[0])
    widths = [max(len(r[i]) for r in rows) for i in range(ncol)]
    over = sum(widths) + 2 * (ncol - 1) - total
    for c in shrink:
        if over <= 0:
            break
        cut = min(over, max(0, widths[c] - max(min_width, len(rows[0][c]))))
        widths[c] -= cut
        over -= cut
    out = []
    for i, r in enumerate(rows):
        cells = [_cut(x, w, c in keep_end) for c, (x, w) in enumerate(zip(r, widths))]
        out.append("  ".join(x.ljust(w) for x, w in zip(cells, widths)).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def is_array(v: Any) -> bool:
    """A tensor or array of any framework (has a dtype and a shape), not a number."""
    return hasattr(v, "dtype") and hasattr(v, "shape") and not isinstance(v, (int, float))


def jsonable(v: Any) -> Any:
    """Values as JSON (``inspect --json``, ``inspect --values``): scalars and containers as
    themselves, non-finite floats, bytes and arrays described."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if v == v and v not in (float("inf"), float("-inf")) else repr(v)
    if is_array(v):
        return {"$array": str(v.dtype).replace("torch.", ""), "shape": list(v.shape)}
    if isinstance(v, (bytes, bytearray)):
        return {"$bytes": len(v)}
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    return repr(v)
