"""The final summary: what rank 0 reports with the run's final checkpoint (the workers'
part of ``summary.json``: :class:`~elastic.observe.summary.WorkerSummary`)."""

from __future__ import annotations

from elastic.observe.summary import PHASES, WorkerSummary
from elastic.train.accounting import SampleLedger
from elastic.train.checkpoint import TrainerState
from elastic.train.stragglers import StragglerWatch


def exactly_once(ledger: SampleLedger, rows: int) -> bool:
    """From the ledger the surviving checkpoints carry: every closed epoch trained each
    of the dataset's ``rows`` samples once (its bitmap holds them all, no sample was
    noted twice), and the open epoch has no sample twice."""
    closed = all(e["trained"] == rows and e["duplicates"] == 0 for e in ledger.closed_epochs)
    return closed and ledger.duplicates == 0 and ledger.trained <= rows


def worker_summary(
    state: TrainerState,
    status: str,
    val: dict[str, float],
    samples_per_s: float,
    watch: StragglerWatch,
    train_rows: int,
    wandb_dir: str | None,
) -> WorkerSummary:
    """The summary of a run at ``state`` (its ledger gathered), ending as ``status``."""
    s = state
    total = max(s.train_wall_s, 1e-9)
    shares = {p: s.time_s.get(p, 0.0) / total for p in PHASES}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    workers, slowest = watch.summary()
    return WorkerSummary(
        status=status,
        steps=s.step,
        epoch=s.epoch,
        samples_seen=s.samples_seen,
        loss_first=s.loss_first,
        loss_last=s.loss_last,
        val=val,
        samples_per_s=samples_per_s,
        time_breakdown=shares,
        wandb_dir=wandb_dir,
        epochs_closed=s.ledger.closed_epochs,
        samples_exactly_once=exactly_once(s.ledger, train_rows),
        workers=workers,
        slowest_median_ratio=slowest,
    )
