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

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from elastic.config.schema import TrainConfig
from elastic.data.formats import data_format
from elastic.data.reader import PlannedReader, slice_ids
from elastic.data.shards import locate_samples
from elastic.data.stream import StepBatch
from elastic.errors import DataError, user_code
from elastic.observe.tracking import NullTracker
from elastic.tasks import Task, task_of
from elastic.train import checkpoint as ckpt
from elastic.train.accounting import gather_ledger
from elastic.train.batch import BatchPlan
from elastic.train.divergence import NAMED_ROWS, Divergence
from elastic.train.engine import compute_dtype, set_plan
from elastic.train.final import worker_summary
from elastic.train.interval import IntervalLog
from elastic.train.lockstep import LockStep
from elastic.train.membership import Membership
from elastic.train.quorum import Quorum, QuorumBroken, copy_state
from elastic.train.reduce import overlapped_reduce
from elastic.train.schedule import Schedule
from elastic.train.straggler_actions import StragglerActions
from elastic.train.stragglers import StragglerWatch
from elastic.train.throughput import Throughput
from elastic.train.timing import PhaseTimes
from elastic.train.validation import Validator

WHOLE_WAIT_S = 300.0
"""Live: how long a checkpoint (the final one included) waits for a worker in a dead
one's place (Ray Train starts it; its report needs every worker it started) before
the group gives up and restarts from the last checkpoint."""


