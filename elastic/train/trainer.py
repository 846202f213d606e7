"""Ray Train's TorchTrainer as the driver runs it (:func:`interruptible`): Ctrl-C and a
second stop signal end ``fit()`` cleanly, the node-drain watcher has no restarts, and
no placement-group cleaner polls a State API that is not there."""

from __future__ import annotations

import contextlib
import os
import signal
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
    that cannot be placed."""

    class Trainer(trainer_cls):
        interrupted: BaseException | None = None  # what fit() raises once aborted
        controller: Any = None
        previous_sigint: Any = None

        def _register_sigint_handler(self, controller: Any) -> None:
            Trainer.controller = controller

            def handler(signum: int, frame: Any) -> None:
                Trainer.interrupted = KeyboardInterrupt()
                controller.abort.remote()
                raise KeyboardInterrupt

            Trainer.previous_sigint = signal.signal(signal.SIGINT, handler)

        def _create_default_callbacks(self) -> list[Any]:
            callbacks = [*super()._create_default_callbacks(), _drain_watcher()]
            if _has_dashboard():
                return callbacks
            # Ray Train's PlacementGroupCleaner asks the State API, i.e. the dashboard,
            # whether the controller still lives; without one it cannot tell and logs
            # a warning every couple of seconds for the whole run (83 in a smoke run).
            # Without a dashboard it could never act anyway.
            return [c for c in callbacks if type(c).__name__ != "PlacementGroupCleanerCallback"]

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
                if Trainer.previous_sigint is not None:
                    signal.signal(signal.SIGINT, Trainer.previous_sigint)
            if Trainer.interrupted is not None:
                raise Trainer.interrupted
            return result

    return Trainer


def _drain_watcher() -> Any:
    """Ray Train's node-drain watcher callback, whose watcher actor has no restarts.

    Ray Train's own makes one watcher actor per worker group with max_restarts=-1 and the
    workers' actor handles as constructor arguments, which makes Ray Core print an "E"
    line at every start (ray-project/ray#53727: such arguments may be gone by a restart).
    A restart would buy nothing here: a watcher dies with its node, which ends the worker
    group, and the next group gets a new watcher. Ray Train's is turned off (the flag
    reaches its controller, which adds it) and this one is passed as a callback."""
    import ray

    from elastic.cluster import ray_internals

    PreemptionCallback, PreemptionWatcher, off_switch = ray_internals.preemption_watcher()
    os.environ[off_switch] = "0"

    class NoRestartPreemptionCallback(PreemptionCallback):  # type: ignore[valid-type,misc]
        def after_worker_group_start(self, worker_group: Any) -> None:
            self._stop_watcher()
            node_to_ranks: dict[str, list[int]] = {}
            by_rank = {}
            for w in worker_group.get_workers():
                rank = w.distributed_context.world_rank
                node_to_ranks.setdefault(w.metadata.node_id, []).append(rank)
                by_rank[rank] = w.actor
            watcher: Any = ray.remote(num_cpus=0, max_restarts=0)(PreemptionWatcher)
            self._watcher = watcher.remote(
                node_to_ranks=node_to_ranks,
                poll_interval_s=self._poll_interval_s,
                worker_actors_by_rank=by_rank,
            )

    return NoRestartPreemptionCallback()


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
