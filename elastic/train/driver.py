"""The driver: data ready -> Ray -> TorchTrainer.fit() -> summary.json."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from elastic.cluster.connect import STOP_SIGNALS, off_the_terminal, stop_signals
from elastic.cluster.cordon import Cordons
from elastic.cluster.placement import check_resources, no_group_started
from elastic.config.probe import probe
from elastic.config.schema import TrainConfig
from elastic.data.order import Layout
from elastic.data.pipeline import fits_cache, warm_up
from elastic.data.reader import content_changes, data_record, layout_changes, setting_changes
from elastic.data.shards import Split, check_dataset, split_warnings
from elastic.errors import CheckpointError, ClusterUnavailableError, RunError, exception_text
from elastic.observe.metrics import (
    SESSION_END,
    SESSION_START,
    append_record,
    parse_target,
    read_records,
    repair_records,
    run_seconds,
    sessions,
    time_to_target,
)
from elastic.observe.progress import DriverProgress, total_steps
from elastic.observe.summary import Summary
from elastic.observe.tracking import json_text
from elastic.train.control import STATUS_WAIT_S, start_control
from elastic.train.runlock import run_lock
from elastic.train.trainer import interruptible


def prepare_data(cfg: TrainConfig) -> dict[str, Split]:
    """Generate synthetic data that is configured but missing, then check every shard."""
    syn = cfg.data.synthetic
    if syn is not None and not (
        os.path.isdir(cfg.data.path) and (not cfg.data.val_path or os.path.isdir(cfg.data.val_path))
    ):
        from elastic.datasets.synthetic import generate

        print(f"[elastic] generating synthetic data in {cfg.data.path}", flush=True)
        generate(
            cfg.data.path,
            cfg.data.val_path,
            syn.rows,
            syn.val_rows,
            syn.shards,
            syn.input_dim,
            syn.output_dim,
            syn.seed,
        )
    splits = check_dataset(cfg.data)
    for warning in split_warnings(cfg.data, cfg.scaling.max_workers, splits):
        print(f"[elastic] warning: {warning}", flush=True)
    return splits


def run_dir(cfg: TrainConfig) -> str:
    return os.path.join(cfg.run.storage_path, cfg.run.name)


def train(cfg: TrainConfig, config_dict: dict[str, Any]) -> dict[str, Any]:
    """Run training to the end and return the summary (the entry point writes it out).
    One start of a run at a time: the run folder's lock is held throughout."""
    with run_lock(run_dir(cfg)) as taken_over:
        if taken_over:
            print(f"[elastic] warning: {taken_over}", flush=True)
        return _train(cfg, config_dict)


