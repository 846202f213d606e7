"""The per-worker training loop (runs inside every Ray Train worker).

Top to bottom: world size -> batch plan -> model + DeepSpeed -> resume -> for each step
{wait data, forward, backward, optimizer step, account samples, log, maybe checkpoint}
-> validate -> final checkpoint -> close. ``_Trainer._train_epoch`` is the per-step path.

Over 400 lines on purpose: one class holds what every part of a step shares (the
engine, the ledger, the lock-step collectives); what needs none of it lives beside it
(:mod:`~elastic.train.timing`, :mod:`~elastic.train.divergence`,
:mod:`~elastic.train.control`, :mod:`~elastic.data.stream`).
"""

from __future__ import annotations

import contextlib
import random
import socket
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from elastic.config.schema import TrainConfig
from elastic.data.formats import data_format
from elastic.data.ids import ids_digest
from elastic.data.order import Layout, slice_sizes
from elastic.data.reader import PlannedReader, epoch_plan
from elastic.data.shards import damaged_shard, locate_samples
from elastic.data.stream import StepBatch, StepStream, val_blocks
from elastic.errors import DataError, find_run_error, run_error, user_code
from elastic.models.losses import MetricSums, bad_labels, label_range, per_sample_loss
from elastic.observe.summary import WorkerSummary
from elastic.observe.tracking import NullTracker, make_tracker
from elastic.train import checkpoint as ckpt
from elastic.train import integrity
from elastic.train.batch import BatchPlan
from elastic.train.control import StopPoller, SyncPace, node_drain_probe, wait_for_eviction
from elastic.train.divergence import NAMED_ROWS, Divergence
from elastic.train.engine import (
    build_engine,
    init_distributed,
    set_base_lr,
    slow_bf16_warning,
    warm_imports,
)
from elastic.train.reduce import overlapped_reduce
from elastic.train.stragglers import FIGURES, Evicting, StragglerWatch, eviction
from elastic.train.timing import COMPUTE, PHASES, CollectiveClock, PhaseTimes

# Batches arrive as read-only numpy views of Ray's object store; torch only reads them,
# so we wrap them without a copy and silence torch's warning about writability.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


@dataclass
class WorkerArgs:
    """What every worker of a run gets from the driver (Ray Train passes it in the
    ``train_loop_config`` dict, under ``"args"``)."""

    cfg: TrainConfig
    config_dict: dict[str, Any]
    """The resolved config as plain data, for W&B."""
    run_dir: str
    train_files: list[str]
    layout: Layout
    """The train split's row groups: what every global batch is planned on."""
    data_record: dict[str, Any]
    """What the checkpoints keep of the data (:func:`elastic.data.reader.data_record`)."""
    cache_train: bool
    """The decoded train split fits ``data.cache_mb``: each row group read once a worker."""
    train_rows: int
    empty: dict[str, np.ndarray] = field(default_factory=dict)
    """A batch of no rows with the decoded rows' shapes and dtypes (the driver's
    :func:`~elastic.data.probe.probe`): what a rank with no rows of a step trains on."""
    val_files: list[str] = field(default_factory=list)
    """The validation split's shards (each worker reads its share: stream.val_blocks)."""
    resume_from: str | None = None
    """The checkpoint to resume from while Ray Train has none to hand out (its list of
    the run's checkpoints was missing or unreadable: ``integrity.prepare_resume``)."""
    control: Any = None
    """The run's control actor (stop requests, fatal errors, progress)."""


