"""Validation: the task's metrics over the validation split, on every rank together.

Each rank reads its share of the split (:func:`~elastic.data.stream.val_blocks`; a rank
with none still takes part in every collective, on an empty batch), the task sums its
statistics (:class:`~elastic.tasks.MetricSums`), one all-reduce adds them over the
ranks. Rows the metrics cannot count (class labels the model has no output for, in
shards without statistics; a loss of nan/inf) are left out of the sums, counted in the
same all-reduce, and named by rank 0 in an event (an all-gather of their ids).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from elastic.config.schema import TrainConfig
from elastic.data.shards import locate_samples
from elastic.data.stream import StepStream, val_blocks
from elastic.observe.tracking import NullTracker
from elastic.tasks import MetricSums, Task
from elastic.train.batch import BatchPlan
from elastic.train.divergence import NAMED_ROWS
from elastic.train.engine import compute_dtype


class Validator:
    """One rank's validation: ``plan.micro_batch_size`` rows a forward pass; ``empty``,
    the batch of a rank with no rows (the decoded shapes); ``agree_rows`` sums a row
    count over the ranks (the lock-step all-reduce: every rank's blocks of a split step
    together)."""

    def __init__(
        self,
        cfg: TrainConfig,
        task: Task,
        engine: Any,
        plan: BatchPlan,
        tracker: NullTracker,
        rank: int,
        world: int,
        empty: dict[str, np.ndarray],
        collective_device: torch.device,
        agree_rows: Callable[[int], int],
    ) -> None:
        self.cfg, self.task, self.engine, self.tracker = cfg, task, engine, tracker
        self.rank, self.world, self._agree_rows = rank, world, agree_rows
        self.micro_batch, self.empty = plan.micro_batch_size, empty
        self.device, self._collective = engine.device, collective_device
        self.dtype = compute_dtype(cfg)

    def run(self, val_files: list[str], step: int) -> dict[str, float]:
        """Collective: metrics over ``val_files`` (none: no metrics), logged at ``step``."""
        if not val_files:
            return {}
        self.engine.eval()
        sums = MetricSums(self.task)
        stream = StepStream(
            val_blocks(self.cfg.data, val_files, self.rank, self.world),
            self.micro_batch,
            self._agree_rows,
            empty=self.empty,
        )
        # rows the metrics cannot count, by why: labels the model has no output for
        # (shards without statistics are not checked before Ray), a loss of nan/inf
        left_out: dict[str, list[int]] = {"labels": [], "not_finite": []}
        with torch.no_grad():
            for batch in stream:
                ids, xs, ys = batch.sample_id, batch.x, batch.y
                bad = self.task.bad_labels(ys)
                if bad.any():
                    left_out["labels"] += ids[bad].tolist()
                    ids, xs, ys = ids[~bad], xs[~bad], ys[~bad]
                x = torch.from_numpy(xs).to(self.device, self.dtype)
                y = x if self.task.target_is_input else torch.from_numpy(ys).to(self.device)
                out = self.engine(x).float()
                losses = self.task.losses(out, y)
                finite = torch.isfinite(losses)
                if not bool(finite.all()):
                    left_out["not_finite"] += ids[~finite.cpu().numpy()].tolist()
                    out, y, losses = out[finite], y[finite], losses[finite]
                sums.add(out.cpu(), y.cpu(), losses.cpu())
        self.engine.train()
        counts = [float(len(ids)) for ids in left_out.values()]
        totals = torch.cat([sums.sums, torch.tensor(counts, dtype=torch.float64)])
        totals = totals.to(self._collective)
        dist.all_reduce(totals)
        sums.sums = totals[: -len(counts)].cpu()
        metrics = sums.metrics()
        left = dict(zip(left_out, (int(c) for c in totals[-len(counts) :].tolist()), strict=True))
        if any(left.values()):
            metrics["rows_left_out"] = sum(left.values())
            self._name_left_out(step, left_out, left)
        self.tracker.log(
            step,
            {f"val/{k}": v for k, v in metrics.items()},
            console="[elastic] validation: "
            + ", ".join(f"{k} {v:.6g}" for k, v in metrics.items()),
        )
        return metrics

    def _name_left_out(self, step: int, mine: dict[str, list[int]], counts: dict[str, int]) -> None:
        """Collective (an all-gather): the validation rows left out of the metrics
        (``counts`` by why, over all ranks), named by rank 0 in an event (a console line,
        a W&B alert)."""
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, {k: v[:NAMED_ROWS] for k, v in mine.items()})
        if self.rank != 0:
            return
        path = self.cfg.data.val_path or ""
        why = {
            "labels": f"class labels outside {self.task.label_range()}",
            "not_finite": "a loss that is not finite (nan/inf in the row)",
        }
        parts = []
        for reason, count in counts.items():
            if not count:
                continue
            ids = sorted({i for part in gathered for i in part[reason]})[:NAMED_ROWS]
            files = locate_samples(path, np.array(ids))
            named = ", ".join(f"{i} ({files.get(i, '?')})" for i in ids)
            parts.append(f"{count} with {why[reason]}: sample_id {named}")
        self.tracker.event(
            step,
            "val_rows_left_out",
            rows=sum(counts.values()),
            detail=f"validation rows in {path} left out of the metrics, {'; '.join(parts)}: "
            "fix those rows",
        )
