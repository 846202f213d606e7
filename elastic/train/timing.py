"""Where a worker's training time goes: seconds per phase, for the log interval (the
``time/<phase>_share`` figures) and for the run (folded into the trainer state at each
checkpoint, so a resumed run's breakdown covers all its sessions)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
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

    @contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        """Count the time in the ``with`` block as ``phase``, less the seconds spent in
        collectives meanwhile (:class:`CollectiveClock`), which count as ``comm``."""
        t0, comm0 = time.perf_counter(), CollectiveClock.seconds()
        yield
        comm = CollectiveClock.seconds() - comm0
        self.add(phase, time.perf_counter() - t0 - comm)
        self.add("comm", comm)

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


# torch.distributed's collectives (those this torch has): DeepSpeed calls each through
# the module at call time, except all_gather_into_tensor and reduce_scatter_tensor,
# which its comm backend keeps a reference to when it starts (so the clock is installed
# before deepspeed.init_distributed)
_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather",
    "all_gather_into_tensor", "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor",
    "_reduce_scatter_base", "all_to_all", "all_to_all_single", "gather", "scatter",
    "barrier", "all_gather_object", "gather_object", "broadcast_object_list",
)  # fmt: skip


class CollectiveClock:
    """Seconds this process spends inside torch.distributed's collectives: the part of
    a forward pass, a backward pass or an optimizer step that is communication, which
    holds the wait for the slowest rank (DeepSpeed's gradient all-reduce or
    reduce-scatter in the backward pass; ZeRO 1/2's gradient-norm all-reduce and
    parameter all-gather in the optimizer step). What is left of the phase is the rank's
    own work: what stragglers are found by.

    An asynchronous collective (``async_op=True``: ZeRO-3's parameter prefetch) counts
    only while it is being started; its wait, where the caller waits on its handle,
    stays in the phase, unless the caller counts it (:meth:`waited`: elastic's own
    overlapped all-reduce does)."""

    _seconds = 0.0
    _installed = False

    @classmethod
    def install(cls) -> None:
        """Wrap the collectives, once a process."""
        if cls._installed:
            return
        import torch.distributed as dist

        for name in _COLLECTIVES:
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, cls._timed(original))
        cls._installed = True

    @classmethod
    def _timed(cls, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                cls._seconds += time.perf_counter() - t0

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        timed.__name__ = fn.__name__
        timed.__doc__ = fn.__doc__
        return timed

    @classmethod
    def waited(cls, seconds: float) -> None:
        """Count ``seconds`` spent waiting on an asynchronous collective's handle."""
        cls._seconds += seconds

    @classmethod
    def seconds(cls) -> float:
        """Seconds inside collectives so far (differences of two readings count)."""
        return cls._seconds