def train_loop(config: dict[str, Any]) -> None:
    import ray
    import ray.train

    args: WorkerArgs = config["args"]
    cfg = args.cfg
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    plan = BatchPlan.for_world(cfg.data.global_batch_size, world, cfg.data.micro_batch_size)

    started = time.perf_counter()
    warming = warm_imports()
    with contextlib.ExitStack() as stack:
        stack.push(_end_run_on_run_error(args.control))
        resume_from = ray.train.get_checkpoint()
        path = stack.enter_context(resume_from.as_directory()) if resume_from else None
        path = path or args.resume_from  # Ray Train's newer one first, once it has one
        if path is not None:
            integrity.check_intact(path)
        state = ckpt.read_state(path) if path else ckpt.TrainerState()
        state.data = args.data_record  # the driver checked a resumed run's against it
        steps_per_epoch = epoch_plan(cfg.data, args.layout, 0).steps  # every epoch's
        # this rank's row groups from the resume step on, read while DeepSpeed starts
        reader = PlannedReader(
            cfg.data,
            args.train_files,
            args.layout,
            rank,
            world,
            first_epoch=state.epoch,
            first_step=state.step - state.epoch_start_step,
            epochs=_epochs_left(cfg, steps_per_epoch, state),
            cache=args.cache_train,
            empty=args.empty,
        )
        marks = {"data_s": time.perf_counter()}
        CollectiveClock.install()  # before DeepSpeed keeps references to collectives
        init_distributed(cfg.scaling.use_gpu, warming)
        marks["distributed_s"] = time.perf_counter()
        _seed_everything(cfg.trainer.seed)
        with user_code(f"model={cfg.model.name}'s build()", "fix the model family's build()"):
            model = cfg.model.build()
        resharded = path is not None and ckpt.needs_reshard(state, world, cfg.strategy.zero_stage)
        engine = build_engine(cfg, plan, model, load_universal=resharded)
        marks["engine_s"] = time.perf_counter()
        if path is not None:
            ckpt.restore(engine, path, rank, universal=resharded)
            set_base_lr(engine, cfg)
        marks["restore_s"] = time.perf_counter()
    # seconds each part of this start took, in order
    edges = [started, *marks.values()]
    startup = {k: t - edges[i] for i, (k, t) in enumerate(marks.items())}
    tracker = make_tracker(
        rank,
        cfg=cfg.logger,
        run_dir=args.run_dir,
        run_name=cfg.run.name,
        experiment=cfg.run.experiment,
        config=args.config_dict,
        run_id=state.wandb_run_id,
    )
    state.wandb_run_id = tracker.run_id
    control = args.control
    if rank == 0 and control is not None:
        starts, evicted = ray.get(control.register_start.remote(world))
        if len(starts) > 1:  # Ray Train restarted the worker group within this run
            before = starts[-2]
            cause = "grow" if world > before else "shrink" if world < before else "failure"
            cause = "evict" if evicted else cause
            tracker.event(state.step, "restart", cause=cause, world_size=world, previous=before)
    _note_start(state, tracker, plan, resumed=path is not None, resharded=resharded)
    slow_bf16 = slow_bf16_warning(cfg) if rank == 0 else None  # rank 0's node, every start
    if slow_bf16 is not None:
        tracker.event(state.step, "bf16_slow_on_cpu", host=socket.gethostname(), **slow_bf16)
    if rank == 0:
        stale = ckpt.remove_unregistered(args.run_dir, state.step)
        if stale:
            tracker.event(state.step, "stale_checkpoints_removed", names=sorted(stale))

    trainer = _Trainer(cfg, engine, plan, state, tracker, rank, world, control, args.train_rows)
    trainer.steps_per_epoch = steps_per_epoch
    trainer.run_dir = args.run_dir
    trainer.empty = args.empty
    trainer.startup = {"since": started, **startup}
    try:
        trainer.train(reader, args.val_files)
        # a preempted run checkpoints and goes: validation would eat into the grace period
        val = {} if trainer.stop_reason == "preempted" else trainer.validate(args.val_files)
    except Exception as e:
        found = find_run_error(e)
        message = (
            found[1]
            if found
            else ckpt.storage_full(e, args.run_dir, "writing the run's records", wrote=False)
            or damaged_shard(e, [cfg.data.path, cfg.data.val_path])
        )
        named = found and any(p and p in found[1] for p in (cfg.data.path, cfg.data.val_path))
        if found and found[0] == "DataError" and not named:  # a bad row: say which dataset
            message = f"{message} (data.path={cfg.data.path})"
        if message is not None and control is not None:
            # a bad row (or a diverged step) fails again on every retry: the driver ends
            # the run instead
            ray.get(control.fail.remote(message))
        raise
    trainer.finish(val)
    tracker.finish()
    dist.barrier()


