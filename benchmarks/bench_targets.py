"""The targets of issue 7, checked against one benchmark run: each target's measured ratio,
whether it is met, and beside it the floor that bounds it (the same files written or read
raw), so a target missed for a physical reason reads as such in the same table.

Time ratios are medians of per-round ratios: tools run interleaved, one step each per round,
so a ratio taken within a round cancels the disk's drift between rounds (it moves up to 2x
on this machine), which a ratio of two medians does not."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass
class StateRun:
    """What :func:`print_targets` needs of one state's run: the rows that won the raw write,
    raw read and DCP save families, seconds per round of any row, median peak extra bytes."""

    name: str
    size: int
    raw_write: str
    raw_read: Optional[str]
    dcp_save: str
    series: Callable[[str], list]
    mem: Callable[[str], Optional[float]]


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def per_round(a: list, b: list) -> Optional[float]:
    """The median over rounds of ``a[i] / b[i]`` (None when either row did not run)."""
    pairs = [x / y for x, y in zip(a, b) if y]
    return statistics.median(pairs) if pairs and len(a) == len(b) else None


def _cell(value: Optional[float], limit: float, at_most: bool, context: str = "") -> str:
    if value is None:
        return "n/a"
    ok = value <= limit if at_most else value >= limit
    return f"{value:.2f}x {'met' if ok else 'NOT met'}" + (f" ({context})" if context else "")


def state_rows(runs: list, names: dict) -> list:
    """``[(target, cell per state)]`` for the save/load/async/memory targets. ``names`` maps
    'save', 'async blocking', 'async total', 'load', 'DCP load', 'copy', 'floor write',
    'floor reads' (a list) to the benchmark's row names."""
    rows = []

    def per_state(fn: Callable[[StateRun], str]) -> list:
        return [fn(r) for r in runs]

    def x(r: StateRun, a: Optional[str], b: Optional[str]) -> Optional[float]:
        return per_round(r.series(a), r.series(b)) if a and b else None

    def floor_read(r: StateRun) -> Optional[str]:
        got = [(statistics.median(r.series(n)), n) for n in names["floor reads"] if r.series(n)]
        return min(got)[1] if got else None

    def floor(v: Optional[float]) -> str:
        return f"its files raw: {v:.2f}x" if v is not None else ""

    def _times_raw(who: str, v: Optional[float]) -> str:
        return f"{who} {v:.2f}x the raw write" if v is not None else ""

    rows.append(
        (
            "sync save <= 1.10x the raw write",
            per_state(
                lambda r: _cell(
                    x(r, names["save"], r.raw_write),
                    1.10,
                    True,
                    floor(x(r, names["floor write"], r.raw_write)),
                )
            ),
        )
    )
    rows.append(
        (
            "sync save >= 1.5x faster than DCP at its best",
            per_state(
                lambda r: _cell(
                    x(r, r.dcp_save, names["save"]),
                    1.5,
                    False,
                    _times_raw("DCP", x(r, r.dcp_save, r.raw_write)),
                )
            ),
        )
    )
    rows.append(
        (
            "cold load <= 1.15x the raw read",
            per_state(
                lambda r: _cell(
                    x(r, names["load"], r.raw_read),
                    1.15,
                    True,
                    floor(x(r, floor_read(r), r.raw_read)),
                )
            ),
        )
    )
    rows.append(
        (
            "cold load >= 1.5x faster than DCP",
            per_state(lambda r: _cell(x(r, names["DCP load"], names["load"]), 1.5, False)),
        )
    )
    rows.append(
        (
            "async save blocks <= 1.25x a copy into reused buffers",
            per_state(lambda r: _cell(x(r, names["async blocking"], names["copy"]), 1.25, True)),
        )
    )
    rows.append(
        (
            "async save total <= 1.2x the sync save",
            per_state(lambda r: _cell(x(r, names["async total"], names["save"]), 1.2, True)),
        )
    )
    rows.append(
        (
            "sync save peak extra memory <= 0.10x the state",
            per_state(lambda r: _cell(_ratio(r.mem(names["save"]), r.size), 0.10, True)),
        )
    )
    rows.append(
        (
            "load peak extra memory <= 0.10x the state (no full copy)",
            per_state(lambda r: _cell(_ratio(r.mem(names["load"]), r.size), 0.10, True)),
        )
    )
    return rows


def print_targets(runs: list, names: dict, reshard: dict, note: str = "") -> None:
    """The markdown table of targets for the states in ``runs`` and the resharded loads in
    ``reshard`` (``{ranks: {"cols": [s], "same": [s], "dcp": [s], "raw": [s], "paired":
    bool}}``, seconds per round; "raw" reads the checkpoint's files raw in the same rounds
    (optional); ``paired`` when "same" ran in the same rounds as "cols", else the ratio to it
    is one of medians)."""
    if not runs and not reshard:
        return
    print("\n### Targets (issue 7), from this run\n" + (f"\n{note}\n" if note else ""))
    print("| target | " + " | ".join(r.name for r in runs) + " |")
    print("|---|" + "---|" * max(1, len(runs)))
    for target, cells in state_rows(runs, names) if runs else []:
        print(f"| {target} | " + " | ".join(cells) + " |")
    for w, r in sorted(reshard.items(), reverse=True):
        same = (
            per_round(r["cols"], r["same"])
            if r["paired"]
            else _ratio(statistics.median(r["cols"]), statistics.median(r["same"]))
        )
        dcp_raw = per_round(r["dcp"], r["raw"]) if r.get("raw") else None
        ours_raw = per_round(r["cols"], r["raw"]) if r.get("raw") else None
        cells = [
            _cell(same, 1.25, True, f"{ours_raw:.2f}x its files raw" if ours_raw else ""),
            _cell(
                per_round(r["dcp"], r["cols"]),
                1.5,
                False,
                f"DCP {dcp_raw:.2f}x its files raw" if dcp_raw else "",
            ),
        ]
        print(
            f"| resharded load, {w} ranks by columns: <= 1.25x the same-layout load; "
            f">= 1.5x faster than DCP | {cells[0]}; {cells[1]} |" + " |" * (len(runs) - 1)
        )
    print(
        "\nRatios are medians of per-round ratios (each round runs every tool once, "
        "interleaved). Planning at 4,096 ranks has its own targets: "
        "`python benchmarks/plan_scale.py`."
    )
