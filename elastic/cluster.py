"""Connect to Ray: an embedded local cluster by default, or an explicit head address.

Never ``address="auto"``: on a shared node it can attach to somebody else's cluster.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from elastic.config import ClusterConfig, ScalingConfig

# Settings every worker process needs, whatever node it lands on.
WORKER_ENV = {
    # DeepSpeed picks its accelerator at import; without a GPU say so (it warns otherwise)
    "DS_ACCELERATOR": "cpu",
    "TOKENIZERS_PARALLELISM": "false",
    # Ray Train tees print() into its logger too, which doubles every console line
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
}


def local_cpus(cluster: ClusterConfig, scaling: ScalingConfig) -> int:
    """Logical CPUs of the embedded cluster: all of this machine's, and at least enough
    for the widest worker group plus two for Ray Data's read and decode tasks (which
    would otherwise wait forever behind the training workers on a small machine)."""
    if cluster.num_cpus is not None:
        return cluster.num_cpus
    needed = int(scaling.max_workers * scaling.cpus_per_worker + 0.999) + 2
    return max(os.cpu_count() or 1, needed)


@contextmanager
def connect(cluster: ClusterConfig, scaling: ScalingConfig) -> Iterator[str]:
    """Start or join Ray for the duration of the block; yields a description of it."""
    import ray

    if ray.is_initialized():
        # a notebook or test session that already started Ray: use it, leave it running
        yield "the Ray session already running in this process"
        return
    env = dict(WORKER_ENV)
    if scaling.use_gpu:
        env["DS_ACCELERATOR"] = "cuda"
    runtime_env = {"env_vars": env}
    if cluster.address:
        ray.init(address=cluster.address, runtime_env=runtime_env, log_to_driver=True)
        where = f"Ray cluster at {cluster.address}"
    else:
        # Ctrl-C in a terminal signals the whole foreground process group, and the
        # embedded cluster's processes are our children in it: they would die before
        # Ray Train could stop the run gracefully. They inherit an ignored SIGINT.
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
        try:
            ray.init(
                address="local",
                num_cpus=local_cpus(cluster, scaling),
                object_store_memory=cluster.object_store_memory_mb * 1024 * 1024,
                include_dashboard=False,
                runtime_env=runtime_env,
                log_to_driver=True,
            )
        finally:
            if main_thread:
                signal.signal(signal.SIGINT, previous)
        where = "embedded local Ray cluster"
    try:
        fresh_node_view(scaling.node_refresh_s)
        yield where
    finally:
        ray.shutdown()


def fresh_node_view(interval_s: float) -> None:
    """Make Ray Train's elastic policy see node deaths and arrivals within ``interval_s``.

    Ray Train 2.60 sizes an elastic worker group from the resources Ray Data's
    cluster-wide ``AutoscalingCoordinator`` actor reserves, and that actor refreshes its
    view of the nodes every 20 s: a dead node looks alive for up to 20 s (the restart
    asks for it and waits out ``scaling.start_timeout_s``) and a new node is noticed up
    to 20 s late. We create that (detached, named) actor first, with a shorter refresh.
    If it already exists (another job on a long-lived cluster made it), it is left as
    it is."""
    import ray
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as dac

    base = dac._AutoscalingCoordinatorActor
    if not isinstance(getattr(base, "TICK_INTERVAL_S", None), (int, float)):
        return  # Ray moved on: nothing to tune
    fast = type("FastRefreshAutoscalingCoordinator", (base,), {"TICK_INTERVAL_S": interval_s})
    ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(fast).options(
        name="AutoscalingCoordinator",
        namespace="AutoscalingCoordinator",
        get_if_exists=True,
        lifetime="detached",
        scheduling_strategy=dac.NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False
        ),
    ).remote()
