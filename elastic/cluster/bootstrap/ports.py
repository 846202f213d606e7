"""Per-job port blocks: every port a Ray node listens on comes from a block of
:data:`PORT_BLOCK` ports claimed for the job on that node (a lock file held while the
node runs), so two jobs on the same nodes never collide."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
from pathlib import Path

from elastic.cluster.bootstrap.common import BootstrapError

PORT_BASE, PORT_TOP, PORT_BLOCK = 10000, 32000, 200
PORT_NAMES = (
    "port", "node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port",
    "dashboard-port",
)  # fmt: skip
WORKER_PORTS = (10, PORT_BLOCK - 1)  # offsets of min/max worker ports in a block
LOCK_DIR = Path("/tmp/elastic-ports")


def port_free(ip: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True


def claim_ports(job_id: str, ip: str) -> tuple[int, object]:
    """A block of PORT_BLOCK ports for this job on this node: first the one the job id
    hashes to, else the next whose lock is free and whose ports are. The lock is held
    (an open file) as long as the node runs."""
    LOCK_DIR.mkdir(exist_ok=True)
    with contextlib.suppress(PermissionError):
        LOCK_DIR.chmod(0o1777)  # shared by every user's jobs on this node, like /tmp
    slots = (PORT_TOP - PORT_BASE) // PORT_BLOCK
    start = int(re.sub(r"\D", "", job_id) or 0) % slots
    for i in range(slots):
        base = PORT_BASE + ((start + i) % slots) * PORT_BLOCK
        try:
            # read-only is enough to lock, and works on another user's lock file
            fd = os.open(LOCK_DIR / f"{base}.lock", os.O_RDONLY | os.O_CREAT, 0o666)
        except OSError:
            continue
        lock = os.fdopen(fd)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            continue
        if all(port_free(ip, base + k) for k in range(len(PORT_NAMES))):
            return base, lock
        lock.close()
    raise BootstrapError(f"no free block of {PORT_BLOCK} ports in {PORT_BASE}..{PORT_TOP} on {ip}")
