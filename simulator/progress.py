"""Progress of long runs (benchmarks, `fleetgate simulate`), on stderr so stdout stays the result.

    with Progress("P/D sizing", total=len(cases)) as bar:
        for case in cases:
            ...
            bar.step(f"{case}: 3 workers")      # one finished unit, with a note

On a terminal (stderr is a TTY) it is a `rich` bar with the count, elapsed time, an ETA and the last note. Not
on a terminal (CI logs, `2> file`) each step is one plain line, `[3/12 41s] note`, so a long run is never
silent. FLEETGATE_PROGRESS=bar / lines / off forces a mode; `mode="off"` in code too. Nothing is written to
stdout.
"""

from __future__ import annotations

import os
import sys
import time
from types import TracebackType
from typing import Any, TextIO

MODES = ("bar", "lines", "off")
ENV = "FLEETGATE_PROGRESS"


def choose_mode(stream: TextIO, mode: str | None = None) -> str:
    mode = mode or os.environ.get(ENV) or ("bar" if _isatty(stream) else "lines")
    if mode not in MODES:
        raise ValueError(f"progress mode {mode!r}: expected one of {', '.join(MODES)}")
    return mode


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    def __init__(self, description: str, total: int | None = None, mode: str | None = None,
                 stream: TextIO | None = None) -> None:
        self.description = description
        self.total = total
        self.stream = stream or sys.stderr
        self.mode = choose_mode(self.stream, mode)
        self.done = 0
        self._t0 = time.perf_counter()
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        return self.start()

    def start(self) -> Progress:
        """Show the bar (or the heading line); `with Progress(...)` calls it, else pair it with `close()`."""
        self._t0 = time.perf_counter()
        if self.mode == "bar":
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[note]}"),
                                     console=Console(file=self.stream), transient=False)
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=self.total, note="")
        elif self.mode == "lines":
            total = f" ({self.total} steps)" if self.total else ""
            print(f"{self.description}{total}", file=self.stream, flush=True)
        return self

    def step(self, note: str = "", n: int = 1) -> None:
        """`n` units finished; `note` says what (shown beside the bar, or as the line)."""
        self.done += n
        if self.mode == "bar":
            self._bar.update(self._task, advance=n, note=note)
        elif self.mode == "lines":
            of = f"/{self.total}" if self.total else ""
            print(f"  [{self.done}{of} {time.perf_counter() - self._t0:.0f}s] {note}", file=self.stream, flush=True)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
