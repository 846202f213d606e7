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
        yield where
    finally:
        ray.shutdown()
