"""Where a worker's training time goes: seconds per phase, for the log interval (the
``time/<phase>_share`` figures) and for the run (folded into the trainer state at each
checkpoint, so a resumed run's breakdown covers all its sessions)."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from elastic.observe.summary import PHASES

COMPUTE = ("forward", "backward", "optimizer")
"""A rank's own work in a step (no collective wait): what stragglers are found by."""


class PhaseTimes:
    def __init__(self) -> None:
        self._run: dict[str, float] = defaultdict(float)  # since the last fold
        self._interval: dict[str, float] = defaultdict(float)  # since the last log line
        self.session_start = time.perf_counter()

    def add(self, phase: str, seconds: float) -> None:
        self._run[phase] += seconds
        self._interval[phase] += seconds

    def since(self, phase: str, t0: float) -> None:
        """Count the time from ``t0`` (``time.perf_counter()``) to now as ``phase``."""
        self.add(phase, time.perf_counter() - t0)

    def take_interval(self) -> dict[str, float]:
        """Each phase's seconds in the log interval; starts a new interval."""
        seconds = {p: self._interval[p] for p in PHASES}
        self._interval.clear()
        return seconds

    def fold_into(self, state: Any) -> None:
        """Add this session's phase seconds and wall time to the trainer state."""
        for phase, seconds in self._run.items():
            state.time_s[phase] = state.time_s.get(phase, 0.0) + seconds
        now = time.perf_counter()
        state.train_wall_s += now - self.session_start
        self.session_start = now
        self._run.clear()
