"""``summary.json``: the one definition of its keys (docs/outputs.md lists them; a test
checks that every key is documented).

The workers' part (:class:`WorkerSummary`) travels in the run's final checkpoint report;
the driver adds its part (:class:`Summary`) and writes the file.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

PHASES = ("data_wait", "forward", "backward", "comm", "optimizer", "checkpoint")
"""Where a worker's training time goes (``time_breakdown``, ``time/<phase>_share``):
``backward`` is the local backward pass, ``comm`` the time in the step's collectives
(DeepSpeed's gradient reduction, ZeRO 1/2's gradient-norm all-reduce and parameter
all-gather, the ranks' agreement on their steps: :class:`~elastic.train.timing.CollectiveClock`),
which holds the wait for the slowest rank; ``other`` (in ``time_breakdown``) is the
rest."""


@dataclass
class WorkerSummary:
    """What rank 0 knows at the end of training (None: not known, e.g. no final report)."""

    status: str = "finished"
    """finished; stopped (trainer.stop_at_step); preempted (SIGTERM/SIGUSR1)."""
    steps: int | None = None
    epoch: int | None = None
    samples_seen: int | None = None
    loss_first: float | None = None
    loss_last: float | None = None
    val: dict[str, float] | None = None
    """The final validation's metrics (e.g. loss, r2, accuracy)."""
    samples_per_s: float | None = None
    """Steady state: from the end of the first step."""
    time_breakdown: dict[str, float] | None = None
    """Shares of training wall time: data_wait, forward, backward, comm, optimizer,
    checkpoint, other (rank 0's)."""
    wandb_dir: str | None = None
    epochs_closed: list[dict[str, int]] | None = None
    """Per finished epoch: samples trained and duplicates."""
    samples_exactly_once: bool | None = None
    """From the ledger the surviving checkpoint carries."""
    workers: list[dict[str, Any]] | None = None
    """The final worker group's ranks: ``rank``, ``node``, and per step their means of
    ``compute_s`` (forward + local backward + optimizer), ``data_wait_s``, ``comm_s``,
    and ``compute_samples_per_s`` (rows / compute time: the rank's own speed)."""
    slowest_median_ratio: float | None = None
    """The final group's slowest rank's mean compute time over the ranks' median (1.0:
    even; a straggler makes every rank wait for it in lock-step)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Summary(WorkerSummary):
    """``summary.json``: the workers' part and the driver's."""

    experiment: str = ""
    run_name: str = ""
    world_sizes: list[int] = field(default_factory=list)
    """Every world size the run trained at, in order (from the events: a group that
    failed before its next checkpoint counts too)."""
    events: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: str | None = None
    run_dir: str = ""
    wall_s: float = 0.0
    """This command's wall time."""
    run_s: float = 0.0
    """The run's time over all its driver sessions (not the queue between them)."""
    target: str | None = None
    time_to_target_s: float | None = None

    @classmethod
    def from_parts(cls, worker: dict[str, Any] | None, **driver: Any) -> Summary:
        known = {f.name for f in fields(WorkerSummary)}
        return cls(**{k: v for k, v in (worker or {}).items() if k in known}, **driver)


SUMMARY_KEYS = tuple(f.name for f in fields(Summary))
