"""Ray Train's TorchTrainer as the driver runs it (:func:`interruptible`): Ctrl-C and a
second stop signal end ``fit()`` cleanly, one node-drain watcher serves the whole fit
(started before any worker reads), no placement-group cleaner polls a State API that
is not there, and no dataset manager is kept for datasets the trainer is not given."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any


def interruptible(trainer_cls: type, control: Any = None) -> type:
    """TorchTrainer whose fit() stops on Ctrl-C with a KeyboardInterrupt.

    Ray Train's own SIGINT handler blocks on the controller's abort inside the signal
    handler and the process then exits 1 without a word. Ours asks the controller to
    abort without waiting and raises KeyboardInterrupt: Ray is shut down on the way out
    (only registered, complete checkpoints exist) and the entry point says so, exit 130.
    A run aborted on a second stop signal raises :class:`~elastic.cluster.connect.Stopped`
    instead (exit 75: a batch script requeues it).

    With the run's ``control`` actor, an elastic group is sized without the nodes kept
    out of the run (:mod:`elastic.cluster.cordon`): Ray Train's elastic policy counts
    every live node's resources, also those a cordon holds, and would wait for a group
    that cannot be placed.

    Ray Train's own drain watcher is turned off from here on (in this process's
    environment, which its controller and workers inherit): the trainer brings its own."""
    from elastic.cluster import ray_internals

    ray_internals.turn_off_train_drain_watcher()

    class Trainer(trainer_cls):
        interrupted: BaseException | None = None  # what fit() raises once aborted
        controller: Any = None
        drain_watcher: Any = None  # its actor lives as long as fit()
        previous_sigint: Any = None

        def _register_sigint_handler(self, controller: Any) -> None:
            Trainer.controller = controller

            def handler(signum: int, frame: Any) -> None:
                Trainer.interrupted = KeyboardInterrupt()
                controller.abort.remote()
                raise KeyboardInterrupt

            Trainer.previous_sigint = signal.signal(signal.SIGINT, handler)

        def _create_default_callbacks(self) -> list[Any]:
            Trainer.drain_watcher = _drain_watcher(control)
            callbacks = [*super()._create_default_callbacks(), Trainer.drain_watcher]
            if control is not None:
                callbacks.append(_controller_watch(control))
            unused = set()
            if not self.datasets:
                # Ray Train starts a DatasetManager actor for every worker group, also
                # with no datasets to hand out (elastic's workers stream their own):
                # an idle Ray process for the whole run (~1% of a core). The callback
                # also copies the driver's Ray Data context to the workers; elastic's
                # set their own (elastic.data.reader).
                unused.add(ray_internals.DATASETS_CALLBACK)
            if not _has_dashboard():
                # Ray Train's PlacementGroupCleaner asks the State API, i.e. the
                # dashboard, whether the controller still lives; without one it cannot
                # tell and logs a warning every couple of seconds for the whole run (83
                # in a smoke run). Without a dashboard it could never act anyway.
                unused.add(ray_internals.PG_CLEANER_CALLBACK)
            names = {path.rpartition(":")[2] for path in unused}
            return [c for c in callbacks if type(c).__name__ not in names]

        def _initialize_and_run_controller(self, **kwargs: Any) -> Any:
            if control is not None and self.scaling_config.elasticity_enabled:
                kwargs["scaling_policy"] = _cordon_aware_policy(self.scaling_config, control)
            return super()._initialize_and_run_controller(**kwargs)

        def fit(self) -> Any:
            import ray

            try:
                result = super().fit()
            except Exception:
                if Trainer.interrupted is not None:
                    raise Trainer.interrupted from None
                raise
            finally:
                # The controller actor (~400 MB) would otherwise live as long as this
                # class, i.e. until a garbage collection: a process that trains more
                # than once (a notebook, the tests) ran out of memory on them.
                if Trainer.controller is not None:
                    with contextlib.suppress(Exception):  # Ray itself may be gone
                        ray.kill(Trainer.controller)
                    Trainer.controller = None
                with contextlib.suppress(Exception):  # a group's start cut off by an abort
                    ray_internals.remove_job_placement_groups()
                if Trainer.drain_watcher is not None:
                    Trainer.drain_watcher.close()
                    Trainer.drain_watcher = None
                if Trainer.previous_sigint is not None:
                    signal.signal(signal.SIGINT, Trainer.previous_sigint)
            if Trainer.interrupted is not None:
                raise Trainer.interrupted
            return result

    return Trainer


class DrainWatching:
    """An actor that watches node drains for a fit's worker groups: Ray Train's watcher
    (its poll loop, its drain handling) as a plain object in the actor's process, made
    at the first :meth:`watch`. The run's control actor is one
    (:class:`~elastic.train.control.RunControl`), so a run has no watcher process of its
    own: each idle Ray process takes ~1% of a core (its main thread checks signals
    every 10 ms), out of the training's on a node with few cores."""

    _drains: Any = None

    def watch(
        self, node_to_ranks: dict[str, list[int]], by_rank: dict[int, Any], poll_interval_s: float
    ) -> None:
        """Watch these nodes for drains, and tell these workers (a new watcher's state,
        as Ray Train's gives each group); none between groups."""
        if self._drains is None:
            self._drains = _drain_watcher_class()(poll_interval_s)
        self._drains.watch(node_to_ranks, by_rank)


