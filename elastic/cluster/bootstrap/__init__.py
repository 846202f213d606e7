"""Ray inside a batch allocation: ``python -m elastic.cluster.bootstrap ROLE ...``.

The job scripts (``launch/slurm/*.sbatch``, ``launch/lsf/*.bsub``) only allocate and
call this; training knobs never live in shell. Its roles (``train``, ``head``, ``node``,
``join``) are described in :mod:`.roles` and by ``--help``.

Every node's Ray gets per-job ports (a claimed block, so two jobs on the same nodes
never collide), a short node-local temp dir, token authentication with the job's token
(a node without it is refused), fast node-death detection, and no dashboard unless
asked for (then bound to localhost).

The parts: :mod:`.schedulers` (Slurm, LSF: one class each), :mod:`.jobdir` (the job's
shared directory and token), :mod:`.ports` (per-job port blocks), :mod:`.node` (one
node's Ray and its teardown), :mod:`.roles` (the four roles and the command line).
"""

from __future__ import annotations

from elastic.cluster.bootstrap.common import PREEMPTED, REPO, BootstrapError, log, short_host
from elastic.cluster.bootstrap.jobdir import (
    JobDir,
    JobSettings,
    default_jobs_dir,
    job_dir_for,
    write_json,
    write_token,
)
from elastic.cluster.bootstrap.node import (
    HEALTH_ENV,
    LOG_MONITOR_ENV,
    TAG_ENV,
    WORKER_POOL,
    RayNode,
    become_subreaper,
    node_cpus,
    node_ip,
    ours,
    quiet_log_monitor,
    ray_env,
    ray_env_value,
    ray_start_cmd,
    stop_processes,
    temp_dir,
)
from elastic.cluster.bootstrap.ports import (
    LOCK_DIR,
    PORT_BASE,
    PORT_BLOCK,
    PORT_NAMES,
    PORT_TOP,
    WORKER_PORTS,
    claim_ports,
    port_free,
)
from elastic.cluster.bootstrap.roles import (
    Signals,
    driver_cmd,
    main,
    run_head,
    run_join,
    run_node,
    run_train,
    wait_for,
)
from elastic.cluster.bootstrap.schedulers import (
    SCHEDULERS,
    Allocation,
    Lsf,
    Scheduler,
    Slurm,
    allocation,
    detect_scheduler,
    launcher,
    requeue_cmd,
)

__all__ = [
    "HEALTH_ENV", "LOCK_DIR", "LOG_MONITOR_ENV", "PORT_BASE", "PORT_BLOCK", "PORT_NAMES",
    "PORT_TOP", "PREEMPTED", "REPO", "SCHEDULERS", "TAG_ENV", "WORKER_POOL", "WORKER_PORTS",
    "Allocation", "BootstrapError", "JobDir", "JobSettings", "Lsf", "RayNode", "Scheduler",
    "Signals", "Slurm", "allocation", "become_subreaper", "claim_ports", "default_jobs_dir",
    "detect_scheduler", "driver_cmd", "job_dir_for", "launcher", "log", "main", "node_cpus",
    "node_ip", "ours", "port_free", "quiet_log_monitor", "ray_env", "ray_env_value",
    "ray_start_cmd", "requeue_cmd", "run_head", "run_join", "run_node", "run_train",
    "short_host", "stop_processes", "temp_dir", "wait_for", "write_json", "write_token",
]  # fmt: skip
