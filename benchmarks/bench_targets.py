"""The targets of issue 7, checked against one benchmark run: each target's measured ratio,
whether it is met, and beside it the floor that bounds it (the same files written or read
raw), so a target missed for a physical reason reads as such in the same table."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass
class StateRun:
    """What :func:`targets_table` needs of one state's run (medians in seconds, bytes)."""

    name: str
    size: int
    raw_write: float
    raw_read: Optional[float]
    dcp_save: float
    med: Callable[[str], Optional[float]]
    mem: Callable[[str], Optional[float]]


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


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

    def floor_read(r: StateRun) -> Optional[float]:
        got = [r.med(n) for n in names["floor reads"] if r.med(n) is not None]
        return min(got) if got else None

    def floor(v: Optional[float]) -> str:
        return f"its files raw: {v:.2f}x" if v is not None else ""

    rows.append(("sync save <= 1.10x the raw write", per_state(lambda r: _cell(
        _ratio(r.med(names["save"]), r.raw_write), 1.10, True,
        floor(_ratio(r.med(names["floor write"]), r.raw_write))))))
    rows.append(("sync save >= 1.5x faster than DCP at its best", per_state(lambda r: _cell(
        _ratio(r.dcp_save, r.med(names["save"])), 1.5, False,
        f"DCP {r.dcp_save / r.raw_write:.2f}x the raw write"))))
    rows.append(("cold load <= 1.15x the raw read", per_state(lambda r: _cell(
        _ratio(r.med(names["load"]), r.raw_read), 1.15, True,
        floor(_ratio(floor_read(r), r.raw_read))))))
    rows.append(("cold load >= 1.5x faster than DCP", per_state(lambda r: _cell(
        _ratio(r.med(names["DCP load"]), r.med(names["load"])), 1.5, False))))
    rows.append(("async save blocks <= 1.25x a copy into reused buffers", per_state(
        lambda r: _cell(_ratio(r.med(names["async blocking"]), r.med(names["copy"])), 1.25,
                        True))))
    rows.append(("async save total <= 1.2x the sync save", per_state(lambda r: _cell(
        _ratio(r.med(names["async total"]), r.med(names["save"])), 1.2, True))))
    rows.append(("sync save peak extra memory <= 0.10x the state", per_state(lambda r: _cell(
        _ratio(r.mem(names["save"]), r.size), 0.10, True))))
    rows.append(("load peak extra memory <= 0.10x the state (no full copy)", per_state(
        lambda r: _cell(_ratio(r.mem(names["load"]), r.size), 0.10, True))))
    return rows


def print_targets(runs: list, names: dict, reshard: dict, note: str = "") -> None:
    """The markdown table of targets for the states in ``runs`` and the resharded loads in
    ``reshard`` (``{ranks: {"cols": s, "same": s, "dcp": s}}``, medians)."""
    if not runs and not reshard:
        return
    print("\n### Targets (issue 7), from this run\n" + (f"\n{note}\n" if note else ""))
    print("| target | " + " | ".join(r.name for r in runs) + " |")
    print("|---|" + "---|" * len(runs))
    for target, cells in state_rows(runs, names):
        print(f"| {target} | " + " | ".join(cells) + " |")
    for w, r in sorted(reshard.items(), reverse=True):
        cells = [_cell(_ratio(r["cols"], r["same"]), 1.25, True),
                 _cell(_ratio(r["dcp"], r["cols"]), 1.5, False)]
        print(f"| resharded load, {w} ranks by columns: <= 1.25x the same-layout load; "
              f">= 1.5x faster than DCP | {cells[0]}; {cells[1]} |" + " |" * (len(runs) - 1))
    print("\nPlanning at 4,096 ranks has its own targets: `python benchmarks/plan_scale.py`.")