def _drain_watcher_class() -> type:
    """Ray Train's drain watcher, re-aimed by ``watch`` at each worker group (Ray's keeps
    one group's for its life)."""
    from elastic.cluster import ray_internals

    _, PreemptionWatcher, _ = ray_internals.preemption_watcher()

    class RunDrainWatcher(PreemptionWatcher):  # type: ignore[valid-type,misc]
        def __init__(self, poll_interval_s: float) -> None:
            self._aim = threading.Lock()  # before the poll thread starts
            super().__init__(node_to_ranks={}, poll_interval_s=poll_interval_s)

        def watch(self, node_to_ranks: dict[str, list[int]], by_rank: dict[int, Any]) -> None:
            with self._aim:
                self._node_to_ranks = {n: sorted(r) for n, r in node_to_ranks.items()}
                self._failure_domain_map = self._build_failure_domain_map(self._node_to_ranks)
                self._worker_actors_by_rank = dict(by_rank)
                self._last_drained: dict[str, int] = {}
                self._latest_info = None

        def _poll_once(self) -> None:
            with self._aim:
                super()._poll_once()

    return RunDrainWatcher


def _drain_watcher(control: Any = None) -> Any:
    """Ray Train's node-drain watcher callback with one watcher for the whole fit,
    running from the fit's start in an actor on the driver's node (the run's ``control``
    actor, :class:`DrainWatching`; without one, an actor of its own), pointed at each
    worker group as it starts.

    Ray Train's own starts a new watcher actor after every worker group's start, i.e. a
    new Ray worker process while the group reads its first epoch (~2.5 s of a core
    here: on 2 cores the first epoch's reads took twice as long), and makes it with
    max_restarts=-1 and the workers' handles as constructor arguments, which makes Ray
    Core print an "E" line at every start (ray-project/ray#53727). This one's actor
    starts before any worker reads, and it has no restarts: on the driver's node it
    goes only with the driver. (Pinned hard: with a soft pin the head's raylet at times
    passed the lease on to a worker node, and the first drained node took the watcher
    with it: no later drain was seen.) Between groups it watches no node. Ray Train's
    is turned off (:func:`interruptible`) and this one is passed as a callback;
    :meth:`close` stops it (and ends an actor of its own)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from elastic.cluster import ray_internals

    PreemptionCallback, _, _ = ray_internals.preemption_watcher()

    class RunDrainCallback(PreemptionCallback):  # type: ignore[valid-type,misc]
        def __init__(self) -> None:
            super().__init__()
            self.own = control is None
            self.watcher: Any = control
            if control is None:
                node = ray.get_runtime_context().get_node_id()
                here = NodeAffinitySchedulingStrategy(node, soft=False)
                options = {"num_cpus": 0, "max_restarts": 0, "scheduling_strategy": here}
                self.watcher = ray.remote(DrainWatching).options(**options).remote()

        def after_worker_group_start(self, worker_group: Any) -> None:
            node_to_ranks: dict[str, list[int]] = {}
            by_rank = {}
            for w in worker_group.get_workers():
                rank = w.distributed_context.world_rank
                node_to_ranks.setdefault(w.metadata.node_id, []).append(rank)
                by_rank[rank] = w.actor
            self.watcher.watch.remote(node_to_ranks, by_rank, self._poll_interval_s)

        def _stop_watcher(self) -> None:  # the group is ending: watch nothing until the next
            self.watcher.watch.remote({}, {}, self._poll_interval_s)

        def close(self) -> None:
            with contextlib.suppress(Exception):  # Ray itself may be gone
                if self.own:
                    ray.kill(self.watcher)
                else:
                    self._stop_watcher()

    return RunDrainCallback()


def _controller_watch(control: Any) -> Any:
    """A controller callback (it runs in Ray Train's controller actor) that tells the
    run's ``control`` actor each change of the controller's state that matters to the
    driver: whether a worker group is up, and whether one is being started. The driver
    ends a stop or a start that cannot succeed from it (``driver._run_control``)."""
    from elastic.cluster import ray_internals

    base, up_states, starting_states = ray_internals.controller_callback()

    class ControllerWatch(base):  # type: ignore[valid-type,misc]
        def __init__(self) -> None:
            self.told: tuple[bool, bool] | None = None

        def after_controller_start(self, train_run_context: Any) -> None:
            import ray

            control.controller_started.remote(ray.get_runtime_context().current_actor)

        def after_controller_state_update(self, previous_state: Any, current_state: Any) -> None:
            name = type(current_state).__name__
            now = (name in up_states, name in starting_states)
            if now != self.told:
                self.told = now
                control.controller_state.remote(*now)

    return ControllerWatch()


def _cordon_aware_policy(scaling_config: Any, control: Any) -> Any:
    """Ray Train's elastic scaling policy, leaving out the nodes ``control`` says are
    cordoned when it counts the workers a group can have (it runs in the controller)."""
    import ray

    from elastic.cluster import ray_internals

    class CordonAwareScalingPolicy(ray_internals.elastic_scaling_policy()):  # type: ignore[misc]
        def _count_possible_workers(self, reserved_resources: Any) -> int:
            try:
                held = set(ray.get(control.cordoned_nodes.remote(), timeout=5))
            except Exception:  # the run is ending: nothing to leave out
                held = set()
            free = {n: r for n, r in reserved_resources.items() if n not in held}
            return int(super()._count_possible_workers(free))

    return CordonAwareScalingPolicy(scaling_config)


def _has_dashboard() -> bool:
    """Whether the connected Ray cluster runs a dashboard (and so the State API)."""
    from elastic.cluster import ray_internals

    try:
        return bool(ray_internals.dashboard_url())
    except Exception:  # unknown (Ray internals moved): keep Ray's defaults
        return True
