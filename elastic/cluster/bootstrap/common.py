"""What every part of the bootstrap shares: its error, its log line, the exit code of a
checkpointed stop."""

from __future__ import annotations

import socket
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PREEMPTED = 75  # launch/run.py's exit code after a checkpoint on a stop signal


class BootstrapError(RuntimeError):
    """A one-line, user-facing reason the job cannot start."""


def log(msg: str) -> None:
    print(f"[elastic.bootstrap {short_host()}] {msg}", flush=True)


def short_host() -> str:
    return socket.gethostname().split(".")[0]
