"""Every private Ray API elastic uses (elastic/cluster/ray_internals.py) still exists in
the installed Ray: an upgrade that moved one fails here, naming it, not mid-run."""

from __future__ import annotations

import importlib
import os
from typing import Any

import pytest
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
    worker = ray_internals.torch_worker()
    assert callable(worker.set_env) and callable(worker.setup) and callable(worker.shutdown)
    assert hasattr(worker.context, "__enter__") and callable(ray_internals.address_and_port())
    assert ray_internals.torch_framework().value == "torch"
    assert ray_internals.process_group_shutdown_timeout_s() > 0
    constants = ray_internals.ray_constants()
    assert isinstance(constants.ENABLE_RAY_CLUSTER, bool)
    assert isinstance(constants.PROCESS_TYPE_RAYLET, str)
    coordinator = ray_internals.autoscaling_coordinator()
    assert isinstance(coordinator._AutoscalingCoordinatorActor.TICK_INTERVAL_S, (int, float))
    ray_internals.reload_auth_token()  # callable outside a session
    base, up, starting = ray_internals.controller_callback()
    assert callable(getattr(base, "after_controller_state_update", None))
    assert len(up) == 3 and len(starting) == 4
    policy = ray_internals.elastic_scaling_policy()
    assert callable(getattr(policy, "_count_possible_workers", None))
    for path in ray_internals.IMPORTED:
        module, _, name = path.partition(":")
        assert hasattr(importlib.import_module(module), name), f"{path} is gone"
    for name in ray_internals.TRAINER_PRIVATE_METHODS:
        assert callable(getattr(TorchTrainer, name, None)), f"TorchTrainer.{name} is gone"


@pytest.mark.slow
def test_the_trainer_keeps_no_dataset_manager_process_for_datasets_it_has_none_of(
    ray_session, tmp_path
):
    """Ray Train starts a DatasetManager actor for every worker group, also a trainer's
    with no datasets (elastic's workers stream their own): an idle Ray process for the
    whole run, ~1% of a core on a node whose cores train. elastic's trainer starts none
    without datasets, and one when given some (so the check can tell)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    from elastic.train.trainer import interruptible

    test = os.getpid()  # the session cluster's processes are its descendants

    def alive() -> set[int]:
        """The pids of the session cluster's Ray Train dataset managers alive now (not
        the machine's: another Ray cluster may run beside the suite)."""
        import psutil

        found = set()
        for p in psutil.Process(test).children(recursive=True):
            try:
                if (p.cmdline() or [""])[0].startswith("ray::DatasetManager"):
                    found.add(p.pid)
            except psutil.Error:
                continue
        return found

    def dataset_managers(config: dict) -> None:
        """Rank 0 writes :func:`alive` while its worker group runs."""
        import ray.train

        if ray.train.get_context().get_world_rank() == 0:
            with open(config["out"], "w") as f:
                f.write(" ".join(map(str, alive())))

    def managers(name: str, **datasets: Any) -> set[int]:
        out = tmp_path / name
        interruptible(TorchTrainer)(
            dataset_managers,
            datasets=datasets,
            train_loop_config={"out": str(out)},
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name=name, storage_path=str(tmp_path / "ray")),
            torch_config=TorchConfig(backend="gloo"),
        ).fit()
        return {int(p) for p in out.read_text().split()}

    before = alive()
    assert managers("none") - before == set()
    assert managers("given", rows=ray.data.range(8)) - before, "none with datasets given"


@pytest.mark.slow
def test_a_placement_group_left_pending_by_an_ended_controller_is_removed(ray_session):
    """Ray Train's controller, ended while its group's start waited for resources, left
    the group's placement group pending: it took the resources once they came free."""
    from ray.util.placement_group import placement_group, placement_group_table

    pending = placement_group([{"CPU": 64}])  # no node has them: it waits
    assert placement_group_table(pending)["state"] == "PENDING"
    assert ray_internals.remove_job_placement_groups() >= 1
    assert placement_group_table(pending)["state"] == "REMOVED"


def test_ray_starts_the_workers_through_elastics_script_with_their_environment(ray_session):
    """The session cluster (started as elastic starts its own) starts a task's worker
    process through elastic/cluster/worker_exec.py, with the task's runtime env: its
    variables set as Ray sets them (``${X}`` expanded, an unset one removed)."""
    assert "worker_exec.py" in ray_internals.ray_constants().SETUP_WORKER_FILENAME
    env = {"A": "${HOME}/a", "B": "${ELASTIC_TEST_UNSET_VARIABLE}b"}

    @ray.remote(num_cpus=0, runtime_env={"env_vars": env})
    def environment() -> tuple:
        import os

        return tuple(os.environ.get(k) for k in ("A", "B", "ELASTIC_WORKER_EXEC"))

    home = os.environ["HOME"]
    assert ray.get(environment.remote()) == (f"{home}/a", "b", "1")


@pytest.mark.parametrize(
    "prefix, python",
    [
        ([], "{python}"),
        (["export", "C=3", "&&"], "{python}"),
        ([], "env C=3 {python}"),
        ([], "{name}"),
    ],
    ids=["plain", "a command prefix", "a command as the python", "a name on PATH"],
)
def test_a_worker_start_elastic_does_not_know_goes_to_rays_own_script(tmp_path, prefix, python):
    """A runtime env with more than variables (a command prefix, as a container or a
    conda env gives; a command line as the Python, as uv gives; a Python named for bash
    to find on PATH) is started by Ray's setup_worker.py, unchanged; a plain one by
    elastic's script, in the same interpreter, with the same arguments."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from elastic.cluster import worker_exec

    py = python.format(python=sys.executable, name=Path(sys.executable).name)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    context = {"command_prefix": prefix, "env_vars": {"A": "1"}, "py_executable": py}
    variables = "os.environ.get('A'), os.environ.get('C'), os.environ.get('ELASTIC_WORKER_EXEC')"
    code = f"import os, sys; print({variables}, sys.argv[1:])"
    out = subprocess.run(
        [
            sys.executable,
            str(Path(worker_exec.__file__)),
            "-c",
            code,
            f"--serialized-runtime-env-context={json.dumps(context)}",
            "--language=PYTHON",
            "--an-argument=x y",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    ours = not prefix and py == sys.executable
    c = "3" if "C=3" in " ".join([*prefix, py]) else "None"
    assert out.stdout.strip() == f"1 {c} {'1' if ours else 'None'} ['--an-argument=x y']", (
        out.stdout
    )
