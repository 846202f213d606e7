"""Interval logging: what a worker group logs at its log steps (the
:class:`~elastic.train.schedule.Schedule` says which).

At a log step every rank's figures since the last one (its loss sum, and the straggler
figures: compute, data wait and collective seconds, rows, steps, optimizer seconds) are
gathered to every rank in one all-gather. From that table, the same on every rank: the
logged line (the run's loss is the sum of every rank's per-row losses over the rows,
not a mean of means), each rank's figures, and the stragglers the watch finds, which
the caller hands to the stragglers policy (:mod:`elastic.train.straggler_actions`).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from elastic.config.schema import TrainerConfig
from elastic.observe.tracking import NullTracker
from elastic.train.checkpoint import TrainerState
from elastic.train.stragglers import FIGURES, StragglerWatch
from elastic.train.timing import COMPUTE, PhaseTimes


class IntervalLog:
    """One rank's log intervals. ``progress`` is the run's control actor on rank 0 (the
    driver's progress display, never waited on) and None elsewhere."""

    def __init__(
        self,
        cfg: TrainerConfig,
        tracker: NullTracker,
        watch: StragglerWatch,
        world: int,
        device: torch.device,
        progress: Any = None,
    ) -> None:
        self.cfg, self.tracker, self.watch = cfg, tracker, watch
        self.world, self.device, self._progress = world, device, progress
        self._sums = torch.zeros(3, dtype=torch.float64)  # loss sum, rows, steps
        self._start = time.perf_counter()
        self._warm = False  # an interval after the group's first step has begun

    def add(self, loss_sum: torch.Tensor, rows: int) -> None:
        """A step this rank trained: the sum of its rows' losses, and their number."""
        self._sums[0] += loss_sum
        self._sums[1] += rows
        self._sums[2] += 1

    def log(
        self, state: TrainerState, times: PhaseTimes, lr: float, digest: int
    ) -> list[dict[str, Any]]:
        """Collective (an all-gather): log the interval that ends at ``state.step``
        (``digest``: which rows the step trained, agreed by every rank). The stragglers
        found in it (events already logged)."""
        s = state
        now = time.perf_counter()
        elapsed = now - self._start
        seconds = times.take_interval()  # this rank's phases
        table = self._gather(seconds)  # every rank's: loss sum, then FIGURES
        rows = float(table[:, 1 + FIGURES.index("rows")].sum())
        loss = float(table[:, 0].sum() / rows)
        samples_per_s = rows / elapsed if elapsed > 0 else 0.0
        shares = {p: v / elapsed if elapsed > 0 else 0.0 for p, v in seconds.items()}
        # the group's first interval holds its first step: no measure of anyone's speed
        warmup, self._warm = not self._warm, True
        per_worker, stragglers = self.watch.observe(table[:, 1:], warmup)
        if s.loss_first is None:
            s.loss_first = loss
        s.loss_last = loss
        self.tracker.log(
            s.step,
            {
                "train/loss": loss,
                "train/lr": lr,
                "train/samples_per_s": samples_per_s,
                "train/samples_per_s_per_worker": samples_per_s / self.world,
                "train/data_wait_share": shares["data_wait"],
                "train/epoch": s.epoch,
                "train/world_size": self.world,
                "train/samples_seen": s.samples_seen,
                # which rows the step trained (the same at any world size): a run's
                # batches can be compared with another's without reading its data
                "train/batch_digest": digest,
                **{f"time/{p}_share": v for p, v in shares.items()},
                **per_worker,  # each rank's compute, data wait, communication, speed
            },
            console=(
                f"[elastic] step {s.step}{self._of_max()} epoch {s.epoch} | loss {loss:.6g} | "
                f"{samples_per_s:,.0f} samples/s | data wait {100 * shares['data_wait']:.1f}% "
                f"| world {self.world}"
            ),
        )
        for event in stragglers:
            self.tracker.event(s.step, "straggler", world_size=self.world, **event)
        if self._progress is not None:  # the driver's progress display; never waited on
            self._progress.progress.remote(s.step, s.epoch, loss, self.world, samples_per_s)
        self._sums.zero_()
        self._start = now
        return stragglers

    def _gather(self, seconds: dict[str, float]) -> np.ndarray:
        """Every rank's interval, a row per rank: its loss sum, then :data:`FIGURES`."""
        loss_sum, rows, steps = self._sums.tolist()
        figures = {
            "compute_s": sum(seconds[p] for p in COMPUTE),
            "data_wait_s": seconds["data_wait"],
            "comm_s": seconds["comm"],
            "rows": rows,
            "steps": steps,
            "optimizer_s": seconds["optimizer"],
        }
        mine = torch.tensor(
            [loss_sum, *(figures[k] for k in FIGURES)], dtype=torch.float64, device=self.device
        )
        rows_of = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(rows_of, mine)
        return torch.stack(rows_of).cpu().numpy()

    def _of_max(self) -> str:
        return f"/{self.cfg.max_steps}" if self.cfg.max_steps else ""
