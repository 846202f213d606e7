"""Every private Ray API elastic uses (elastic/cluster/ray_internals.py) still exists in
the installed Ray: an upgrade that moved one fails here, naming it, not mid-run."""

from __future__ import annotations

import importlib

import ray
from ray.train.torch import TorchTrainer

from elastic.cluster import ray_internals


def test_the_private_ray_apis_exist_in_the_installed_ray():
    assert ray.__version__ == ray_internals.RAY_VERSION, (
        f"Ray {ray.__version__}: elastic's private Ray uses were checked against "
        f"{ray_internals.RAY_VERSION}; check each in elastic/cluster/ray_internals.py"
    )
    callback, watcher, switch = ray_internals.preemption_watcher()
    assert hasattr(callback, "after_worker_group_start") and hasattr(callback, "_stop_watcher")
    assert isinstance(watcher, type) and isinstance(switch, str)
    backend, set_env = ray_internals.torch_backend()
    assert hasattr(backend, "on_start") and callable(set_env)
    constants = ray_internals.ray_constants()
    assert isinstance(constants.ENABLE_RAY_CLUSTER, bool)
    assert isinstance(constants.PROCESS_TYPE_RAYLET, str)
    coordinator = ray_internals.autoscaling_coordinator()
    assert isinstance(coordinator._AutoscalingCoordinatorActor.TICK_INTERVAL_S, (int, float))
    ray_internals.reload_auth_token()  # callable outside a session
    policy = ray_internals.elastic_scaling_policy()
    assert callable(getattr(policy, "_count_possible_workers", None))
    for path in ray_internals.IMPORTED:
        module, _, name = path.partition(":")
        assert hasattr(importlib.import_module(module), name), f"{path} is gone"
    for name in ray_internals.TRAINER_PRIVATE_METHODS:
        assert callable(getattr(TorchTrainer, name, None)), f"TorchTrainer.{name} is gone"
