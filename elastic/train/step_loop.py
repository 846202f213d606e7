"""The class that owns the step: one worker's epochs and steps, and what each step does.

Every rank makes the same collectives in the same order; each is named where it is made.
A step (:meth:`StepLoop._train_epoch`):

1. its batch: this rank's slice of the global step, read ahead (no collective);
2. agreement (:class:`~elastic.train.lockstep.LockStep`, an all-reduce on the steps
   that need it): rows, the ids' digest, stop requests, node drains, divergence;
3. forward, backward (the gradient all-reduce: DeepSpeed's, or elastic's overlapped
   one), optimizer step; then the ledger and the loss sums (no collective);
4. a log step: the interval (:class:`~elastic.train.interval.IntervalLog`, an
   all-gather), then the stragglers policy
   (:class:`~elastic.train.straggler_actions.StragglerActions`, a broadcast to evict);
5. a checkpoint step: the divergence check (an all-reduce), the ledger (a gather), the
   checkpoint;
6. a stop request, a node drain or an eviction, agreed in 2 and 4, acted on;
7. a validation step: validation (:class:`~elastic.train.validation.Validator`,
   all-reduces); a new split of the rows (rebalance) from the next step on.

Which steps do what is the :class:`~elastic.train.schedule.Schedule`'s answer, the
same on every rank. The worker entry (:mod:`elastic.train.loop`) builds this after the
engine and the resume, runs :meth:`train`, then :meth:`validate` and :meth:`finish`.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

import numpy as np
import torch

from elastic.config.schema import TrainConfig
from elastic.data.formats import data_format
from elastic.data.reader import PlannedReader
from elastic.data.shards import locate_samples
from elastic.data.stream import StepBatch
from elastic.errors import DataError, user_code
from elastic.observe.tracking import NullTracker
from elastic.tasks import Task, task_of
from elastic.train import checkpoint as ckpt
from elastic.train.accounting import gather_ledger
from elastic.train.batch import BatchPlan
from elastic.train.divergence import NAMED_ROWS, Divergence
from elastic.train.engine import compute_dtype
from elastic.train.final import worker_summary
from elastic.train.interval import IntervalLog
from elastic.train.live import LiveRun, Rewire
from elastic.train.lockstep import LockStep
from elastic.train.quorum import Quorum, QuorumBroken
from elastic.train.reduce import overlapped_reduce
from elastic.train.schedule import Schedule
from elastic.train.straggler_actions import StragglerActions
from elastic.train.stragglers import StragglerWatch
from elastic.train.throughput import Throughput
from elastic.train.timing import PhaseTimes
from elastic.train.validation import Validator


class _Wired:
    """What depends on the ranks training together (made by :func:`_wire`, again for a
    live run's new quorum)."""

    tracker: NullTracker
    rank: int
    world: int
    divergence: Divergence
    lockstep: LockStep
    log: IntervalLog
    stragglers: StragglerActions
    validator: Validator


class StepLoop(_Wired):
    """``where``: every rank's place (node, pid), gathered at the group's start;
    ``control``: the run's control actor (rank 0 uses it; None in tests);
    ``startup``: the start's timing marks (:class:`~elastic.train.throughput.Throughput`);
    ``empty``: a batch of no rows with the decoded shapes (what a rank with no rows of
    a step trains on); ``quorum``: a live run's (:mod:`elastic.train.quorum`), and
    ``rewire``, what the worker entry redoes for a new quorum (the tracker of a new rank
    0, every rank's place)."""

    def __init__(
        self,
        cfg: TrainConfig,
        engine: Any,
        plan: BatchPlan,
        state: ckpt.TrainerState,
        tracker: NullTracker,
        rank: int,
        where: list[dict[str, Any]],
        *,
        steps_per_epoch: int,
        run_dir: str,
        control: Any = None,
        startup: dict[str, float] | None = None,
        empty: dict[str, np.ndarray] | None = None,
        quorum: Quorum | None = None,
        rewire: Rewire | None = None,
    ) -> None:
        self.cfg, self.engine, self.plan, self.state = cfg, engine, plan, state
        self.task: Task = task_of(cfg.model)  # its loss, label checks, metrics
        # fp32 ZeRO-0, where asked: the gradient all-reduce elastic's, beside backward
        self.reducer = overlapped_reduce(engine, cfg.strategy, live=quorum is not None)
        self.times = PhaseTimes()
        self.schedule = Schedule(cfg, steps_per_epoch)
        reduce_kind = "overlapped" if self.reducer is not None else "deepspeed"
        self.throughput = Throughput(tracker, len(where), startup or {}, reduce_kind)
        wire = functools.partial(_wire, self, control=control, run_dir=run_dir, empty=empty or {})
        wire(rank, where, tracker)
        # scaling.live: what this worker does when its quorum changes
        self.live = LiveRun(self, quorum, rewire, wire) if quorum and rewire else None
        self.reader: PlannedReader | None = None
        self.stop_reason: str | None = None  # "stopped" (trainer.stop_at_step), "preempted"
        self._saved_step = -1  # the step of this group's last checkpoint
        self._drain_saved = False  # a node drain's checkpoint is made (once a group)

    # -- training ---------------------------------------------------------------------
    def train(self, reader: PlannedReader, val_files: list[str]) -> None:
        self.reader = reader
        self.engine.train()
        self.times.session_start = time.perf_counter()
        while not self.schedule.done(self.state, self.stop_reason is not None):
            if self._train_epoch(self.reader, val_files):
                self._close_epoch()
        # a non-finite model is never validated or checkpointed (an all-reduce)
        self.divergence.check_and_stop(self.engine, self.state.step, self.lockstep.device)
        self.reader.close()
        self.throughput.end()
        self.times.fold_into(self.state)

    def _train_epoch(self, reader: PlannedReader, val_files: list[str]) -> bool:
        """One epoch, or what is left of it; False when a stopping rule ends it early or
        the split of its steps changes (then the epoch goes on with a new reader)."""
        # the epoch's plan fixes every step's rows: resume at its step, at any world size
        s, when = self.state, self.schedule
        ends_here = lambda: when.ends_here(s, self.stop_reason is not None)  # noqa: E731
        batches = reader.epoch(s.epoch, s.step - s.epoch_start_step)
        while (batch := self._next_batch(batches)) is not None:
            try:
                self._agree(batch)  # all-reduce, on the steps due
                # forward, backward + gradient all-reduce, (live: the commit), optimizer
                loss_sum = self._step(batch)
                self._account(batch, loss_sum)  # ledger, step count, loss sums
                if when.logs_at(s.step):
                    self._log()  # all-gather; the stragglers policy (evict: a broadcast)
                # a checkpoint due (live: or one deferred until the quorum was whole)
                due = when.checkpoints_at(s.step) or bool(self.live and self.live.save_due)
                if when.stops_at(s):
                    self.stop_reason = "stopped"  # the final checkpoint covers this step
                elif due and not ends_here():
                    self._save()  # divergence all-reduce, ledger gather, the checkpoint
                self._act_on_signals(ends_here())  # preemption, node drain, eviction
                if val_files and when.validates_at(s.step) and not ends_here():
                    self.validate(val_files)  # all-reduces (the end's validation covers it)
            except QuorumBroken as e:  # live: the step not committed is computed again
                assert self.live is not None  # by the next quorum; one committed stays
                self.live.reform(e)  # (what followed it: its log, its checkpoint, not)
                return False
            self.throughput.step(s.step, batch)
            if self.live is not None and self.live.leave_after_step:  # a newcomer waits
                self.live.reform(None)
                return False
            if self.stop_reason is not None or when.done(s, False):
                return False
            if (resplit := self.stragglers.resplit(reader, s)) is not None:
                self.reader = resplit  # a rebalance decided at this step: a new split
                return False
        return True

    def _next_batch(self, batches: Any) -> StepBatch | None:
        """The step's batch (None: the epoch's plan has no step left, on every rank)."""
        t0 = time.perf_counter()
        batch = next(batches, None)
        t1 = time.perf_counter()
        self.times.add("data_wait", t1 - t0)
        if batch is not None:
            self.throughput.batch(t1, self.reader)
        return batch

    def _agree(self, batch: StepBatch) -> None:
        """Collective on the steps due (every rank the same): the ranks' agreement."""
        t0 = time.perf_counter()
        step = self.state.step + 1
        if self.lockstep.agree(step, batch, self.schedule.agreed_on(step, self.state)):
            self.times.since("comm", t0)  # the all-reduce waits for the slowest rank

    def _step(self, batch: StepBatch) -> torch.Tensor:
        """Forward, backward and optimizer step over the batch's micro-batches; the sum
        of this rank's per-row losses."""
        plan, engine, d, device = self.plan, self.engine, self.cfg.data, self.engine.device
        dtype = compute_dtype(self.cfg)
        with user_code(f"data.format={d.format}'s augment()", "fix the format's augment()"):
            augment = data_format(d.format).augment
            inputs = augment(batch.x, batch.sample_id, self.state.epoch, d)
        x = torch.from_numpy(inputs).to(device, dtype)
        check_labels(self.task, batch.y, batch.sample_id, d.path, self.cfg.model.name)
        y = x if self.task.target_is_input else torch.from_numpy(batch.y).to(device)
        # Weight per-sample losses so the gradient is the mean over the step's rows on all
        # workers, even when a worker has fewer rows (end of epoch): DeepSpeed divides by
        # the accumulation steps and averages over workers, which this factor undoes.
        weight = plan.world_size * plan.grad_accum_steps / batch.global_rows
        loss_sum = torch.zeros((), dtype=torch.float64)
        skipped = getattr(engine, "skipped_steps", 0)
        ids = np.array_split(batch.sample_id, plan.grad_accum_steps)
        last = plan.grad_accum_steps - 1
        with self.live.step(engine) if self.live is not None else contextlib.nullcontext():
            for i, (xs, ys, ids_micro) in enumerate(
                zip(
                    torch.tensor_split(x, plan.grad_accum_steps),
                    torch.tensor_split(y, plan.grad_accum_steps),
                    ids,
                    strict=True,
                )
            ):
                # each phase's collectives (the wait for the slowest rank) count as comm
                with self.times.phase("forward"):
                    losses = self.task.losses(engine(xs).float(), ys)
                    loss = losses.sum() * weight
                with self.times.phase("backward"):
                    engine.backward(loss)
                    if self.reducer is not None:
                        self.reducer.finish()
                if self.live is not None and i == last:  # every member has the gradient,
                    self.live.commit(self.state.step + 1, self.times)  # or none steps
                with self.times.phase("optimizer"):
                    engine.step()
                micro_sum = losses.detach().double().sum().cpu()
                if not torch.isfinite(micro_sum):
                    bad = ~torch.isfinite(losses.detach().cpu()).numpy()
                    self.divergence.note(self.state.step + 1, ids_micro[bad])
                loss_sum += micro_sum
        if getattr(engine, "skipped_steps", 0) != skipped:
            # ZeRO 1/2 found inf/nan gradients and skipped the update: the step's rows
            # would count as trained without having changed the model
            self.divergence.note(self.state.step + 1, batch.sample_id[:0], skipped_update=True)
        return loss_sum

    def _account(self, batch: StepBatch, loss_sum: torch.Tensor) -> None:
        """The step is done: its rows are trained (the ledger), its loss is summed."""
        self.state.ledger.record(batch.sample_id)
        self.state.step += 1
        self.state.samples_seen += batch.global_rows
        self.log.add(loss_sum, batch.rows)

    def _log(self) -> None:
        """Collective: the interval's log (an all-gather), then the stragglers policy."""
        s = self.state
        found = self.log.log(s, self.times, self.engine.get_lr()[0], self.lockstep.digest)
        self.stragglers.after_log(s.step, found)

    def _act_on_signals(self, ends_here: bool) -> None:
        """A stop request checkpoints and ends the run (resumable: a requeue); a node
        drain checkpoints now, once, and goes on until Ray Train restarts the group
        without the drained node; an eviction decided at this step's log is carried out
        (unless this step ends the run)."""
        s, lock = self.state, self.lockstep
        if lock.stop_requested and self.stop_reason is None:
            self.stop_reason = "preempted"
            reason = lock.stops.reason or "stop requested"
            self.tracker.event(s.step, "preempted", reason=reason, world_size=self.world)
        elif lock.drain_pending and not self._drain_saved:
            self._drain_saved = True
            self.tracker.event(s.step, "node_drain", world_size=self.world)
            if not self.schedule.done(s, self.stop_reason is not None):
                self._save()
        elif self.stragglers.eviction is not None and not ends_here:
            self.stragglers.evict(s, self._save if self._saved_step != s.step else None)

    def _close_epoch(self) -> None:
        """Collective (the ledger's gather): the epoch's bitmap closes."""
        self.state.epoch_start_step = self.state.step
        self._gather()
        record = self.state.ledger.close_epoch()
        if self.rank == 0:
            self.tracker.event(self.state.step, "epoch_end", **record)

    def _gather(self) -> None:
        """Collective: the ledger's gather (live: onto every member)."""
        if self.live is not None:
            self.live.gather()
        else:
            gather_ledger(self.state.ledger, self.rank, self.world)

    def _save(self) -> None:
        """Collective: the divergence check (a non-finite model never displaces a good
        checkpoint), the ledger's gather, this rank's part of the checkpoint. Live,
        while a worker is missing: deferred to the first step the quorum is whole."""
        if self.live is not None and self.live.defer_save():
            return
        t0 = time.perf_counter()
        s = self.state
        self.divergence.check_and_stop(self.engine, s.step, self.lockstep.device)
        self._gather()
        self.times.fold_into(s)
        ckpt.save(self.engine, s, self.rank, {"step": s.step, "loss": s.loss_last})
        self._saved_step = s.step
        self.times.since("checkpoint", t0)

    # -- validation and the end ---------------------------------------------------------
    def validate(self, val_files: list[str]) -> dict[str, float]:
        """Collective: metrics over the validation split (``val_files``; none: none)."""
        return self.validator.run(val_files, self.state.step)

    def finish(self, val: dict[str, float], train_rows: int) -> None:
        """Collective: the final checkpoint, carrying the run's summary as its metrics
        (``train_rows``: samples in an epoch of the train split)."""
        s = self.state
        if self.live is not None:  # Ray Train's report takes every worker it started
            self.live.await_whole(val, self.stop_reason)
        self._gather()
        summary = worker_summary(
            s,
            self.stop_reason or "finished",
            val,
            self.throughput.samples_per_s(),
            self.log.watch,
            train_rows,
            self.tracker.wandb_dir,
        )
        ckpt.save(self.engine, s, self.rank, {"step": s.step, "summary": summary.to_dict()})


def _wire(
    loop: StepLoop,
    rank: int,
    where: list[dict[str, Any]],
    tracker: NullTracker,
    control: Any,
    run_dir: str,
    empty: dict[str, np.ndarray],
) -> None:
    """The step loop's parts that depend on the ranks training together (``where``:
    every rank's place), made at its start and again for a live run's new quorum."""
    cfg, world = loop.cfg, len(where)
    loop.tracker, loop.rank, loop.world = tracker, rank, world
    # non-finite values, made common by the agreement or a checkpoint's check
    loop.divergence = Divergence(world, cfg.data.path, cfg.optim.lr)
    collective = loop.engine.device if cfg.scaling.use_gpu else torch.device("cpu")
    lead = control if rank == 0 else None
    lock = LockStep(world, collective, lead, loop.divergence)
    loop.lockstep = lock
    watch = StragglerWatch(cfg.stragglers, where)  # every rank's figures: who is slow
    loop.log = IntervalLog(cfg.trainer, tracker, watch, world, collective, lead)
    loop.stragglers = StragglerActions(cfg, loop.plan, watch, tracker, rank, world, run_dir, lead)
    loop.validator = Validator(
        cfg, loop.task, loop.engine, loop.plan, tracker, rank, world, empty, collective,
        agree_rows=lambda rows: lock.all_reduce(rows)[0],
    )  # fmt: skip
    loop.throughput.tracker, loop.throughput.world = tracker, world


def check_labels(
    task: Task, target: np.ndarray, sample_id: np.ndarray, path: str, model: str
) -> None:
    """Class labels the model has no output for (shards without statistics are not
    checked before Ray starts): the same rows fail every retry, so a DataError naming
    them and their files."""
    bad = task.bad_labels(target)
    if not bad.any():
        return
    ids = sample_id[bad][:NAMED_ROWS]
    labels = target.reshape(len(target), -1)[bad, 0][:NAMED_ROWS]
    files = locate_samples(path, ids)
    where = ", ".join(
        f"{label:g} (sample_id {i}, {files.get(int(i), '?')})"
        for label, i in zip(labels, ids, strict=True)
    )
    raise DataError(
        f"class labels outside model={model}'s {task.label_range()} in {path}: {where}; fix "
        "those rows or model.output_dim"
    )
