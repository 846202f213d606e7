"""What every Ray Train worker runs (:func:`run`, called by :mod:`elastic.train.entry`).

Top to bottom: world size -> batch plan -> the reader (started first: it reads while
DeepSpeed starts) -> process group -> model + DeepSpeed -> resume -> the group's start
events -> :class:`~elastic.train.step_loop.StepLoop` trains -> validation -> the final
checkpoint. An error a retry cannot fix (a bad row, a damaged checkpoint, a full disk)
is told to the driver, which ends the run instead of letting Ray Train retry it.
"""

from __future__ import annotations

import contextlib
import random
import socket
import time
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from elastic.cluster import ray_internals
from elastic.config.schema import TrainConfig
from elastic.data.reader import PlannedReader, epoch_plan
from elastic.data.shards import damaged_shard
from elastic.errors import find_run_error, run_error, user_code
from elastic.observe.tracking import NullTracker, make_tracker
from elastic.train import checkpoint as ckpt
from elastic.train import integrity, lazy_dynamo
from elastic.train.accounting import gather_ledger
from elastic.train.batch import BatchPlan
from elastic.train.engine import (
    build_engine,
    init_distributed,
    set_base_lr,
    set_plan,
    slow_bf16_warning,
    warm_imports,
)
from elastic.train.membership import Membership
from elastic.train.quorum import Quorum, abandon_default_group, copy_state
from elastic.train.step_loop import StepLoop
from elastic.train.timing import CollectiveClock
from elastic.train.worker_args import WorkerArgs

# Batches arrive as read-only numpy views of Ray's object store; torch only reads them,
# so we wrap them without a copy and silence torch's warning about writability.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def run(config: dict[str, Any]) -> None:
    """One worker's run, from Ray Train's ``train_loop_config`` (elastic.train.entry)."""
    import ray
    import ray.train

    args: WorkerArgs = config["args"]
    cfg = args.cfg
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    quorum = None  # scaling.live: this worker's membership (rank and world: its quorum's)
    if args.quorum_store is not None:
        ray_internals.torch_worker().set_env()  # LOCAL_RANK & co., as Ray Train's backend
        quorum = Quorum(args.quorum_store, args.control, rank, world)

    started = time.perf_counter()
    lazy_dynamo.defer()  # first: nothing before the engine may import torch's compiler
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
        # a quorum with a live member trains: this worker replaces a dead one (else it
        # is one of a group Ray Train started, first or again after a restart)
        joining = quorum is not None and ray.get(args.control.quorum_live.remote()) >= 0
        if quorum is not None and not joining:
            # the first quorum: every worker, each resumed from the same checkpoint
            m = quorum.form(state.step)
            rank, world = m.rank(quorum.name), m.size
        elif joining:
            # a newcomer builds its engine alone (DeepSpeed's start makes collectives the
            # quorum would not), then joins and copies the state from rank 0
            rank, world = 0, 1
            _alone()
        plan = BatchPlan.for_world(cfg.data.global_batch_size, world, cfg.data.micro_batch_size)
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
        if path is not None and not joining:
            ckpt.restore(engine, path, rank, universal=resharded)
            set_base_lr(engine, cfg)
        if quorum is not None and joining:
            abandon_default_group()  # the group it built its engine in
            m = quorum.form(state.step)
            rank, world = m.rank(quorum.name), m.size
            plan = BatchPlan.for_world(cfg.data.global_batch_size, world, cfg.data.micro_batch_size)
        if quorum is not None:
            set_plan(engine, plan, rank)  # its rank and world are the quorum's
        marks["restore_s"] = time.perf_counter()
    # seconds each part of this start took, in order
    edges = [started, *marks.values()]
    startup = {k: t - edges[i] for i, (k, t) in enumerate(marks.items())}

    def tracker_of(rank: int) -> NullTracker:
        """Rank 0's tracker (W&B, the run's records; the run's W&B run resumed), a null
        one elsewhere."""
        return make_tracker(
            rank,
            cfg=cfg.logger,
            run_dir=args.run_dir,
            run_name=cfg.run.name,
            experiment=cfg.run.experiment,
            config=args.config_dict,
            run_id=state.wandb_run_id,
        )

    tracker = tracker_of(rank)
    where = _where(world)
    loop_state: dict[str, Any] = {}
    if joining:
        assert quorum is not None and quorum.membership is not None
        # the survivors send it (StepLoop._reform)
        loop_state = copy_state(engine, state, quorum.membership)[1]
        gather_ledger(state.ledger, rank, world, everywhere=True)  # as they do next
        reader = reader.resplit(world, state.epoch, state.step - state.epoch_start_step, rank)
    if quorum is None:
        state.wandb_run_id = tracker.run_id
    elif not joining:  # every member knows rank 0's W&B run (any may become rank 0)
        run_id = [tracker.run_id]
        dist.broadcast_object_list(run_id, src=0)
        state.wandb_run_id = run_id[0]
    control = args.control
    if rank == 0 and control is not None:
        starts, evicted = ray.get(control.register_start.remote(world))
        if len(starts) > 1:  # Ray Train restarted the worker group within this run
            before = starts[-2]
            cause = "grow" if world > before else "shrink" if world < before else "failure"
            cause = "evict" if evicted else cause
            tracker.event(state.step, "restart", cause=cause, world_size=world, previous=before)
    if not joining:
        _note_start(state, tracker, plan, resumed=path is not None, resharded=resharded)
    slow_bf16 = slow_bf16_warning(cfg) if rank == 0 else None  # rank 0's node, every start
    if slow_bf16 is not None:
        tracker.event(state.step, "bf16_slow_on_cpu", host=socket.gethostname(), **slow_bf16)
    if rank == 0:
        stale = ckpt.remove_unregistered(args.run_dir, state.step)
        if stale:
            tracker.event(state.step, "stale_checkpoints_removed", names=sorted(stale))

    lead = [rank == 0]  # whether this worker's tracker is rank 0's

    def rewire(m: Membership) -> tuple[Any, list[dict[str, Any]]]:
        """A live run's new quorum: rank 0's tracker where this worker became rank 0
        (the eldest left), every rank's place."""
        nonlocal tracker
        assert quorum is not None
        if m.rank(quorum.name) == 0 and not lead[0]:
            lead[0] = True
            tracker = tracker_of(0)
        return tracker, _where(m.size)

    trainer = StepLoop(
        cfg,
        engine,
        plan,
        state,
        tracker,
        rank,
        where,
        steps_per_epoch=steps_per_epoch,
        run_dir=args.run_dir,
        control=control,
        startup={"since": started, **startup},
        empty=args.empty,
        quorum=quorum,
        rewire=rewire if quorum is not None else None,
    )
    if trainer.live is not None:
        trainer.live.take(loop_state)  # a newcomer: rank 0's deferred checkpoint, its end
    end = loop_state.get("end")  # a newcomer that joined the others at the end
    try:
        if end is not None:
            reader.close()  # nothing left to read: kept for its split (LiveRun)
            trainer.reader = reader
            trainer.stop_reason, val = end["stop_reason"], end["val"]
        else:
            trainer.train(reader, args.val_files)
            # a preempted run checkpoints and goes: validation would eat into the grace
            # period
            stopped = trainer.stop_reason == "preempted"
            val = {} if stopped else trainer.validate(args.val_files)
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
    trainer.finish(val, args.train_rows)
    trainer.tracker.finish()
    dist.barrier()


def _alone() -> None:
    """A process group of this worker alone (a live run's newcomer builds its engine in
    it, then leaves it for its quorum)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


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
