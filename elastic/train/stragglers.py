"""Stragglers: every rank's own work per step, compared across the ranks.

In lock-step data parallelism each step waits for the slowest rank, so a slow node (a
throttled GPU, a noisy neighbour, an older node type) sets the pace of all. Each log
interval every rank's figures per step (:data:`FIGURES`: its compute time, i.e. forward
+ local backward + optimizer without the collectives' wait; its data wait; its time in
the collectives; its rows) are gathered on every rank; a rank whose compute time is over
``stragglers.threshold`` x the median of the *other* ranks' for ``stragglers.window``
intervals in a row is a straggler. (Against the others' median, not all ranks': with 2
workers the median of both is their mean, and a rank 2x slower would read 1.33x.)

``stragglers.policy=rebalance``: every ``window`` intervals each rank's share of every
step's rows is set so that the ranks' compute times come out equal, from what the
intervals since the split last changed measured (up to :data:`HISTORY_WINDOWS` windows
of them, so that a split that stays is judged on more and more of them; a change needs
the imbalance to stand :data:`NOISE_Z` standard errors out of their interval-to-interval
noise): rank r's time per step is taken as ``a_r + b_r * rows_r``, fitted from this
split and the one before, when its rows differ by :data:`FIT_APART` (forward and
backward have fixed costs per step too: at 1/3 of a core, a 1024-wide MLP's 5-row slice
took as long as a 15-row one; closer, a window's noise is the slope); before there are
two splits, ``a_r`` is its optimizer time and ``b_r`` the rest per row, a model whose
split falls short of the even one, never past it (for times linear in the rows). The
step's rows and the gradient (the mean over all of them) stay the same; only who trains
which rows changes.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from elastic.config.schema import StragglersConfig
from elastic.data.order import slice_sizes

FIGURES = ("compute_s", "data_wait_s", "comm_s", "rows", "steps", "optimizer_s")
"""What each rank sends each log interval (sums over the interval)."""

SHARE_SCALE = 10_000  # a rebalanced split's shares sum to this
MIN_MOVE = 0.01  # a new split must move this share of the global batch (else noise)
EVEN = 0.02  # compute times this close (slowest / fastest - 1) are left as they are
FIT_APART = 0.05  # rows this far apart (a share of each rank's) to fit a + b * rows from
NOISE_Z = 2.0  # a move needs the imbalance this many standard errors over the noise
HISTORY_WINDOWS = 4  # a split is judged on up to this many windows of intervals


class StragglerWatch:
    """The ranks' figures interval by interval: who is slow, and the group's means."""

    def __init__(self, cfg: StragglersConfig, where: list[dict[str, Any]]) -> None:
        """``where``: each rank's ``node`` and ``pid``, by rank."""
        self.cfg, self.where = cfg, where
        world = len(where)
        self._streak = np.zeros(world, dtype=np.int64)  # intervals in a row over threshold
        self._flagged: set[int] = set()  # reported, and not fast again since
        self._sums = np.zeros((world, len(FIGURES)))
        # each interval's table since the split last changed (the newest HISTORY_WINDOWS
        # windows), and the intervals since rebalance() last looked
        self._at_split: deque[np.ndarray] = deque(maxlen=HISTORY_WINDOWS * cfg.window)
        self._intervals_since_check = 0
        self.shares: tuple[int, ...] | None = None  # None: equal shares
        self._anchor: tuple[np.ndarray, np.ndarray] | None = None  # the last split's

    def observe(
        self, table: np.ndarray, warmup: bool = False
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """One interval's sums, a row per rank (columns :data:`FIGURES`): the figures to
        log (per rank, per step) and the straggler events this interval starts.
        ``warmup``: the interval holds the worker group's first step (first-touch
        allocations, lazy initialisation: ~50x a later step, and not alike on every
        rank): logged, but kept out of the means, the streaks and the rebalancing."""
        table = np.asarray(table, dtype=np.float64)
        if not warmup:
            self._sums += table
            self._at_split.append(table.copy())
            self._intervals_since_check += 1
        steps = np.maximum(table[:, FIGURES.index("steps")], 1)
        compute = table[:, 0] / steps
        rows = table[:, FIGURES.index("rows")]
        figures: dict[str, Any] = {}
        for r in range(len(table)):
            figures[f"worker_compute_s/rank{r}"] = compute[r]
            figures[f"worker_data_wait_s/rank{r}"] = table[r, 1] / steps[r]
            figures[f"worker_comm_s/rank{r}"] = table[r, 2] / steps[r]
            speed = rows[r] / table[r, 0] if table[r, 0] > 0 else 0.0
            figures[f"worker_compute_samples_per_s/rank{r}"] = speed
        events: list[dict[str, Any]] = []
        if len(table) > 1:
            median = float(np.median(compute))
            figures["train/straggler_ratio"] = float(compute.max() / median) if median > 0 else 1.0
            for r in range(len(table) if not warmup else 0):
                ratio = _ratio_to_others(compute, r)
                if ratio > self.cfg.threshold:
                    self._streak[r] += 1
                else:
                    self._streak[r] = 0
                    self._flagged.discard(r)
                if self._streak[r] >= self.cfg.window and r not in self._flagged:
                    self._flagged.add(r)
                    events.append({
                        "rank": r,
                        **self.where[r],
                        "ratio": round(ratio, 3),
                        "compute_s": round(float(compute[r]), 6),
                        "others_median_s": round(float(np.median(np.delete(compute, r))), 6),
                        "intervals": int(self._streak[r]),
                        "threshold": self.cfg.threshold,
                        "policy": self.cfg.policy,
                    })  # fmt: skip
        return figures, events

    def rebalance(self, global_batch: int, max_rows: int | None = None) -> tuple[int, ...] | None:
        """Every ``window`` intervals: a new split of every step's rows that evens the
        ranks' compute times out (module docstring), or None: the times are within
        :data:`EVEN` of each other or of the intervals' noise, or the split would move
        less than :data:`MIN_MOVE` of the global batch. ``max_rows``: no rank's slice larger
        (``data.micro_batch_size`` x accumulation steps, when set)."""
        world = len(self.where)
        if world < 2 or self._intervals_since_check < self.cfg.window:
            return None
        self._intervals_since_check = 0
        tables = np.array(self._at_split)  # intervals x ranks x FIGURES
        sums = tables.sum(axis=0)
        steps = np.maximum(sums[:, FIGURES.index("steps")], 1)
        rows = sums[:, FIGURES.index("rows")] / steps
        compute = sums[:, 0] / steps
        fixed = sums[:, FIGURES.index("optimizer_s")] / steps
        if (rows <= 0).any() or (compute <= fixed).any():
            return None
        if compute.max() / compute.min() < 1 + EVEN:
            return None
        # noise: the slowest and the fastest rank's times per step apart by less than
        # NOISE_Z standard errors of their interval-to-interval spread leave the split
        # as it is, to be judged again with the next window's intervals too
        if len(tables) > 1:
            per_step = tables[:, :, 0] / np.maximum(tables[:, :, FIGURES.index("steps")], 1)
            error = per_step.std(axis=0, ddof=1) / np.sqrt(len(tables))
            hi, lo = int(compute.argmax()), int(compute.argmin())
            if compute[hi] - compute[lo] < NOISE_Z * float(np.hypot(error[hi], error[lo])):
                return None
        previous = self._anchor
        # each rank's time per step as a + b * rows: from this split and the one before,
        # when its rows differ by FIT_APART (forward and backward have fixed costs
        # too); else its optimizer time + the rest in proportion to its rows. That
        # model counts forward's and backward's fixed costs as cost per row, which
        # falls short of the even split (the slowed rank's time drops by less per row
        # than its mean, the other's rises by less), never past it (for times linear
        # in the rows): safe to go all the way
        a, b = fixed, (compute - fixed) / rows
        if previous is not None and (np.abs(rows - previous[0]) >= FIT_APART * rows).all():
            fit_b = (compute - previous[1]) / (rows - previous[0])
            fit_a = compute - fit_b * rows
            if (fit_b > 0).all() and (fit_a >= -0.05 * compute).all():  # float noise
                a, b = np.maximum(fit_a, 0.0), fit_b
        target = _even_times(a, b, global_batch)
        floor = -(-SHARE_SCALE // global_batch)  # at least a row a step each
        shares = np.maximum(np.round(SHARE_SCALE * target / target.sum()), floor)
        if max_rows is not None:  # no slice over the memory bound: the rest to the others
            cap = max(floor, SHARE_SCALE * max_rows // global_batch)
            for _ in range(world):
                over = shares > cap
                spare = float((shares[over] - cap).sum())
                if not spare:
                    break
                shares[over] = cap
                shares[~over] += spare * shares[~over] / shares[~over].sum()
        new = tuple(int(w) for w in shares)
        old = self.shares or (1,) * world
        moved = max(
            abs(x - y)
            for x, y in zip(
                slice_sizes(global_batch, new), slice_sizes(global_batch, old), strict=True
            )
        )
        if moved < max(1, MIN_MOVE * global_batch):
            return None
        self.shares = new
        self._anchor = (rows, compute)  # this split's point: the next fit's other one
        self._at_split.clear()
        return new

    def summary(self) -> tuple[list[dict[str, Any]], float | None]:
        """Per rank, its means per step over the group's intervals so far; the slowest
        rank's mean compute time over the ranks' median (None: nothing measured)."""
        steps = np.maximum(self._sums[:, FIGURES.index("steps")], 1)
        compute = self._sums[:, 0]
        workers = []
        for r, place in enumerate(self.where):
            s = self._sums[r]
            workers.append({
                "rank": r,
                **place,
                "compute_s": float(s[0] / steps[r]),
                "data_wait_s": float(s[1] / steps[r]),
                "comm_s": float(s[2] / steps[r]),
                "compute_samples_per_s": float(s[3] / s[0]) if s[0] > 0 else 0.0,
                "steps": int(s[FIGURES.index("steps")]),
            })  # fmt: skip
        per_step = compute / steps
        median = float(np.median(per_step))
        if not compute.any() or median <= 0:
            return workers, None
        return workers, float(per_step.max() / median)


def _even_times(fixed: np.ndarray, per_row: np.ndarray, total: int) -> np.ndarray:
    """Rows per rank, summing to ``total``, that make ``fixed + per_row * rows`` the same
    for every rank (a rank too slow for any row gets one)."""
    take = np.ones(len(fixed), dtype=bool)
    rows = np.ones(len(fixed))
    for _ in range(len(fixed)):
        left = total - (~take).sum()
        t = (left + (fixed[take] / per_row[take]).sum()) / (1 / per_row[take]).sum()
        rows = np.where(take, (t - fixed) / per_row, 1.0)
        if (rows[take] >= 1).all():
            break
        take &= rows >= 1
    return np.maximum(rows, 1.0)


def _ratio_to_others(compute: np.ndarray, r: int) -> float:
    others = float(np.median(np.delete(compute, r)))
    return float(compute[r] / others) if others > 0 else 1.0


class Evicting(Exception):
    """Every rank raises it once the eviction's checkpoint is registered and its node is
    asked to be kept out: Ray Train restarts the worker group without that node."""


def eviction(
    events: list[dict[str, Any]],
    where: list[dict[str, Any]],
    min_workers: int,
    evictions_so_far: int,
    cfg: StragglersConfig,
) -> tuple[dict[str, Any] | None, str | None]:
    """``stragglers.policy=evict``: of the stragglers found this interval (``events``),
    the slowest one's node to evict, as (request, None); or (None, why not). A node takes
    all its ranks with it: the group must keep ``min_workers``."""
    slowest = max(events, key=lambda e: e["ratio"])
    node_id = where[slowest["rank"]]["node_id"]
    leaving = sum(1 for w in where if w["node_id"] == node_id)
    if len(where) - leaving < min_workers:
        return None, (
            f"evicting node {slowest['node']} would leave {len(where) - leaving} of "
            f"{len(where)} workers, under scaling.min_workers={min_workers}"
        )
    if evictions_so_far >= cfg.max_evictions:
        return None, f"stragglers.max_evictions={cfg.max_evictions} reached"
    request = {
        "rank": slowest["rank"],
        "node": slowest["node"],
        "node_id": node_id,
        "ratio": slowest["ratio"],
        "workers": leaving,
        "cooldown_s": cfg.cooldown_s,
    }
    return request, None
