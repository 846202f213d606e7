"""The job directory: one job's shared-filesystem state (settings, token, the head's
address, which nodes joined, logs, the done / preempt marks)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from elastic.cluster.bootstrap.common import BootstrapError


@dataclass
class JobSettings:
    job_id: str
    scheduler: str
    nodes: list[str]
    incarnation: str  # a new value every (re)start of the job: stale files are ignored
    wait_s: float = 300.0
    object_store_mb: int | None = None
    dashboard: bool = False
    dashboard_host: str = "127.0.0.1"


class JobDir:
    """Shared-filesystem directory of one job: settings, token, the head's address,
    which nodes joined, logs, and the done / preempt marks."""

    def __init__(self, path: Path):
        self.path = path

    @property
    def token(self) -> Path:
        return self.path / "token"

    def settings(self) -> JobSettings:
        try:
            return JobSettings(**json.loads((self.path / "job.json").read_text()))
        except FileNotFoundError:
            raise BootstrapError(
                f"{self.path}/job.json not found: is {self.path} the directory of a job "
                "started with launch/slurm/train.sbatch or launch/lsf/train.bsub?"
            ) from None

    def create(self, settings: JobSettings) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        for stale in ("head.json", "done", "preempt", "token"):
            (self.path / stale).unlink(missing_ok=True)
        shutil.rmtree(self.path / "nodes", ignore_errors=True)
        (self.path / "nodes").mkdir()
        (self.path / "logs").mkdir(exist_ok=True)
        write_token(self.token)
        write_json(self.path / "job.json", asdict(settings))

    def head(self) -> dict | None:
        try:
            return json.loads((self.path / "head.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def joined(self) -> list[str]:
        return sorted(p.stem for p in (self.path / "nodes").glob("*.json"))

    def failed(self) -> dict[str, str]:
        """Nodes that could not start, with why."""
        return {p.stem: p.read_text().strip() for p in (self.path / "nodes").glob("*.failed")}

    def mark(self, name: str) -> None:
        (self.path / name).write_text(f"{time.time()}\n")

    def marked(self, name: str) -> bool:
        return (self.path / name).exists()

    def log_file(self, name: str) -> Path:
        return self.path / "logs" / f"{name}.log"


def write_token(path: Path) -> None:
    """A fresh Ray token: created 0600 (never briefly readable), never printed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)  # readers never see half a file


def job_dir_for(job: str, jobs_dir: str | None = None) -> JobDir:
    """A job's directory from its id (under the jobs directory) or its path."""
    p = Path(job)
    if not p.is_dir():
        p = Path(jobs_dir or default_jobs_dir()) / job
    if not (p / "job.json").is_file():
        raise BootstrapError(
            f"no running elastic job at {p}: pass the job id (as shown by squeue) from the "
            "directory the job was submitted from, or the job directory's path"
        )
    return JobDir(p)


def default_jobs_dir() -> str:
    return os.environ.get("ELASTIC_JOBS_DIR") or str(
        Path(os.environ.get("SLURM_SUBMIT_DIR") or os.environ.get("LS_SUBCWD") or ".") / "jobs"
    )
