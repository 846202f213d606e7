"""The batch systems, one class each: how a job's allocation is read from its
environment, how one task a node is started on its nodes, how a job is requeued, and
where the Ray head runs."""

from __future__ import annotations

import os
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from elastic.cluster.bootstrap.common import BootstrapError


@dataclass
class Allocation:
    scheduler: str  # slurm | lsf
    job_id: str
    nodes: list[str]  # compute nodes, the head's first (LSF: launch node skipped)
    submit_dir: str
    restart: int = 0  # Slurm requeue count / LSF rerun: a new incarnation of the job


class Scheduler:
    name: ClassVar[str]
    job_variable: ClassVar[str]
    """The variable that is set inside one of its jobs (the job id)."""
    head_on_batch_host: ClassVar[bool]
    """The batch script runs on the allocation's first compute node, so the head runs in
    the batch script's process; else the batch script runs on a launch node and starts
    the head on the first compute node."""

    def nodes(self, env: dict[str, str]) -> list[str]:
        """The allocation's compute nodes, in order (the head's first)."""
        raise NotImplementedError

    def allocation(self, env: dict[str, str]) -> Allocation:
        raise NotImplementedError

    def launcher(self, count: int, cmd: list[str], first: int = 0) -> list[str]:
        """``cmd`` as one task a node on ``count`` nodes of the allocation, from node
        index ``first``."""
        raise NotImplementedError

    def requeue_cmd(self, job_id: str) -> list[str]:
        raise NotImplementedError


class Slurm(Scheduler):
    name, job_variable, head_on_batch_host = "slurm", "SLURM_JOB_ID", True

    def nodes(self, env: dict[str, str]) -> list[str]:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise BootstrapError("SLURM_JOB_NODELIST is not set: run inside a Slurm allocation")
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True
        )
        if out.returncode != 0:
            raise BootstrapError(f"scontrol show hostnames {nodelist} failed: {out.stderr.strip()}")
        return out.stdout.split()

    def allocation(self, env: dict[str, str]) -> Allocation:
        return Allocation(
            "slurm",
            env["SLURM_JOB_ID"],
            self.nodes(env),
            env.get("SLURM_SUBMIT_DIR") or os.getcwd(),
            int(env.get("SLURM_RESTART_COUNT") or 0),
        )

    def launcher(self, count: int, cmd: list[str], first: int = 0) -> list[str]:
        return [
            "srun", f"--nodes={count}", f"--ntasks={count}", "--ntasks-per-node=1",
            f"--relative={first}", "--no-kill", "--kill-on-bad-exit=0", "--overlap", *cmd,
        ]  # fmt: skip

    def requeue_cmd(self, job_id: str) -> list[str]:
        return ["scontrol", "requeue", job_id]


class Lsf(Scheduler):
    name, job_variable, head_on_batch_host = "lsf", "LSB_JOBID", False

    def nodes(self, env: dict[str, str]) -> list[str]:
        """Compute nodes of an LSF job, in order, without the launch node the batch
        script runs on (Summit: ``batchN``, listed first with one slot, the compute nodes
        with 42)."""
        hostfile = env.get("LSB_DJOB_HOSTFILE")
        if hostfile and Path(hostfile).is_file():
            slots = Counter(h for h in Path(hostfile).read_text().split() if h)
        elif env.get("LSB_MCPU_HOSTS"):
            words = env["LSB_MCPU_HOSTS"].split()  # "host slots host slots ..."
            slots = Counter({h: int(n) for h, n in zip(words[::2], words[1::2], strict=False)})
        else:
            raise BootstrapError(
                "neither LSB_DJOB_HOSTFILE nor LSB_MCPU_HOSTS is set: run inside an LSF job"
            )
        hosts = list(slots)  # first-seen order
        if len(hosts) > 1 and slots[hosts[0]] < min(slots[h] for h in hosts[1:]):
            hosts = hosts[1:]  # the launch node runs the batch script, not Ray
        return hosts

    def allocation(self, env: dict[str, str]) -> Allocation:
        return Allocation(
            "lsf",
            env["LSB_JOBID"],
            self.nodes(env),
            env.get("LS_SUBCWD") or os.getcwd(),
            int(env.get("LSB_RESTART") == "Y"),
        )

    def launcher(self, count: int, cmd: list[str], first: int = 0) -> list[str]:
        """LSF places resource sets on free whole nodes (``first`` is not needed)."""
        return [
            "jsrun", f"--nrs={count}", "--rs_per_host=1", "--tasks_per_rs=1",
            "--cpu_per_rs=ALL_CPUS", "--gpu_per_rs=ALL_GPUS", "--bind=none", *cmd,
        ]  # fmt: skip

    def requeue_cmd(self, job_id: str) -> list[str]:
        return ["brequeue", job_id]


SCHEDULERS: dict[str, Scheduler] = {s.name: s for s in (Slurm(), Lsf())}


def detect_scheduler(env: dict[str, str]) -> str:
    """The batch system whose job this environment is in."""
    for s in SCHEDULERS.values():
        if env.get(s.job_variable):
            return s.name
    raise BootstrapError(
        "no batch allocation found (neither SLURM_JOB_ID nor LSB_JOBID is set): submit "
        "with sbatch launch/slurm/train.sbatch or bsub < launch/lsf/train.bsub, or run "
        "python launch/run.py directly for an embedded local cluster"
    )


def allocation(env: dict[str, str] | None = None) -> Allocation:
    env = dict(os.environ) if env is None else env
    return SCHEDULERS[detect_scheduler(env)].allocation(env)


def launcher(scheduler: str, count: int, cmd: list[str], first: int = 0) -> list[str]:
    return SCHEDULERS[scheduler].launcher(count, cmd, first)


def requeue_cmd(scheduler: str, job_id: str) -> list[str]:
    return SCHEDULERS[scheduler].requeue_cmd(job_id)
