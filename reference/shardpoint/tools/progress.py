"""Progress bars for long commands: bytes done, rate and time left, on stderr, only when stderr
is a terminal (never in logs, pipes or under ``--json``). Built on ``rich``."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Optional

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID


def wanted(json_output: bool = False, quiet: bool = False) -> bool:
    """True when a bar helps: stderr is a terminal and the output is for a person."""
    return not json_output and not quiet and sys.stderr.isatty()


class Advance:
    """``advance(nbytes)`` moves the bar on; ``advance.set_total(n)`` changes its total. Without
    a bar (``progress`` None) both do nothing, so callers never branch on whether one is drawn."""

    def __init__(self, progress: Optional[Progress] = None, task: Optional[TaskID] = None) -> None:
        self._progress = progress
        self._task = task

    def __call__(self, n: int) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task, n)

    def set_total(self, n: Optional[int]) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, total=n)


@contextmanager
def bar(description: str, total: Optional[int], enabled: bool) -> Iterator[Advance]:
    """Yield an :class:`Advance`; with ``enabled`` a rich bar with bytes and rate is drawn,
    else it does nothing."""
    if not enabled:
        yield Advance()
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    cols = [
        TextColumn("[progress.description]{task.description}"),
        BarColumn(bar_width=24),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    ]
    with Progress(*cols, console=Console(stderr=True), transient=False) as p:
        yield Advance(p, p.add_task(description, total=total))
