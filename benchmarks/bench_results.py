"""The structured results a benchmark script writes with ``--json PATH``: every row's raw
measurements with their median, min and max, the ratios the script prints, and what the run
was (command, parameters, machine, date, commit). ``docs/_hooks/generated.py`` renders these
files as the tables and plots of the documentation's benchmark page, so no figure there is
copied by hand.

A file holds ``schema`` (:data:`SCHEMA`), ``title``, ``source`` (the command line),
``script``, ``date``, ``commit``, ``machine``, ``config`` and ``tables``; a table holds
``name``, ``title``, ``unit`` (of the measurements), optional ``bytes`` (what each
measurement moved, so rates can be given) and ``rows``; a row holds ``label``, ``values``,
``median``, ``min``, ``max``, optional ``bytes`` (when it moved other bytes than the
table's) and optional ``ratios`` (name -> ``value``, and ``per_round``
median/min/max where the script pairs rounds) and ``note``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from typing import Optional, Sequence

SCHEMA = "shardpoint-bench/1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stats(values: Sequence[float]) -> dict:
    """``median``, ``min`` and ``max`` of ``values`` (all None when there are none)."""
    v = list(values)
    if not v:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(v), "min": min(v), "max": max(v)}


def ratio(
    values: Sequence[float], ref: Sequence[float], invert: bool = False, paired: bool = True
) -> Optional[dict]:
    """``values`` over ``ref`` (or ``ref`` over ``values`` with ``invert``): ``value`` is
    the ratio of the medians; ``per_round`` the median/min/max of the round-by-round ratios,
    when both ran in the same rounds (``paired``, and as many)."""
    if not values or not ref:
        return None
    a, b = (ref, values) if invert else (values, ref)
    out = {"value": statistics.median(a) / statistics.median(b)}
    if paired and len(a) == len(b) and all(b):
        out["per_round"] = stats([x / y for x, y in zip(a, b)])
    return out


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> dict:
    """What the figures depend on: CPUs, memory, kernel, Python and load at the start."""
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    out = {
        "nproc": os.cpu_count(),
        "memory_bytes": mem,
        "kernel": f"{platform.system()} {platform.release()}",
        "arch": platform.machine(),
        "python": platform.python_version(),
    }
    try:
        out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return out


class Record:
    """One run's results, filled in as the script prints its tables."""

    def __init__(
        self,
        script: str,
        title: str,
        argv: Optional[Sequence[str]] = None,
        config: Optional[dict] = None,
        versions: Optional[dict] = None,
    ) -> None:
        argv = list(sys.argv[1:] if argv is None else argv)
        shown = []  # the command without where the file went (it is the file)
        skip = False
        for x in argv:
            if skip:
                skip = False
            elif x == "--json":
                skip = True
            elif not x.startswith("--json="):
                shown.append(x)
        self.data = {
            "schema": SCHEMA,
            "title": title,
            "source": " ".join(["python", f"benchmarks/{script}", *map(shlex.quote, shown)]),
            "script": f"benchmarks/{script}",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": _git("rev-parse", "HEAD")[:12] or None,
            "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
            "machine": dict(machine(), **(versions or {})),
            "config": dict(config or {}),
            "tables": [],
        }

    def table(
        self, name: str, title: str, unit: str = "s", nbytes: Optional[int] = None, note: str = ""
    ) -> dict:
        t = {"name": name, "title": title, "unit": unit, "rows": []}
        if nbytes is not None:
            t["bytes"] = nbytes
        if note:
            t["note"] = note
        self.data["tables"].append(t)
        return t

    @staticmethod
    def row(
        table: dict,
        label: str,
        values: Sequence[float],
        ratios: Optional[dict] = None,
        note: str = "",
        **extra,
    ) -> dict:
        r = {"label": label, "values": list(values), **stats(values)}
        ratios = {k: v for k, v in (ratios or {}).items() if v is not None}
        if ratios:
            r["ratios"] = ratios
        if note:
            r["note"] = note
        r.update(extra)
        table["rows"].append(r)
        return r

    def write(self, path: str) -> None:
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.data, f, indent=1)
            f.write("\n")
