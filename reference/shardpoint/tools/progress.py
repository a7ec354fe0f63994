"""Progress bars for long commands: bytes done, rate and time left, on stderr, only when stderr
is a terminal (never in logs, pipes or under ``--json``). Built on ``rich``."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator, Optional


def wanted(json_output: bool = False, quiet: bool = False) -> bool:
    """True when a bar helps: stderr is a terminal and the output is for a person."""
    return not json_output and not quiet and sys.stderr.isatty()


@contextmanager
def bar(description: str, total: Optional[int], enabled: bool) -> Iterator[Callable]:
    """Yield ``advance(nbytes)``; with ``enabled`` a rich bar with bytes and rate is drawn,
    else ``advance`` does nothing. ``set_total(n)`` on the function changes the total."""
    if not enabled:
        def advance(n: int) -> None:
            pass
        advance.set_total = lambda n: None
        yield advance
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                               TimeRemainingColumn, TransferSpeedColumn)
    cols = [TextColumn("[progress.description]{task.description}"), BarColumn(bar_width=24),
            DownloadColumn(binary_units=True), TransferSpeedColumn(), TimeRemainingColumn()]
    with Progress(*cols, console=Console(stderr=True), transient=False) as p:
        task = p.add_task(description, total=total)

        def advance(n: int) -> None:
            p.advance(task, n)
        advance.set_total = lambda n: p.update(task, total=n)
        yield advance
