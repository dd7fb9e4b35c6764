"""Progress bars with rate and ETA for long work (rich)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text


class RateColumn(ProgressColumn):
    """Items per second, with the unit the caller names (``conv/s``, ``tok/s``...)."""

    def __init__(self, unit: str):
        super().__init__()
        self.unit = unit

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        if speed is None and task.completed and task.elapsed:  # work done in one update: rich has no two samples
            speed = task.completed / task.elapsed
        if speed is None:
            return Text(f"-- {self.unit}/s", style="progress.data.speed")
        return Text(format_rate(speed, self.unit), style="progress.data.speed")


SLOW_RATE = 1.0  # items per second below which the time per item reads better than a rate of "0.3"


def format_rate(per_second: float, unit: str) -> str:
    """A rate with three significant digits (``1,234 tok/s``, ``12.3 tok/s``, ``2.45 steps/s``), or the seconds per
    item when under one a second (``4.2 s/step``, the unit's plural ``s`` dropped)."""
    if per_second <= 0:
        return f"0 {unit}/s"
    if per_second < SLOW_RATE:
        return f"{1 / per_second:,.1f} s/{unit.removesuffix('s') if unit.endswith('s') else unit}"
    decimals = 2 if per_second < 10 else 1 if per_second < 100 else 0
    return f"{per_second:,.{decimals}f} {unit}/s"


def progress_bar(unit: str, console: Console | None = None) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        RateColumn(unit),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console or Console(stderr=True),
        transient=False,
    )