def _epochs_left(cfg: TrainConfig, per_epoch: int, state: ckpt.TrainerState) -> int | None:
    """Epochs this group may still start (the one it is in included), from the stopping
    rules: the reader then reads no epoch the run will not train."""
    t, bounds = cfg.trainer, []
    if t.max_epochs:
        bounds.append(t.max_epochs - state.epoch)
    last = min(s for s in (t.max_steps, t.stop_at_step, 2**62) if s > 0)
    if last < 2**62:
        into = state.step - state.epoch_start_step
        bounds.append(max(1, -(-(last - state.step + into) // per_epoch)))
    return min(bounds) if bounds else None


def _seed_everything(seed: int) -> None:
    # the same seed on every rank: every rank must build the same initial model
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _where(world: int) -> list[dict[str, Any]]:
    """Every rank's place, by rank: its node (IP and the start of its Ray node id: on a
    one-machine cluster every node has the same IP), the whole node id, and its process
    id."""
    import os

    import ray

    node_id = ray.get_runtime_context().get_node_id()
    node = f"{ray.util.get_node_ip_address()}:{node_id[:8]}"
    places: list[Any] = [None] * world
    dist.all_gather_object(places, {"node": node, "node_id": node_id, "pid": os.getpid()})
    return places


def _end_run_on_run_error(control: Any) -> Any:
    """An exit callback (``ExitStack.push``): a :class:`RunError` while resuming (a
    checkpoint that is damaged or not plain data) would fail every retry the same way,
    so the driver is told to end the run."""

    def on_exit(exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        import ray

        message = run_error(exc) if exc is not None else None
        if message is not None and control is not None:
            ray.get(control.fail.remote(message))
        return False  # the exception goes on

    return on_exit


def _note_start(
    state: ckpt.TrainerState,
    tracker: NullTracker,
    plan: BatchPlan,
    resumed: bool,
    resharded: bool = False,
) -> None:
    """Events of this (re)start: resume, world size."""
    if resumed:
        tracker.event(
            state.step,
            "resume",
            world_size=plan.world_size,
            epoch=state.epoch,
            resharded=resharded,
            from_world_size=state.world_sizes[-1] if state.world_sizes else plan.world_size,
        )
    if not state.world_sizes or state.world_sizes[-1] != plan.world_size:
        state.world_sizes.append(plan.world_size)
        state.batch_plans.append(plan.to_dict())
    # every group start: the checkpoint may predate a group that came and went
    tracker.event(
        state.step,
        "world_size",
        world_size=plan.world_size,
        micro_batch_size=plan.micro_batch_size,
        grad_accum_steps=plan.grad_accum_steps,
    )


class _Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        engine: Any,
        plan: BatchPlan,
        state: ckpt.TrainerState,
        tracker: NullTracker,
        rank: int,
        world: int,
        control: Any = None,
        train_rows: int = 0,
    ) -> None:
        self.cfg, self.engine, self.plan, self.state = cfg, engine, plan, state
        self.tracker, self.rank, self.world = tracker, rank, world
        # stop requests (the driver's SIGTERM/SIGUSR1) and node drains, made common to
        # all ranks by their agreement on the steps (SyncPace)
        self._stop_poller = StopPoller(control if rank == 0 else None)
        self._progress = control if rank == 0 else None
        self._drain_probe = node_drain_probe()
        self._stop_requested = self._drain_pending = self._drain_saved = False
        self.stop_reason: str | None = None  # "stopped" (trainer.stop_at_step), "preempted"
        self.train_rows = train_rows  # samples in one epoch of the train split
        self.startup: dict[str, float] = {}
        self.reader: PlannedReader | None = None
        self.steps_per_epoch = 0
        self.task = cfg.model.task
        self.format = data_format(cfg.data.format)  # its decoding, augmentation
        self.empty: dict[str, np.ndarray] = {}  # a batch of no rows, the decoded shapes
        self.classes = getattr(cfg.model, "classes", 0)
        self.beta = getattr(cfg.model, "beta", 1.0)
        self.device = engine.device
        # fp32 ZeRO-0, where asked: the gradient all-reduce elastic's, beside backward
        self.reducer = overlapped_reduce(engine, cfg.strategy)
        self.dtype = torch.bfloat16 if cfg.strategy.precision == "bf16" else torch.float32
        self.times = PhaseTimes()
        # every rank's figures each log interval: who is slow (stragglers.*)
        self.stragglers = StragglerWatch(cfg.stragglers, _where(world))
        self._new_split: tuple[int, ...] | None = None  # rebalance: from the next step on
        self._control = control if rank == 0 else None
        self._eviction: dict[str, Any] | None = None  # evict: after this step
        self._saved_step = -1  # the step of this group's last checkpoint
        self.run_dir = ""
        self._warm = False  # a log interval after the group's first step has begun
        self._step_digest = 0  # the last agreed step's ids_digest over all ranks
        self._pace = SyncPace()  # which steps the ranks agree on
        self._unsynced = [0, 0]  # rows since the last agreement: this rank's, the plan's
        self._first_batch_s: float | None = None  # group start -> its first batch here
        self.data_ready_s: float | None = None  # group start -> its first batch read
        self.train_start = self.train_end = time.perf_counter()
        self.steady_start: float | None = None
        self.steady_samples = 0
        # this rank's log interval: [sum of per-sample losses, rows, steps]
        self._interval = torch.zeros(3, dtype=torch.float64)
        self._step_loss_sum = torch.zeros((), dtype=torch.float64)  # the last step's
        # non-finite losses or updates, made common by the ranks' next agreement
        self.divergence = Divergence()
        self._interval_start = time.perf_counter()

    # -- stopping rules ---------------------------------------------------------------
    def _done(self) -> bool:
        t, s = self.cfg.trainer, self.state
        return (
            (t.max_steps > 0 and s.step >= t.max_steps)
            or (t.max_epochs > 0 and s.epoch >= t.max_epochs)
            or self.stop_reason is not None
        )

    def _ends_here(self) -> bool:
        """This step is the run's last (a stopping rule, or the last step of the last
        epoch, which closes only after it)."""
        s, t = self.state, self.cfg.trainer
        last_epoch = t.max_epochs > 0 and s.epoch + 1 >= t.max_epochs
        return self._done() or (last_epoch and s.step - s.epoch_start_step >= self.steps_per_epoch)

    # -- training ---------------------------------------------------------------------
    def train(self, reader: PlannedReader, val_files: list[str]) -> None:
        self.reader = reader
        self.engine.train()
        self.times.session_start = self.train_start = time.perf_counter()
        while not self._done():
            if self._train_epoch(self.reader, val_files):
                self._close_epoch()
        self._stop_if_diverged()  # before the final validation and checkpoint
        self.reader.close()
        self.train_end = time.perf_counter()
        self.times.fold_into(self.state)

    def _train_epoch(self, reader: PlannedReader, val_files: list[str]) -> bool:
        """One epoch, or what is left of it; False when a stopping rule ends it early or
        the split of its steps changes (then the epoch goes on with a new reader)."""
        # the epoch's plan fixes every step's rows: resume at its step, at any world size
        s = self.state
        batches = reader.epoch(s.epoch, s.step - s.epoch_start_step)
        while (batch := self._next_batch(batches)) is not None:
            self._step(batch)  # forward, backward, optimizer
            self._account(batch)  # ledger, step count, loss sums
            self._maybe_log()
            self._maybe_checkpoint()
            self._after_step_signals()  # preemption, node drain
            self._maybe_validate(val_files)
            self._count_throughput(batch)
            if self._done() or self._resplit():
                return False
        return True

    def _next_batch(self, batches: Any) -> StepBatch | None:
        t0 = time.perf_counter()
        batch = next(batches, None)
        t1 = time.perf_counter()
        self.times.add("data_wait", t1 - t0)
        if batch is None:  # the epoch's plan is the same on every rank: all end here
            return None
        if self._first_batch_s is None and self.startup:
            self._first_batch_s = t1 - self.startup["since"]
            if self.reader is not None and self.reader.first_batch_ready_s is not None:
                # the reader started with the group (before DeepSpeed, the restore)
                self.data_ready_s = self.reader.first_batch_ready_s
                self.data_ready_s += self.reader.started - self.startup["since"]
        step = self.state.step + 1
        self._unsynced[0] += batch.rows
        self._unsynced[1] += batch.global_rows
        if not self._pace.due(step, self._agreed_on(step)):
            return batch
        rows, digest, paces = self._all_reduce_step(
            self._unsynced[0], ids_digest(batch.sample_id), self._pace.proposal()
        )
        self._pace.agreed(step, paces, self.world)
        self._step_digest = digest
        # the all-reduce waits for the slowest rank: communication, not data
        self.times.since("comm", t1)
        if rows != self._unsynced[1]:
            raise RuntimeError(
                f"step {step}: the ranks hold {rows} rows since they last agreed, the plan "
                f"{self._unsynced[1]}: their plans disagree"
            )
        self._unsynced = [0, 0]
        return batch

    def _agreed_on(self, step: int) -> bool:
        """Steps every rank must agree on whatever the pace: those logged (their batch
        digest), checkpointed or validated after, and an epoch's last."""
        t, every = self.cfg.trainer, self.cfg.checkpoint.every_steps
        return (
            self._logs_at(step)
            or bool(every and step % every == 0)
            or bool(t.val_every_steps and step % t.val_every_steps == 0)
            or step - self.state.epoch_start_step >= self.steps_per_epoch
        )

    def _count_throughput(self, batch: StepBatch) -> None:
        if self.steady_start is None:
            # throughput counts from the end of the first step: the pipeline's start-up
            # (first batch) is in data_wait, not in samples/s
            self.steady_start, self.steady_samples = time.perf_counter(), 0
            self._note_startup()
        else:
            self.steady_samples += batch.global_rows

    def _note_startup(self) -> None:
        """Where this worker group's start went (restarts are what elastic waits on)."""
        if self.startup:
            parts = {k: round(v, 3) for k, v in self.startup.items() if k != "since"}
            self.tracker.event(
                self.state.step,
                "startup",
                world_size=self.world,
                # whose gradient all-reduce: elastic's overlapped one or DeepSpeed's
                gradient_reduce="overlapped" if self.reducer is not None else "deepspeed",
                **parts,
                first_batch_s=round(self._first_batch_s or 0.0, 3),
                data_ready_s=round(self.data_ready_s or 0.0, 3),
                first_step_s=round(time.perf_counter() - self.startup["since"], 3),
            )

    def _all_reduce_step(self, rows: int, digest: int = 0, pace: int = 0) -> tuple[int, int, int]:
        """Row counts, ids digests and :class:`SyncPace` proposals summed over all
        ranks, and (in the same all-reduce) whether any rank has seen a stop request, a
        node drain or a non-finite value."""
        stop = self._stop_poller.poll() is not None
        drain = self._drain_probe()
        bad = self.divergence.pending
        t = torch.tensor(
            [rows, stop, drain, bad, digest, pace],
            dtype=torch.int64,
            device=self._collective_device,
        )
        dist.all_reduce(t)
        if t[3]:
            self.divergence.stop(self.world, self.cfg.data.path, self.cfg.optim.lr)
        self._stop_requested = self._stop_requested or bool(t[1])
        self._drain_pending = bool(t[2])
        return int(t[0]), int(t[4]), int(t[5])

    def _after_step_signals(self) -> None:
        """A stop request checkpoints and ends the run (resumable: a requeue); a node
        drain checkpoints now, once, and goes on until Ray Train restarts the group
        without the drained node."""
        if self._stop_requested and self.stop_reason is None:
            self.stop_reason = "preempted"
            self.tracker.event(
                self.state.step,
                "preempted",
                reason=self._stop_poller.reason or "stop requested",
                world_size=self.world,
            )
        elif self._drain_pending and not self._drain_saved:
            self._drain_saved = True
            self.tracker.event(self.state.step, "node_drain", world_size=self.world)
            if not self._done():
                self._save({"step": self.state.step, "loss": self.state.loss_last})
        elif self._eviction is not None and not self._ends_here():
            self._evict(self._eviction)

    def _decide_eviction(self, stragglers: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Rank 0 decides (it alone knows the run's evictions so far) and every rank
        follows: the node to evict, or None (then an ``evict_skipped`` event says why)."""
        decision: list[Any] = [None]
        if self.rank == 0:
            import ray

            done = ray.get(self._control.evictions.remote()) if self._control else 0
            where, min_workers = self.stragglers.where, self.cfg.scaling.min_workers
            decision = [eviction(stragglers, where, min_workers, done, self.cfg.stragglers)]
        dist.broadcast_object_list(decision, src=0)
        request, why = decision[0]
        if why is not None:
            self.tracker.event(self.state.step, "evict_skipped", world_size=self.world, reason=why)
        return request

    def _evict(self, request: dict[str, Any]) -> None:
        """Checkpoint now; rank 0 asks the driver to keep the node out and waits until it
        has, and until the checkpoint is registered (the one the smaller group resumes
        from); then every rank leaves and Ray Train restarts the group without it."""
        s = self.state
        if self._saved_step != s.step:
            self._save({"step": s.step, "loss": s.loss_last})
        self.tracker.event(s.step, "evict", world_size=self.world, **request)
        if self._control is not None:
            wait_for_eviction(self._control, request, self.run_dir, s.step)
        dist.barrier()
        raise Evicting(
            f"step {s.step}: node {request['node']} evicted (rank {request['rank']}, "
            f"{request['ratio']}x the others' compute time) for {request['cooldown_s']:g} s: "
            "the worker group restarts without it"
        )

    @property
    def _collective_device(self) -> torch.device:
        return self.device if self.cfg.scaling.use_gpu else torch.device("cpu")

    def _step(self, batch: StepBatch) -> None:
        plan, engine, d = self.plan, self.engine, self.cfg.data
        with user_code(f"data.format={d.format}'s augment()", "fix the format's augment()"):
            inputs = self.format.augment(batch.x, batch.sample_id, self.state.epoch, d)
        x = torch.from_numpy(inputs).to(self.device, self.dtype)
        self._check_labels(batch.y, batch.sample_id, d.path)
        y = x if self.task == "vae" else torch.from_numpy(batch.y).to(self.device)
        # Weight per-sample losses so the gradient is the mean over the step's rows on all
        # workers, even when a worker has fewer rows (end of epoch): DeepSpeed divides by
        # the accumulation steps and averages over workers, which this factor undoes.
        weight = plan.world_size * plan.grad_accum_steps / batch.global_rows
        loss_sum = torch.zeros((), dtype=torch.float64)
        skipped = getattr(engine, "skipped_steps", 0)
        ids = np.array_split(batch.sample_id, plan.grad_accum_steps)
        for xs, ys, ids_micro in zip(
            torch.tensor_split(x, plan.grad_accum_steps),
            torch.tensor_split(y, plan.grad_accum_steps),
            ids,
            strict=True,
        ):
            # each phase's collectives (the wait for the slowest rank) count as comm
            with self.times.phase("forward"):
                losses = self._losses(engine(xs).float(), ys)
                loss = losses.sum() * weight
            with self.times.phase("backward"):
                engine.backward(loss)
                if self.reducer is not None:
                    self.reducer.finish()
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
        self._step_loss_sum = loss_sum

    def _account(self, batch: StepBatch) -> None:
        """The step is done: its rows are trained (the ledger), its loss is summed."""
        self.state.ledger.record(batch.sample_id)
        self.state.step += 1
        self.state.samples_seen += batch.global_rows
        self._interval[0] += self._step_loss_sum
        self._interval[1] += batch.rows
        self._interval[2] += 1

    def _check_labels(self, target: np.ndarray, sample_id: np.ndarray, path: str) -> None:
        """Class labels the model has no output for (shards without statistics are not
        checked before Ray starts): the same rows fail every retry, so a DataError."""
        output_dim = getattr(self.cfg.model, "output_dim", 1)
        bad = bad_labels(self.task, target, output_dim, self.classes)
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
            f"class labels outside model={self.cfg.model.name}'s "
            f"{label_range(self.task, output_dim, self.classes)} in {path}: {where}; fix those "
            "rows or model.output_dim"
        )

    def _losses(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return per_sample_loss(self.task, output, target, self.classes, self.beta)

    def _logs_at(self, step: int) -> bool:
        t = self.cfg.trainer
        last = (t.max_steps > 0 and step >= t.max_steps) or step == t.stop_at_step
        return last or step == 1 or step % t.log_every_steps == 0

    def _maybe_log(self) -> None:
        s = self.state
        if not self._logs_at(s.step):
            return
        now = time.perf_counter()
        elapsed = now - self._interval_start
        seconds = self.times.take_interval()  # this rank's phases
        table = self._gather_interval(seconds)  # every rank's: loss sum, then FIGURES
        rows = float(table[:, 1 + FIGURES.index("rows")].sum())
        loss = float(table[:, 0].sum() / rows)
        samples_per_s = rows / elapsed if elapsed > 0 else 0.0
        shares = {p: v / elapsed if elapsed > 0 else 0.0 for p, v in seconds.items()}
        # the group's first interval holds its first step: no measure of anyone's speed
        warmup, self._warm = not self._warm, True
        per_worker, stragglers = self.stragglers.observe(table[:, 1:], warmup)
        if s.loss_first is None:
            s.loss_first = loss
        s.loss_last = loss
        lr = self.engine.get_lr()[0]
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
                "train/batch_digest": self._step_digest,
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
        if stragglers and self.cfg.stragglers.policy == "evict":
            self._eviction = self._decide_eviction(stragglers)
        if self.cfg.stragglers.policy == "rebalance":  # the same table on every rank
            self._new_split = self.stragglers.rebalance(
                self.cfg.data.global_batch_size, self._max_slice_rows()
            )
        if self._progress is not None:  # the driver's progress display; never waited on
            self._progress.progress.remote(s.step, s.epoch, loss, self.world, samples_per_s)
        self._interval.zero_()
        self._interval_start = now

    def _max_slice_rows(self) -> int | None:
        """The largest slice a rank may train: data.micro_batch_size per forward pass."""
        micro = self.cfg.data.micro_batch_size
        return None if micro is None else micro * self.plan.grad_accum_steps

    def _resplit(self) -> bool:
        """A new split of every step's rows (rebalance) takes effect at the next step:
        the reader goes on from there with it."""
        split, self._new_split = self._new_split, None
        if split is None or self.reader is None:
            return False
        s = self.state
        self.reader = self.reader.resplit(split, s.epoch, s.step - s.epoch_start_step)
        self.tracker.event(
            s.step,
            "rebalance",
            world_size=self.world,
            shares=list(split),
            rows=slice_sizes(self.cfg.data.global_batch_size, split),  # a full step's
        )
        return True

    def _gather_interval(self, seconds: dict[str, float]) -> np.ndarray:
        """Every rank's log interval, a row per rank: its loss sum, then the straggler
        figures (compute, data wait and collective seconds, rows, steps, optimizer
        seconds)."""
        loss_sum, rows, steps = self._interval.tolist()
        figures = {
            "compute_s": sum(seconds[p] for p in COMPUTE),
            "data_wait_s": seconds["data_wait"],
            "comm_s": seconds["comm"],
            "rows": rows,
            "steps": steps,
            "optimizer_s": seconds["optimizer"],
        }
        mine = torch.tensor(
            [loss_sum, *(figures[k] for k in FIGURES)],
            dtype=torch.float64,
            device=self._collective_device,
        )
        rows_of = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(rows_of, mine)
        return torch.stack(rows_of).cpu().numpy()

    def _of_max(self) -> str:
        return f"/{self.cfg.trainer.max_steps}" if self.cfg.trainer.max_steps else ""

    def _maybe_checkpoint(self) -> None:
        s, t, every = self.state, self.cfg.trainer, self.cfg.checkpoint.every_steps
        if t.stop_at_step and s.step >= t.stop_at_step:
            self.stop_reason = "stopped"
            return  # the final checkpoint in finish() covers it
        if self._ends_here():
            return  # the final checkpoint in finish() covers it
        if every and s.step % every == 0:
            self._save({"step": s.step, "loss": s.loss_last})

    def _maybe_validate(self, val_files: list[str]) -> None:
        every = self.cfg.trainer.val_every_steps
        if every and val_files and self.state.step % every == 0 and not self._ends_here():
            self.validate(val_files)  # the final validation after training covers the end

    def _sync_ledger(self) -> None:
        """Gather every rank's trained sample ids to rank 0's ledger."""
        mine = self.state.ledger.take_pending()
        gathered: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if gathered is not None:
            self.state.ledger.merge(gathered)

    def _close_epoch(self) -> None:
        self.state.epoch_start_step = self.state.step
        self._sync_ledger()
        if self.rank == 0:
            record = self.state.ledger.close_epoch()
            self.tracker.event(self.state.step, "epoch_end", **record)
        else:
            self.state.ledger.close_epoch()

    def _save(self, metrics: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        self._stop_if_diverged()  # a non-finite model never displaces a good checkpoint
        self._sync_ledger()
        self.times.fold_into(self.state)
        ckpt.save(self.engine, self.state, self.rank, metrics)
        self._saved_step = self.state.step
        self.times.since("checkpoint", t0)

    # -- divergence ---------------------------------------------------------------------
    def _stop_if_diverged(self) -> None:
        """Before anything is kept (a checkpoint, the final validation)."""
        if self.divergence.check(self.engine, self.state.step, self._collective_device):
            self.divergence.stop(self.world, self.cfg.data.path, self.cfg.optim.lr)

    # -- validation and the end ---------------------------------------------------------
    def validate(self, val_files: list[str]) -> dict[str, float]:
        """Metrics over the validation split (``val_files``; none: no metrics)."""
        if not val_files:
            return {}
        self.engine.eval()
        sums = MetricSums(self.task, getattr(self.cfg.model, "output_dim", 1), self.classes)
        stream = StepStream(
            val_blocks(self.cfg.data, val_files, self.rank, self.world),
            self.plan.micro_batch_size,
            lambda rows: self._all_reduce_step(rows)[0],
            empty=self.empty,
        )
        # rows the metrics cannot count, by why: labels the model has no output for
        # (shards without statistics are not checked before Ray), a loss of nan/inf
        left_out: dict[str, list[int]] = {"labels": [], "not_finite": []}
        output_dim = getattr(self.cfg.model, "output_dim", 1)
        with torch.no_grad():
            for batch in stream:
                ids, xs, ys = batch.sample_id, batch.x, batch.y
                bad = bad_labels(self.task, ys, output_dim, self.classes)
                if bad.any():
                    left_out["labels"] += ids[bad].tolist()
                    ids, xs, ys = ids[~bad], xs[~bad], ys[~bad]
                x = torch.from_numpy(xs).to(self.device, self.dtype)
                y = x if self.task == "vae" else torch.from_numpy(ys).to(self.device)
                out = self.engine(x).float()
                losses = self._losses(out, y)
                finite = torch.isfinite(losses)
                if not bool(finite.all()):
                    left_out["not_finite"] += ids[~finite.cpu().numpy()].tolist()
                    out, y, losses = out[finite], y[finite], losses[finite]
                sums.add(out.cpu(), y.cpu(), losses.cpu())
        self.engine.train()
        counts = [float(len(ids)) for ids in left_out.values()]
        totals = torch.cat([sums.sums, torch.tensor(counts, dtype=torch.float64)])
        totals = totals.to(self._collective_device)
        dist.all_reduce(totals)
        sums.sums = totals[: -len(counts)].cpu()
        metrics = sums.metrics()
        left = dict(zip(left_out, (int(c) for c in totals[-len(counts) :].tolist()), strict=True))
        if any(left.values()):
            metrics["rows_left_out"] = sum(left.values())
            self._name_left_out(left_out, left)
        self.tracker.log(
            self.state.step,
            {f"val/{k}": v for k, v in metrics.items()},
            console="[elastic] validation: "
            + ", ".join(f"{k} {v:.6g}" for k, v in metrics.items()),
        )
        return metrics

    def _name_left_out(self, mine: dict[str, list[int]], counts: dict[str, int]) -> None:
        """Collective: the validation rows left out of the metrics (``counts`` by why,
        over all ranks), named by rank 0 in an event (a console line, a W&B alert)."""
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, {k: v[:NAMED_ROWS] for k, v in mine.items()})
        if self.rank != 0:
            return
        path = self.cfg.data.val_path or ""
        output_dim = getattr(self.cfg.model, "output_dim", 1)
        why = {
            "labels": f"class labels outside {label_range(self.task, output_dim, self.classes)}",
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
            self.state.step,
            "val_rows_left_out",
            rows=sum(counts.values()),
            detail=f"validation rows in {path} left out of the metrics, {'; '.join(parts)}: "
            "fix those rows",
        )

    def _exactly_once(self) -> bool:
        """From the ledger the surviving checkpoints carry: every closed epoch trained
        each of the dataset's samples once (its bitmap holds them all, no sample was
        noted twice), and the open epoch has no sample twice."""
        ledger, rows = self.state.ledger, self.train_rows
        closed = all(e["trained"] == rows and e["duplicates"] == 0 for e in ledger.closed_epochs)
        return closed and ledger.duplicates == 0 and ledger.trained <= rows

    def finish(self, val: dict[str, float]) -> None:
        """Final checkpoint, carrying the run's summary as its metrics."""
        s = self.state
        steady_s = self.train_end - (self.steady_start or self.train_end)
        samples_per_s = self.steady_samples / steady_s if steady_s > 0 else 0.0
        self._sync_ledger()
        total = max(s.train_wall_s, 1e-9)
        shares = {p: s.time_s.get(p, 0.0) / total for p in PHASES}
        shares["other"] = max(0.0, 1.0 - sum(shares.values()))
        workers, slowest = self.stragglers.summary()
        summary = WorkerSummary(
            status=self.stop_reason or "finished",
            steps=s.step,
            epoch=s.epoch,
            samples_seen=s.samples_seen,
            loss_first=s.loss_first,
            loss_last=s.loss_last,
            val=val,
            samples_per_s=samples_per_s,
            time_breakdown=shares,
            wandb_dir=self.tracker.wandb_dir,
            epochs_closed=s.ledger.closed_epochs,
            samples_exactly_once=self._exactly_once(),
            workers=workers,
            slowest_median_ratio=slowest,
        )
        ckpt.save(self.engine, s, self.rank, {"step": s.step, "summary": summary.to_dict()})
