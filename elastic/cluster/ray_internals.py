"""Every private Ray API elastic uses, in one place, checked against Ray 2.60.0.

Ray offers no public way to do these; each is named here with what it is for, and
``tests/test_ray_internals.py`` fails on a Ray whose internals moved (upgrade Ray: run it,
then fix what it names). Imports are lazy: importing this module does not import Ray.
"""

from __future__ import annotations

import os
import types
from typing import Any

RAY_VERSION = "2.60.0"
"""The Ray release these were checked against (pyproject pins it)."""

DATASETS_CALLBACK = "ray.train.v2._internal.callbacks:DatasetsCallback"
PG_CLEANER_CALLBACK = (
    "ray.train.v2._internal.callbacks.placement_group_callback:PlacementGroupCleanerCallback"
)
"""Ray Train default callbacks elastic's trainer can leave out (elastic.train.trainer
tells them by class name): the dataset manager's, the placement-group cleaner."""

IMPORTED = (
    "ray.train.v2._internal.callbacks.preemption_callback:PreemptionCallback",
    "ray.train.v2._internal.callbacks.preemption_callback:PreemptionWatcher",
    "ray.train.v2._internal.constants:ENABLE_PREEMPTION_WATCHER_ENV_VAR",
    "ray._private.worker:get_dashboard_url",
    "ray.train.v2._internal.execution.context:get_train_context",
    "ray.train.torch.config:_set_torch_distributed_env_vars",
    "ray.train.torch.config:_setup_torch_process_group",
    "ray.train.torch.config:_shutdown_torch",
    "ray.train.torch.config:TorchConfigContextManager",
    "ray.train._internal.utils:get_address_and_port",
    "ray.train.v2._internal.util:TrainingFramework",
    "ray.train.constants:TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S",
    "ray.train.constants:DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S",
    "ray._private.ray_constants:env_integer",
    "ray._private.ray_constants:ENABLE_RAY_CLUSTER",
    "ray._private.ray_constants:PROCESS_TYPE_RAYLET",
    "ray._private.ray_constants:SETUP_WORKER_FILENAME",
    "ray._raylet:AuthenticationTokenLoader",
    "ray._raylet:Config",
    "ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator:_AutoscalingCoordinatorActor",
    "ray.train.v2._internal.execution.scaling_policy:ElasticScalingPolicy",
    "ray.train.v2._internal.constants:get_env_vars_to_propagate",
    "ray.train.v2._internal.constants:DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE",
    "ray._common.constants:RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR",
    "ray.train.v2._internal.execution.callback:ControllerCallback",
    "ray.util.placement_group:PlacementGroup",
    "ray.train.v2._internal.execution.controller.state:RunningState",
    "ray.train.v2._internal.execution.controller.state:ResizingState",
    "ray.train.v2._internal.execution.controller.state:PreemptingState",
    "ray.train.v2._internal.execution.controller.state:InitializingState",
    "ray.train.v2._internal.execution.controller.state:SchedulingState",
    "ray.train.v2._internal.execution.controller.state:RestartingState",
    "ray.train.v2._internal.execution.controller.state:ReschedulingState",
    DATASETS_CALLBACK,
    PG_CLEANER_CALLBACK,
)
"""Every private name the functions below import (the test resolves each)."""

TRAINER_PRIVATE_METHODS = (
    "_register_sigint_handler",
    "_create_default_callbacks",
    "_initialize_and_run_controller",
)
"""TorchTrainer methods elastic overrides (elastic.train.trainer): its SIGINT handler
(Ray's blocks and exits 1 without a word), its default callbacks (the placement-group
cleaner that needs a dashboard; the dataset manager's without datasets; the node-drain
watcher) and the controller's start, whose
``scaling_policy`` argument elastic replaces (:func:`elastic_scaling_policy`)."""


def preemption_watcher() -> tuple[type, type, str]:
    """Ray Train's node-drain callback, its watcher actor class, and the environment
    variable that turns Ray's own off (elastic adds one whose actor does not restart)."""
    from ray.train.v2._internal.callbacks.preemption_callback import (
        PreemptionCallback,
        PreemptionWatcher,
    )
    from ray.train.v2._internal.constants import ENABLE_PREEMPTION_WATCHER_ENV_VAR

    return PreemptionCallback, PreemptionWatcher, ENABLE_PREEMPTION_WATCHER_ENV_VAR


def controller_callback() -> tuple[type, tuple[str, ...], tuple[str, ...]]:
    """Ray Train's controller callback base (a ``ControllerCallback`` passed among the
    trainer's default callbacks runs in the controller actor; its
    ``after_controller_state_update(previous, current)`` hears every state change); the
    names of the states in which a worker group is up (training, being resized, or
    waiting out a node drain's grace period), and of those in which one is being
    started (the first time, or again after a failure)."""
    from ray.train.v2._internal.execution.callback import ControllerCallback
    from ray.train.v2._internal.execution.controller import state

    up = (state.RunningState, state.ResizingState, state.PreemptingState)
    starting = (
        state.InitializingState,
        state.SchedulingState,
        state.RestartingState,
        state.ReschedulingState,
    )
    return ControllerCallback, tuple(c.__name__ for c in up), tuple(c.__name__ for c in starting)


def remove_job_placement_groups() -> int:
    """Remove every placement group of this driver's job that is still pending or
    created; returns how many. Ray Train's controller, ended while a worker group's start
    waited for resources, can leave its group's placement group pending, and it then
    takes the resources when they come free (another run's, on a shared cluster). A
    placement group's id ends with its job's id."""
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group_table

    job = ray.get_runtime_context().get_job_id()
    removed = 0
    for pg_id, info in placement_group_table().items():
        if pg_id.endswith(job) and info.get("state") in ("PENDING", "CREATED", "RESCHEDULING"):
            ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))
            removed += 1
    return removed


