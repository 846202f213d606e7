"""A worker group's start and its steady throughput, as the run's records report them.

The group's start is timed in parts (``startup``: data, distributed, engine, restore,
each since the previous; the worker entry measures them) plus its first batch and first
step, and reported once, at the end of the first step (the ``startup`` event: restarts
are what elastic waits on). Samples/s count from the end of that step: the pipeline's
start-up (the first batch) is in the data wait, not in the throughput.
"""

from __future__ import annotations

import time

from elastic.data.reader import PlannedReader
from elastic.data.stream import StepBatch
from elastic.observe.tracking import NullTracker


class Throughput:
    """``startup``: the worker entry's marks (``since``: the group's start, then the
    seconds of each part); ``gradient_reduce``: whose gradient all-reduce the group
    runs (elastic's overlapped one or DeepSpeed's)."""

    def __init__(
        self, tracker: NullTracker, world: int, startup: dict[str, float], gradient_reduce: str
    ) -> None:
        self.tracker, self.world, self.startup = tracker, world, startup
        self.gradient_reduce = gradient_reduce
        self._first_batch_s: float | None = None  # group start -> its first batch here
        self._data_ready_s: float | None = None  # group start -> its first batch read
        self.steady_start: float | None = None
        self.steady_samples = 0
        self._end: float | None = None

    def batch(self, at: float, reader: PlannedReader | None) -> None:
        """A batch arrived at ``at`` (perf_counter): the group's first is timed."""
        if self._first_batch_s is not None or not self.startup:
            return
        self._first_batch_s = at - self.startup["since"]
        if reader is not None and reader.first_batch_ready_s is not None:
            # the reader started with the group (before DeepSpeed, the restore)
            self._data_ready_s = reader.first_batch_ready_s
            self._data_ready_s += reader.started - self.startup["since"]

    def step(self, step: int, batch: StepBatch) -> None:
        """A step ended: the first reports the group's start; the others count."""
        if self.steady_start is None:
            self.steady_start, self.steady_samples = time.perf_counter(), 0
            self._note_startup(step)
        else:
            self.steady_samples += batch.global_rows

    def end(self) -> None:
        """Training ended (before the final validation and checkpoint)."""
        self._end = time.perf_counter()

    def samples_per_s(self) -> float:
        """Samples a second from the end of the first step to the end of training."""
        end = self._end or time.perf_counter()
        steady_s = end - (self.steady_start or end)
        return self.steady_samples / steady_s if steady_s > 0 else 0.0

    def _note_startup(self, step: int) -> None:
        if not self.startup:
            return
        parts = {k: round(v, 3) for k, v in self.startup.items() if k != "since"}
        self.tracker.event(
            step,
            "startup",
            world_size=self.world,
            gradient_reduce=self.gradient_reduce,
            **parts,
            first_batch_s=round(self._first_batch_s or 0.0, 3),
            data_ready_s=round(self._data_ready_s or 0.0, 3),
            first_step_s=round(time.perf_counter() - self.startup["since"], 3),
        )
