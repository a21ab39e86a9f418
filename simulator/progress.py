"""Progress of long runs on stderr (`fleetgate simulate`, the benchmarks): a rich progress bar when stderr is a
terminal, a plain line every 10% otherwise (logs, CI), nothing at all with FLEETGATE_PROGRESS=0."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Progress = Callable[[int, int], None]


@contextmanager
def stderr_progress(label: str) -> Iterator[Progress]:
    """A `progress(done, total)` callback for the duration of the block."""
    if os.environ.get("FLEETGATE_PROGRESS", "1") == "0":
        yield lambda done, total: None
        return
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        with Bar("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                 TimeRemainingColumn(), transient=True, console=Console(stderr=True)) as bar:
            task = bar.add_task(label, total=None)

            def update(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            yield update
        return
    t0 = time.monotonic()
    last = [-1]

    def line(done: int, total: int) -> None:
        pct = done * 100 // max(total, 1)
        if pct // 10 != last[0] // 10:
            last[0] = pct
            print(f"{label}: {pct}% ({done}/{total}) after {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)

    yield line