def turn_off_train_drain_watcher() -> None:
    """Turn Ray Train's own node-drain watcher off in this process's environment, which
    Ray Train passes on to its controller and workers (elastic's trainer brings its own
    watcher: :func:`elastic.train.trainer.interruptible`). The variable is part of the
    workers' runtime env, so it is set before that env is read
    (:func:`train_worker_env_vars`), whichever comes first."""
    _, _, off_switch = preemption_watcher()
    os.environ[off_switch] = "0"


def dashboard_url() -> str | None:
    """The connected cluster's dashboard address (None without one)."""
    from ray._private.worker import get_dashboard_url

    return get_dashboard_url() or None


def worker_preemption_context() -> Any:
    """This Ray Train worker's preemption (node drain) context: read without Ray Train's
    barrier (``ray.train.get_preemption_info`` waits for every rank)."""
    from ray.train.v2._internal.execution.context import get_train_context

    return get_train_context().preemption_context


def torch_worker() -> Any:
    """Ray Train's worker side of its torch set-up, called on the workers by
    ``elastic.cluster.rendezvous`` (which imports no torch where Ray Train's controller
    runs): ``set_env()`` (LOCAL_RANK & co.), ``setup(backend, rank, world_size,
    init_method, timeout_s)`` (init_process_group, with Ray Train's NCCL settings),
    ``shutdown(destroy)``, ``context`` (around the training function: the CUDA device)."""
    from ray.train.torch import config

    return types.SimpleNamespace(
        set_env=config._set_torch_distributed_env_vars,
        setup=lambda backend, rank, world_size, init_method, timeout_s: (
            config._setup_torch_process_group(
                backend=backend,
                world_rank=rank,
                world_size=world_size,
                init_method=init_method,
                timeout_s=timeout_s,
            )
        ),
        shutdown=lambda destroy: config._shutdown_torch(destroy_process_group=destroy),
        context=config.TorchConfigContextManager,
    )


def address_and_port() -> Any:
    """Ray Train's function that finds a worker's address and a free port (run on rank 0:
    the process group's rendezvous)."""
    from ray.train._internal.utils import get_address_and_port

    return get_address_and_port


def torch_framework() -> Any:
    """Ray Train's tag for a torch run (its state export and version records)."""
    from ray.train.v2._internal.util import TrainingFramework

    return TrainingFramework.TORCH


def process_group_shutdown_timeout_s() -> int:
    """How long Ray Train waits for the workers to leave the process group."""
    from ray._private.ray_constants import env_integer
    from ray.train import constants

    name = constants.TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
    return int(env_integer(name, constants.DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S))


def ray_constants() -> Any:
    """``ENABLE_RAY_CLUSTER`` (off: Ray keeps a loopback node address) and
    ``PROCESS_TYPE_RAYLET`` (a test cluster's raylet pid)."""
    from ray._private import ray_constants as constants

    return constants


def fast_worker_start() -> bool:
    """Have the Ray nodes this process starts (``ray.init`` of an embedded cluster,
    ``ray start``, ``ray.cluster_utils.Cluster``; Ray's client server too) start their
    Python workers through
    :mod:`elastic.cluster.worker_exec` instead of Ray's ``setup_worker.py`` (which
    imports Ray, a second of CPU a worker process, before the worker imports it again).

    Ray builds the workers' command from ``os.path.join(<ray>/_private/workers,
    SETUP_WORKER_FILENAME)`` when it starts a node (``ray._private.node.Node``), so an
    absolute path there is the script it runs. False (and nothing changed) where that
    name is gone."""
    from pathlib import Path

    constants = ray_constants()
    if not isinstance(getattr(constants, "SETUP_WORKER_FILENAME", None), str):
        return False
    constants.SETUP_WORKER_FILENAME = str(Path(__file__).resolve().with_name("worker_exec.py"))
    return True


def reload_auth_token() -> None:
    """Ray caches its auth mode and token per process: make it read the environment."""
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def autoscaling_coordinator() -> Any:
    """Ray Data's autoscaling coordinator module: Ray Train 2.60 sizes elastic groups from
    its actor, whose node view refreshes every ``TICK_INTERVAL_S``."""
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator

    return default_autoscaling_coordinator


def elastic_scaling_policy() -> type:
    """Ray Train's elastic scaling policy: it sizes a worker group from each node's
    resources as Ray Data's autoscaling coordinator sees them, i.e. the nodes' totals,
    blind to what other actors hold. elastic subclasses it to leave out cordoned nodes
    (:mod:`elastic.cluster.cordon`), overriding ``_count_possible_workers(reserved)``
    (``{node_id: resources}`` -> workers)."""
    from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy

    return ElasticScalingPolicy


def train_worker_env_vars() -> dict[str, str]:
    """The environment variables Ray Train 2.60 adds to the job's for its controller and,
    through it, its workers (``TorchTrainer._initialize_and_run_controller``): the
    tasks a worker submits (Ray Data's reads) run in worker processes of that runtime
    env, and Ray reuses a process only for tasks of the same one. A task given
    ``runtime_env={"env_vars": these}`` from the driver runs in such a process
    (:func:`elastic.data.pipeline.warm_up`). With Ray Train's drain watcher off, as
    elastic's trainer has it (the variable is one of those passed on)."""
    from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
    from ray.train.v2._internal.constants import (
        DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
        get_env_vars_to_propagate,
    )

    turn_off_train_drain_watcher()
    env: dict[str, str] = get_env_vars_to_propagate()
    env.setdefault(
        RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR, DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE
    )
    return env
