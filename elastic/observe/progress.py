"""The driver's progress display: step, ETA, world size and loss.

Rank 0 sends its log line's numbers to the run's control actor; the driver's control
thread hands the latest to :class:`DriverProgress`. On a terminal that is a live bar
(rich); in a batch job's log, a plain line every ``trainer.progress_every_s`` (the
workers' own lines are there too, without the ETA).
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class DriverProgress:
    def __init__(
        self, total_steps: int, mode: str = "auto", every_s: float = 30.0, out: TextIO | None = None
    ) -> None:
        self.out = out or sys.stdout
        if mode == "auto":
            mode = "bar" if self.out.isatty() else "plain"
        self.mode, self.total, self.every_s = mode, total_steps, every_s
        self._last_print = 0.0
        self._last: dict[str, Any] | None = None  # the latest update
        self._shown: dict[str, Any] | None = None  # the latest plain line printed
        self._first: tuple[float, int] | None = None  # (time, step) of the first update
        self._bar: Any = None
        self._task: Any = None
        if mode == "bar":
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn("[bold]step"),
                BarColumn(bar_width=16),
                MofNCompleteColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=Console(file=self.out, force_terminal=True),
                transient=False,
            )
            self._task = self._bar.add_task("starting", total=total_steps or None)
            self._bar.start()

    def eta_s(self, step: int, now: float) -> float | None:
        """Seconds left at this run's rate since the driver's first update (restarts and
        resumes included, as the user waits through them too)."""
        if not self.total or self._first is None:
            return None
        t0, s0 = self._first
        if step <= s0 or now <= t0:
            return None
        return (self.total - step) * (now - t0) / (step - s0)

    def update(self, p: dict[str, Any] | None, final: bool = False) -> None:
        """Show rank 0's latest numbers; ``final``: the run's last, printed in any case
        (unless already shown)."""
        if p is None or (p == self._last and not final) or p == self._shown:
            return
        self._last = p
        now = time.time()
        if self._first is None or p["step"] < self._first[1]:  # a restart went back
            self._first = (now, p["step"])
        detail = (
            f"epoch {p['epoch']} | loss {p['loss']:.5g} | {p['samples_per_s']:,.0f} samples/s "
            f"| world {p['world']}"
        )
        if self._bar is not None:
            self._bar.update(self._task, completed=p["step"], description=detail)
        elif self.mode == "plain" and (final or now - self._last_print >= self.every_s):
            self._last_print, self._shown = now, p
            of = f"/{self.total} ({100 * p['step'] / self.total:.0f}%)" if self.total else ""
            eta = _eta(self.eta_s(p["step"], now))
            print(f"[elastic] progress: step {p['step']}{of} | eta {eta} | {detail}", file=self.out)
            self.out.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def total_steps(max_steps: int, max_epochs: int, stop_at: int, rows: int, batch: int) -> int:
    """Steps the run will take (0 if unknown): the tighter of the step and epoch bounds."""
    bounds = [b for b in (max_steps, stop_at) if b > 0]
    if max_epochs > 0 and batch > 0:
        bounds.append(max_epochs * -(-rows // batch))
    return min(bounds) if bounds else 0