def _train(cfg: TrainConfig, config_dict: dict[str, Any]) -> dict[str, Any]:
    import ray.data
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from elastic.cluster import connect as cluster
    from elastic.cluster import rendezvous
    from elastic.train import integrity
    from elastic.train.checkpoint import read_state
    from elastic.train.entry import train_loop
    from elastic.train.worker_args import WorkerArgs

    splits = prepare_data(cfg)
    out = run_dir(cfg)
    train_split = splits["train"]
    # the first rows through decoder, model and loss, before Ray starts (plugins' code)
    probed = probe(cfg, train_split.files)
    layout = Layout(train_split.row_groups)
    record = data_record(cfg.data, train_split.files, layout)
    # the checkpoint to resume from: intact, made for this model and this data, or the
    # run ends here
    resume = integrity.prepare_resume(out, cfg.model)
    for warning in resume.warnings:
        print(f"[elastic] warning: {warning}", flush=True)
    if resume.path is not None:
        changed = check_resume_data(
            read_state(resume.path),
            record,
            cfg.data.path,
            resume.path,
            cfg.checkpoint.accept_changed_data,
        )
        if changed:
            print(f"[elastic] warning: {changed}", flush=True)
    repaired = repair_records(out)  # before a record is appended to a torn line
    if repaired:
        print(f"[elastic] warning: {repaired}", flush=True)
    # the run's time counts while a session runs (time to target; the report's clock)
    append_record(out, {"event": SESSION_START, "time": time.time(), "pid": os.getpid()})
    print(f"[elastic] run {cfg.run.name}: checkpoints and metrics in {out}", flush=True)
    rows = ", ".join(f"{s.rows} {name} rows" for name, s in splits.items())
    print(f"[elastic] dataset: {rows} (data.path={cfg.data.path})")
    sc = cfg.scaling
    cache_train = fits_cache(cfg.data, train_split)
    if cache_train:
        print("[elastic] the train split fits data.cache_mb: each row group read once a worker")
    workers: int | tuple[int, int] = (
        sc.min_workers if sc.min_workers == sc.max_workers else (sc.min_workers, sc.max_workers)
    )
    started = time.time()
    # Ray Train's controller reads its recovery knobs from the environment it inherits
    os.environ.update(sc.ray_env())
    with cluster.connect(cfg.cluster, sc) as where:
        print(f"[elastic] connected to {where}", flush=True)
        # an embedded cluster is what it is; an explicit one may have nodes to come
        for warning in check_resources(sc, ray.nodes(), fixed=not cfg.cluster.address):
            print(f"[elastic] warning: {warning}", flush=True)
        ray.data.DataContext.get_current().enable_progress_bars = False
        quorum_store, serving = None, None  # a live run's store, served for the run
        if sc.live:
            quorum_store, serving = rendezvous.serve_quorum_store()

        def make_trainer(attempt: int) -> tuple[Any, Any]:
            """The run's control actor and its TorchTrainer (``attempt``: a live run's
            fits, each with its own keys in the quorums' store)."""
            control = start_control()
            store_at = None if quorum_store is None else (*quorum_store, f"fit{attempt}/")
            trainer = interruptible(TorchTrainer, control)(
                train_loop,
                train_loop_config={
                    "args": WorkerArgs(
                        cfg=cfg,
                        config_dict=config_dict,
                        run_dir=out,
                        train_files=train_split.files,
                        layout=layout,
                        data_record=record,
                        cache_train=cache_train,
                        train_rows=train_split.rows,
                        val_files=splits["val"].files if "val" in splits else [],
                        empty=probed.empty,
                        resume_from=None if resume.registered or attempt else resume.path,
                        control=control,
                        quorum_store=store_at,
                    )
                },
                scaling_config=ScalingConfig(
                    num_workers=workers,  # type: ignore[arg-type]  # (min, max) is elastic
                    use_gpu=sc.use_gpu,
                    resources_per_worker={"CPU": sc.cpus_per_worker},
                    placement_strategy=sc.placement_strategy,
                    # Train V2 field (mypy sees the V1 class)
                    elastic_resize_monitor_interval_s=sc.resize_interval_s,  # type: ignore[call-arg]
                ),
                run_config=RunConfig(
                    name=cfg.run.name,
                    storage_path=cfg.run.storage_path,
                    checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
                    # an eviction restarts the worker group, which Ray Train counts as a
                    # failure
                    failure_config=FailureConfig(max_failures=sc.max_failures + _evictions(cfg)),
                ),
                torch_config=rendezvous.torch_config(sc.use_gpu, live=sc.live),
            )
            return control, trainer

        t = cfg.trainer
        display = DriverProgress(
            total_steps(
                t.max_steps,
                t.max_epochs,
                t.stop_at_step,
                splits["train"].rows,
                cfg.data.global_batch_size,
            ),
            t.progress,
            t.progress_every_s,
        )
        if layout.groups():  # Ray Data's first execution starts while Ray Train does
            f, g, _ = layout.groups()[0]
            # a read process for each worker this node can hold (~300 MB each: at most 8)
            sc = cfg.scaling
            fit = int((os.cpu_count() or 1) // max(sc.cpus_per_worker, 1e-9))
            warm_up(cfg.data, train_split.files, (f, g), max(1, min(sc.max_workers, fit, 8)))
        try:
            no_group = None
            if sc.placement_timeout_s:
                no_group = (sc.placement_timeout_s, lambda waited: no_group_started(sc, waited))
            attempt = 0
            while True:
                control, trainer = make_trainer(attempt)
                try:
                    with _run_control(control, trainer, display, Cordons(out, control), no_group):
                        result = trainer.fit()
                    break
                except ray.train.ControllerError as e:
                    # scaling.live: Ray Train's controller fails where replacing one
                    # replica group meets another dead (several workers or a node lost
                    # at once): the run starts a new fit from its last checkpoint
                    attempt += 1
                    if not sc.live or attempt > LIVE_REFITS:
                        raise
                    why = exception_text(e, 200)
                    print(
                        f"[elastic] warning: Ray Train's controller failed ({why}): the "
                        "workers restart from the last checkpoint",
                        flush=True,
                    )
                    append_record(out, {"event": "refit", "time": time.time(), "why": why})
        finally:
            del serving  # the quorums' store: no worker needs it now
            display.close()
            try:
                append_record(out, {"event": SESSION_END, "time": time.time()})
            except OSError as e:  # a full disk: what ended the run says so, not this
                print(f"[elastic] warning: the session's end not recorded ({e})", flush=True)
    metrics = result.metrics or {}
    records = read_records(out)
    events = [r for r in records if "event" in r]
    target = parse_target(cfg.metrics.target) if cfg.metrics.target else None
    summary = Summary.from_parts(
        metrics.get("summary"),
        experiment=cfg.run.experiment,
        run_name=cfg.run.name,
        world_sizes=world_sizes(events),
        events=events,
        checkpoint=result.checkpoint.path if result.checkpoint else None,
        run_dir=out,
        wall_s=time.time() - started,
        run_s=run_seconds(sessions(records), time.time()),
        target=str(target) if target else None,
        time_to_target_s=time_to_target(records, target) if target else None,
    )
    return summary.to_dict()


def check_resume_data(
    state: Any, now: dict[str, Any], path: str, checkpoint: str, accept_changed: bool = False
) -> str | None:
    """A resumed run's batches are planned on the data its checkpoint names: shards
    added, removed, resized or rewritten since (compared by name, rows and footer) would
    re-map the epoch's rows without a word, so they end the run here (before Ray
    starts), naming the shard; so does a change of the plan's settings in the middle of
    an epoch (at an epoch's end they may change). ``accept_changed`` (the user's
    ``checkpoint.accept_changed_data``) takes changed shards, those that keep the plan's
    rows anywhere, others at an epoch's end: returns the warning to print then."""
    mid_epoch = state.step != state.epoch_start_step
    if not state.data:
        if mid_epoch:
            raise CheckpointError(
                f"checkpoint {checkpoint} was written before batches were planned from the "
                f"data (step {state.step}, in epoch {state.epoch}): it cannot resume mid-epoch "
                "exactly; start a new run.name"
            )
        return None
    warning = None
    layout = layout_changes(state.data, now)
    changed = layout or content_changes(state.data, now)
    if changed:
        if not accept_changed or (mid_epoch and layout):
            fix = (
                "resume from a checkpoint at an epoch's end, "
                if accept_changed
                else "to train on the data as it is now, add checkpoint.accept_changed_data=true; "
            )
            raise CheckpointError(
                f"data.path={path} changed since checkpoint {checkpoint} was written: "
                f"{changed}; restore the shards it was trained on to resume, {fix}or start "
                "a new run.name"
            )
        warning = (
            f"data.path={path} changed since checkpoint {checkpoint} was written ({changed}): "
            "resuming on the data as it is now (checkpoint.accept_changed_data=true)"
        )
    settings = setting_changes(state.data, now)
    if settings and mid_epoch:
        raise CheckpointError(
            f"checkpoint {checkpoint} is in the middle of epoch {state.epoch}, planned with "
            f"other settings: {', '.join(settings)}; resume with the checkpoint's values (they "
            "may change once an epoch ends)"
        )
    return warning


LIVE_REFITS = 3
"""scaling.live: new fits after Ray Train's controller failed replacing workers."""


def _evictions(cfg: TrainConfig) -> int:
    st = cfg.stragglers
    return st.max_evictions if st.policy == "evict" else 0


@contextmanager
def _run_control(
    control: Any,
    trainer: Any,
    display: Any = None,
    cordons: Cordons | None = None,
    no_group: tuple[float, Callable[[float], str]] | None = None,
) -> Iterator[None]:
    """The driver's side of the control actor, for the length of fit().

    SIGTERM, SIGUSR1 or SIGHUP to the driver (a batch system's warning before the end of
    an allocation, a closed terminal): checkpoint now and stop; the same command
    resumes. A second one stops at once (exit 75), a SIGINT too (exit 130): the last
    complete checkpoint is kept. So does the first where no worker group is up (one is
    being started, or started again after a failure: Ray Train would retry it as long as
    its failures allow), or when the group that was to checkpoint fails.

    ``no_group``: (seconds, message): when no worker group has been up for that long
    while one is being started (a placement that cannot succeed: nodes gone, a strict
    placement strategy), the run ends with the message's line for the time waited.

    The main thread sits in Ray's blocking ``ray.get`` for all of fit(), where Python
    signal handlers do not run until it returns, i.e. at the end of training. So the
    signals are read from a wakeup fd (written by the C-level handler the moment one
    arrives) by one thread, which also keeps the driver's standing question out to the
    control actor (:meth:`~elastic.train.control.RunControl.wait_status`: answered the
    moment there is news) and looks for its answer 4 times a second, without a call.

    A worker that hits an error a retry cannot fix (:class:`RunError`: a bad row, a
    diverged step, a checkpoint that does not fit) tells the actor; the run is aborted
    rather than restarted and fit()'s caller gets the RunError, one line naming it.
    Checkpoints already written stay.

    A node rank 0 evicts (``stragglers.policy=evict``) is kept out of the run for its
    cooldown by ``cordons``, asked for here before its workers leave."""
    import ray

    from elastic.cluster.connect import Stopped

    done = threading.Event()
    found: list[RunError] = []  # what ends the run, if anything does
    wake_r, wake_w = socket.socketpair()
    wake_w.setblocking(False)

    aborted: list[float] = []  # when the run was aborted

    def controller() -> Any:
        """Ray Train's controller actor (its handle is set where fit() runs in the main
        thread; elsewhere the controller told the control actor)."""
        if trainer.controller is None:
            with contextlib.suppress(Exception):
                trainer.controller = ray.get(control.controller.remote(), timeout=5)
        return trainer.controller

    def abort(interrupt: BaseException | None) -> None:
        if aborted:
            return
        aborted.append(time.monotonic())
        if interrupt is not None:
            type(trainer).interrupted = interrupt  # fit() raises it
        if controller() is not None:
            trainer.controller.abort.remote()

    def relay() -> None:
        stop: int | None = None  # the stop signal being acted on
        starting_since: float | None = None  # no worker group up, one being started
        pending, seen = None, -1  # the standing question to the control actor (the
        # first one is answered at once: whether a group is up is known from the start)
        while not done.is_set():
            if select.select([wake_r], [], [], TICK_S)[0]:
                for signum in wake_r.recv(64):
                    if signum == signal.SIGINT:
                        abort(KeyboardInterrupt())
                    elif signum in STOP_SIGNALS and (stop is not None or starting_since):
                        # a second one; or no worker group is up, so nothing newer than
                        # the last checkpoint exists to save: stop now
                        abort(Stopped(signum))
                    elif signum in STOP_SIGNALS:
                        stop = signum
                        name = signal.Signals(signum).name
                        control.request_stop.remote(name)
                        if signum == signal.SIGHUP:
                            off_the_terminal()
                        with contextlib.suppress(OSError):
                            print(f"[elastic] {name}: checkpointing now, then stopping", flush=True)
            if aborted:
                # Ray Train's controller takes an abort between its loop's steps; while
                # it retries a group's start it has none (each attempt blocks its event
                # loop): past a grace period it is ended, and its workers with it
                if time.monotonic() - aborted[0] > ABORT_GRACE_S and controller():
                    with contextlib.suppress(Exception):
                        ray.kill(trainer.controller)
                    return
                continue
            if starting_since:
                if stop is not None:  # the group that was to checkpoint failed: a new
                    abort(Stopped(stop))  # one would only start from the same checkpoint
                elif no_group is not None and time.time() - starting_since > no_group[0]:
                    found.append(ClusterUnavailableError(no_group[1](time.time() - starting_since)))
                    abort(None)
            try:
                if pending is None:
                    pending = control.wait_status.remote(seen, STATUS_WAIT_S)
                if not ray.wait([pending], timeout=0)[0]:
                    continue  # no news yet: a local look, no call
                seen, (message, progress, evictions, starting_since) = ray.get(pending)
                pending = None
            except Exception:  # the run is ending; fit() reports what happened
                return
            if cordons is not None:  # evicted nodes kept out for their cooldown
                cordons.update(evictions)
            if progress and display is not None:
                with contextlib.suppress(OSError):  # a terminal gone
                    display.update(progress)
            if message:
                found.append(RunError(message))
                abort(None)

    previous: dict[int, Any] = {}
    old_fd = None
    if threading.current_thread() is threading.main_thread():
        # the Python-level handler has nothing left to do: the relay thread acts
        previous = {s: signal.signal(s, lambda *_: None) for s in stop_signals()}
        old_fd = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
    thread = threading.Thread(target=relay, name="elastic-control", daemon=True)
    thread.start()
    try:
        yield
    except Exception:
        if not found:
            message = ray.get(control.fatal.remote())
            if message:
                found.append(RunError(message))
        if not found:
            raise
    finally:
        done.set()
        thread.join()
        if cordons is not None:
            cordons.release_all()
        if display is not None:  # where the run ended (a short run may end between polls)
            with contextlib.suppress(Exception):
                display.update(ray.get(control.status.remote(), timeout=10)[1], final=True)
        with contextlib.suppress(Exception):  # free it now, not at a garbage collection
            ray.kill(control)
        if old_fd is not None:
            signal.set_wakeup_fd(old_fd)
        for s, h in previous.items():
            signal.signal(s, h)
        wake_r.close()
        wake_w.close()
    if found:
        raise found[0]


ABORT_GRACE_S = 10.0
"""How long an aborted run's Ray Train controller has to end its worker group before
the driver ends the controller (and, with it, the group)."""
TICK_S = 0.25  # how often the relay looks for an answer from the control actor (no call)


def world_sizes(events: list[dict[str, Any]]) -> list[int]:
    sizes: list[int] = []
    for e in events:
        if e["event"] == "world_size" and (not sizes or sizes[-1] != e["world_size"]):
            sizes.append(e["world_size"])
    return sizes


def read_events(run_dir: str) -> list[dict[str, Any]]:
    """Every event rank 0 has recorded for the run (all sessions, all worker groups): the
    run's history file is appended to and flushed per record, so it also holds what
    happened after the last checkpoint of a group that then failed."""
    return [r for r in read_records(run_dir) if "event" in r]


def write_summary(summary: dict[str, Any], output_dir: str) -> str:
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "summary.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(json_text(summary, indent=2))
    os.replace(tmp, path)
    return path