class StepLoop:
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
        rewire: Callable[[Membership], tuple[NullTracker, list[dict[str, Any]]]] | None = None,
    ) -> None:
        self.cfg, self.engine, self.plan, self.state = cfg, engine, plan, state
        self.task: Task = task_of(cfg.model)  # its loss, label checks, metrics
        self.format = data_format(cfg.data.format)  # its augmentation
        self.quorum, self._rewire = quorum, rewire
        # fp32 ZeRO-0, where asked: the gradient all-reduce elastic's, beside backward
        self.reducer = overlapped_reduce(engine, cfg.strategy, live=quorum is not None)
        self.times = PhaseTimes()
        self.schedule = Schedule(cfg, steps_per_epoch)
        self.run_dir, self.control, self.empty = run_dir, control, empty or {}
        reduce_kind = "overlapped" if self.reducer is not None else "deepspeed"
        self.throughput = Throughput(tracker, len(where), startup or {}, reduce_kind)
        self._wire(rank, where, tracker)
        self.reader: PlannedReader | None = None
        self.stop_reason: str | None = None  # "stopped" (trainer.stop_at_step), "preempted"
        self._saved_step = -1  # the step of this group's last checkpoint
        self._drain_saved = False  # a node drain's checkpoint is made (once a group)
        self._leave_after_step = False  # live: a newcomer waits, this quorum ends
        self._save_due = False  # live: a checkpoint deferred until the quorum is whole
        self._deferred_at = 0.0  # since when (monotonic seconds)
        self._end: dict[str, Any] | None = None  # live: trained and validated, at the end
        self._gathered_step = state.step  # the ledger's last gather (every rank's ids)

    def _wire(self, rank: int, where: list[dict[str, Any]], tracker: NullTracker) -> None:
        """Everything that depends on the ranks training together (a live run's new
        quorum wires it again)."""
        cfg, world = self.cfg, len(where)
        self.tracker, self.rank, self.world, self.where = tracker, rank, world, where
        # non-finite values, made common by the agreement or a checkpoint's check
        self.divergence = Divergence(world, cfg.data.path, cfg.optim.lr)
        collective = self.engine.device if cfg.scaling.use_gpu else torch.device("cpu")
        lead = self.control if rank == 0 else None
        lock = LockStep(world, collective, lead, self.divergence)
        self.lockstep = lock
        watch = StragglerWatch(cfg.stragglers, where)  # every rank's figures: who is slow
        self.log = IntervalLog(cfg.trainer, tracker, watch, world, collective, lead)
        self.stragglers = StragglerActions(
            cfg, self.plan, watch, tracker, rank, world, self.run_dir, lead
        )
        self.validator = Validator(
            cfg, self.task, self.engine, self.plan, tracker, rank, world, self.empty, collective,
            agree_rows=lambda rows: lock.all_reduce(rows)[0],
        )  # fmt: skip
        self.throughput.tracker, self.throughput.world = tracker, world

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
            except QuorumBroken as e:  # live: not committed; the next quorum redoes it
                self._reform(e)
                return False
            self._account(batch, loss_sum)  # ledger, step count, loss sums
            try:
                self._after_step(batch, val_files, ends_here)
            except QuorumBroken as e:  # live: the step is committed; what followed it
                self._reform(e)  # (its log, its checkpoint) is left to the next ones
                return False
            if self._leave_after_step:  # live: a newcomer waits
                self._reform(None)
                return False
            if self.stop_reason is not None or when.done(s, False):
                return False
            if (resplit := self.stragglers.resplit(reader, s)) is not None:
                self.reader = resplit  # a rebalance decided at this step: a new split
                return False
        return True

    def _after_step(self, batch: StepBatch, val_files: list[str], ends_here: Any) -> None:
        """A trained step's log, checkpoint, signals and validation, where due."""
        s, when = self.state, self.schedule
        if when.logs_at(s.step):
            self._log()  # all-gather; the stragglers policy (evict: a broadcast)
        if when.stops_at(s):
            self.stop_reason = "stopped"  # the final checkpoint covers this step
        elif (when.checkpoints_at(s.step) or self._save_due) and not ends_here():
            self._save()  # divergence all-reduce, ledger gather, the checkpoint
        self._act_on_signals(ends_here())  # preemption, node drain, eviction
        if val_files and when.validates_at(s.step) and not ends_here():
            self.validate(val_files)  # all-reduces (the end's validation covers it)
        self.throughput.step(s.step, batch)

    def _reform(self, why: QuorumBroken | None) -> None:
        """Live: leave this quorum after the last committed step (``why``: it broke;
        None: a newcomer waits), wait for the next one, and wire the loop for it: the
        batch plan of its size (the same global batch), the engine's accumulation, the
        reducer, every rank's place, the reader's new split from the next step; a
        newcomer copies the state from rank 0."""
        assert self.quorum is not None and self._rewire is not None and self.reader is not None
        s, t0 = self.state, time.perf_counter()
        before = self.quorum.membership
        m = self.quorum.form(s.step)
        self.plan = BatchPlan.for_world(
            self.cfg.data.global_batch_size, m.size, self.cfg.data.micro_batch_size
        )
        set_plan(self.engine, self.plan, m.rank(self.quorum.name))
        if self.reducer is not None:
            self.reducer.regroup(m.size)
        gone = [x for x in (before.members if before else []) if x not in m.members]
        lost = self._lost_rows([before.rank(x) for x in gone] if before else [])
        tracker, where = self._rewire(m)
        self._wire(m.rank(self.quorum.name), where, tracker)
        copied = copy_state(self.engine, s, m, self.loop_state())[0] if m.fresh else 0
        self._gather()
        self.reader = self.reader.resplit(m.size, s.epoch, s.step - s.epoch_start_step, self.rank)
        if not s.world_sizes or s.world_sizes[-1] != m.size:
            s.world_sizes.append(m.size)
            s.batch_plans.append(self.plan.to_dict())
        self._leave_after_step = False
        self.tracker.event(
            s.step,
            "quorum",
            quorum=m.id,
            world_size=m.size,
            members=m.members,
            previous=before.size if before else None,
            gone=gone,
            joined=m.fresh,
            cause=str(why) if why is not None else "join",
            copied_bytes=copied,
            ledger_from_plan=lost,
            seconds=round(time.perf_counter() - t0, 3),
        )

    def loop_state(self) -> dict[str, Any]:
        """What a newcomer must take from rank 0 to make the same collectives."""
        return {"save_due": self._save_due, "end": self._end}

    def _lost_rows(self, ranks: list[int]) -> int:
        """Live: the rows members that died (their ``ranks`` in the quorum that broke)
        trained in the steps committed since the ledger's last gather; their notes of
        them died with them. Those steps were committed, so their gradients are in the
        model: the ledger takes the rows the plan gave them (read from the shards), the
        same on every member. How many."""
        s, reader = self.state, self.reader
        assert reader is not None
        if not ranks or self._gathered_step >= s.step:
            return 0
        start = s.epoch_start_step
        steps = range(self._gathered_step - start, s.step - start)
        ids = slice_ids(
            reader.cfg, reader.files, reader.layout, s.epoch, steps, ranks, reader.world
        )
        s.ledger.merge([ids])
        return len(ids)

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
            inputs = self.format.augment(batch.x, batch.sample_id, self.state.epoch, d)
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
        micro_steps = getattr(engine, "micro_steps", 0)  # DeepSpeed's count, to undo
        last = plan.grad_accum_steps - 1
        try:
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
                if self.quorum is not None and i == last:
                    # live: every member has this step's gradient, or none steps
                    t0 = time.perf_counter()
                    self._leave_after_step = self.quorum.commit(self.state.step + 1)
                    self.times.since("comm", t0)
                with self.times.phase("optimizer"):
                    engine.step()
                micro_sum = losses.detach().double().sum().cpu()
                if not torch.isfinite(micro_sum):
                    bad = ~torch.isfinite(losses.detach().cpu()).numpy()
                    self.divergence.note(self.state.step + 1, ids_micro[bad])
                loss_sum += micro_sum
        except QuorumBroken:
            engine.micro_steps = micro_steps  # the step starts over in the next quorum
            raise
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
        gather_ledger(self.state.ledger, self.rank, self.world, everywhere=self.quorum is not None)
        self._gathered_step = self.state.step

    def quorum_size(self) -> int:
        """Live: the workers Ray Train started (a whole quorum)."""
        return self.world if self.quorum is None else self.quorum.expected

    def _whole(self) -> bool:
        """Live: whether every worker Ray Train started is in the quorum (its report,
        which a checkpoint goes through, waits for all of them)."""
        return self.quorum is None or self.world >= self.quorum.expected

    def _await_whole(self) -> None:
        """Live, at the end: until a worker in a dead one's place has joined (it copies
        the state), at most :data:`WHOLE_WAIT_S`."""
        assert self.quorum is not None
        deadline = time.monotonic() + WHOLE_WAIT_S
        while not self._whole():
            if self.quorum.broken() or self.quorum.join_waiting():
                self._reform(None)
            elif time.monotonic() > deadline:
                raise RuntimeError(
                    f"step {self.state.step}: {self.world} of {self.quorum.expected} workers "
                    f"at the end, none joined in {WHOLE_WAIT_S:g} s: the final checkpoint "
                    "needs them all"
                )
            else:
                time.sleep(0.2)

    def _save(self) -> None:
        """Collective: the divergence check (a non-finite model never displaces a good
        checkpoint), the ledger's gather, this rank's part of the checkpoint. Live,
        while a worker is missing: deferred to the first step the quorum is whole."""
        if not self._whole():
            if not self._save_due:
                self.tracker.event(self.state.step, "checkpoint_deferred", world_size=self.world)
            self._save_due = True
            return
        self._save_due = False
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
        if self.quorum is not None:
            self._end = {"val": val, "stop_reason": self.stop_reason}  # for a newcomer
            self._await_whole()  # Ray Train's report takes every worker it started
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
