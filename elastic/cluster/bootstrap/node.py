"""One node's Ray: ``ray start`` (head or worker) with the job's token, ports, temp dir
and elastic's settings, and the teardown of this job's processes on the node, nobody
else's."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path

from elastic.cluster.bootstrap.common import BootstrapError, log, short_host
from elastic.cluster.bootstrap.jobdir import JobDir, JobSettings, write_json
from elastic.cluster.bootstrap.ports import PORT_NAMES, WORKER_PORTS, claim_ports

TAG_ENV = "ELASTIC_RAY_TAG"

# A dead node is noticed within seconds, not Ray's default ~30 s (GCS health checks)
HEALTH_ENV = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    "RAY_health_check_timeout_ms": "1000",
}
WORKER_POOL = {
    "num_workers_soft_limit": 0,
    "idle_worker_killing_time_threshold_ms": 30_000,
    "prestart_worker_first_driver": False,
}
"""The worker pool of every Ray node elastic starts (Ray system config; the ``ray start``
of a batch job gets it as ``RAY_*`` variables, :func:`ray_env`): an idle worker process
lives 30 s, then goes; none is started ahead for the driver.

Ray's defaults fit neither end of a run. Its soft limit is the node's CPU count, past
which an idle process is killed after 1 s: a training node holds more than that in
actors (the workers, Ray Train's controller and helpers), so every Ray Data read task
process was killed as soon as it idled (between two reads held back by
``data.prefetch_mb``, between executions, and the driver's warm-up ones before the
worker group's first read), and the next read waited for a new one (~2-5 s on 2 busy
cores). Kept for ever instead (a soft limit of 64), the read processes outlived their
use: once every worker holds its split in its cache no task
runs again, and each idle Ray process still takes ~1% of a core (its main thread
wakes every 10 ms to check signals), out of the training's on a node with few cores.
30 s covers a worker group's start (the warm-up's processes wait for its first read)
and any pause in the reads a read-ahead buffer hides. The driver's two prestarted
processes (Ray's ``prestart_worker_first_driver``) are of the job's runtime env, which
no task or actor of a run uses (Ray Train's workers add to it): they only idled."""
LOG_MONITOR_ENV = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0", "LOG_NAME_UPDATE_INTERVAL_S": "0.5"}
"""Environment of a Ray node's log monitor (read as it starts: the environment of the
``ray start`` or of the driver that starts an embedded node): it lists the log folder
every 0.5 s, not at every pass of its 0.1 s loop (Ray does that below 1,000 log files):
~2% of a core down to ~1% in a smoke run. A new process's log is seen up to 0.5 s later,
from its first line."""


def quiet_log_monitor(env: MutableMapping[str, str] = os.environ) -> None:
    """:data:`LOG_MONITOR_ENV` into ``env`` (a setting of the user's own wins): by
    default this process's, before it starts a Ray node (an embedded one, a test
    cluster's) whose log monitor inherits it."""
    for key, value in LOG_MONITOR_ENV.items():
        env.setdefault(key, value)


def ray_env_value(value: object) -> str:
    """A Ray system config value as a ``RAY_*`` variable (Ray reads "true"/"false")."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def node_ip(host: str, peers: list[str]) -> str:
    """This node's address on the allocation's network, never loopback: the host name's
    address, else the source address of the route to a peer node."""
    with contextlib.suppress(OSError):
        ip = socket.gethostbyname(host)
        if not ip.startswith("127."):
            return ip
    for peer in peers:
        with contextlib.suppress(OSError):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.connect((socket.gethostbyname(peer), 9))
            ip = s.getsockname()[0]
            s.close()
            if not ip.startswith("127."):
                return ip
    raise BootstrapError(
        f"cannot find a non-loopback address for {host}: fix its /etc/hosts or DNS entry, "
        "or set ELASTIC_NODE_IP to the address on the allocation's network"
    )


def temp_dir(job_id: str, host: str) -> Path:
    """Node-local and short: Ray's unix socket paths must stay under ~107 bytes."""
    base = os.environ.get("TMPDIR") or "/tmp"
    if len(base) > 40 or not os.path.isdir(base):
        base = "/tmp"
    return Path(base) / f"ej{job_id}-{host}"


def node_cpus() -> int:
    """What the allocation gives this node, not what the machine has."""
    for key in ("SLURM_CPUS_ON_NODE", "ELASTIC_NODE_CPUS"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return len(os.sched_getaffinity(0))


def ray_env(jobdir: JobDir, tag: str) -> dict[str, str]:
    """Environment of this job's Ray processes (and its driver): the job's token, fast
    health checks, elastic's worker pool (:data:`WORKER_POOL`), a quieter log monitor
    (:data:`LOG_MONITOR_ENV`, a setting of the user's own wins), and a tag by which
    teardown finds exactly this node's processes."""
    env = dict(os.environ)
    env.pop("RAY_AUTH_TOKEN", None)  # the job's token file, not somebody else's
    env.pop("RAY_ADDRESS", None)
    env.update(HEALTH_ENV)
    env.update({f"RAY_{key}": ray_env_value(value) for key, value in WORKER_POOL.items()})
    quiet_log_monitor(env)
    env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(jobdir.token), TAG_ENV: tag})
    return env


def ray_start_cmd(
    s: JobSettings, ip: str, base: int, temp: Path, head_address: str | None = None
) -> list[str]:
    """``ray start`` for a head (no ``head_address``) or a worker node: every port from
    the claimed block starting at ``base``, the dashboard off or on localhost."""
    ports = {name: base + i for i, name in enumerate(PORT_NAMES)}
    cmd = [
        sys.executable, "-m", "elastic.cluster.ray_start",  # ray start, workers started fast
        "start", f"--node-ip-address={ip}", f"--temp-dir={temp}",
        f"--num-cpus={node_cpus()}", "--disable-usage-stats",
        f"--min-worker-port={base + WORKER_PORTS[0]}",
        f"--max-worker-port={base + WORKER_PORTS[1]}",
    ]  # fmt: skip
    for name in PORT_NAMES[1:-1]:  # the dashboard's port is the head's only
        cmd.append(f"--{name}={ports[name]}")
    if s.object_store_mb:
        cmd.append(f"--object-store-memory={s.object_store_mb * 1024 * 1024}")
    if head_address:
        return [*cmd, f"--address={head_address}"]
    return [
        *cmd, "--head", f"--port={ports['port']}",
        f"--include-dashboard={'true' if s.dashboard else 'false'}",
        f"--dashboard-host={s.dashboard_host}", f"--dashboard-port={ports['dashboard-port']}",
    ]  # fmt: skip


class RayNode:
    """``ray start`` on this node (head or worker) and the teardown of what it started."""

    def __init__(self, jobdir: JobDir, settings: JobSettings, head: bool):
        self.jobdir, self.settings, self.is_head = jobdir, settings, head
        self.host = short_host()
        self.ip = os.environ.get("ELASTIC_NODE_IP") or node_ip(self.host, settings.nodes)
        self.tag = f"{settings.job_id}:{settings.incarnation}:{self.host}"
        self.temp = temp_dir(settings.job_id, self.host)
        self.base, self._lock = claim_ports(settings.job_id, self.ip)
        become_subreaper()

    def start(self, head_address: str | None = None) -> None:
        cmd = ray_start_cmd(self.settings, self.ip, self.base, self.temp, head_address)
        role = "head" if self.is_head else "node"
        logf = self.jobdir.log_file(f"{self.host}-{role}")
        with open(logf, "a") as out:
            rc = subprocess.run(
                cmd, env=ray_env(self.jobdir, self.tag), stdout=out, stderr=subprocess.STDOUT
            ).returncode
        if rc != 0:
            self.teardown()
            where = "" if self.is_head else f" joining {head_address}"
            raise BootstrapError(f"ray start{where} failed (exit {rc}): see {logf}")

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.base}"

    def alive(self) -> bool:
        import psutil

        for p in psutil.Process().children(recursive=True):  # we are the subreaper
            with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
                if p.name() == "raylet" and p.status() != psutil.STATUS_ZOMBIE:
                    return True
        return False

    def record(self) -> None:
        write_json(
            self.jobdir.path / "nodes" / f"{self.host}.json",
            {"host": self.host, "ip": self.ip, "ports": self.base, "head": self.is_head,
             "incarnation": self.settings.incarnation},
        )  # fmt: skip

    def teardown(self, keep: tuple[int, ...] = (), grace_s: float = 3.0) -> None:
        """Stop this node's Ray processes of this job, nobody else's: our descendants
        (``ray start`` daemonizes them, but we are their subreaper) and whatever still
        carries this node's tag. ``keep``: child processes to leave alone (a launcher).
        The run is over (or this node is lost to it): a short grace, then SIGKILL."""
        started = time.monotonic()
        n = stop_processes(lambda: ours(self.tag, keep), grace_s)
        log(f"stopped this job's {n} Ray processes here in {time.monotonic() - started:.1f}s")
        shutil.rmtree(self.temp, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (self.jobdir.path / "nodes" / f"{self.host}.json").unlink()


def become_subreaper() -> None:
    """Processes that our children daemonize (``ray start`` does) are re-parented to us
    instead of init, so teardown finds every one of them (Linux; elsewhere a no-op)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def ours(tag: str, keep: tuple[int, ...] = ()) -> list:
    """Our descendants (except ``keep`` and theirs) and processes tagged ``tag``. Ray
    rewrites its processes' titles, which can clobber /proc/PID/environ: the tag alone
    would miss some, the descendants alone would miss a process re-parented before we
    became the subreaper."""
    import psutil

    me = psutil.Process()
    skip = set(keep)
    for pid in keep:
        with contextlib.suppress(psutil.NoSuchProcess):
            skip.update(c.pid for c in psutil.Process(pid).children(recursive=True))
    found = {p.pid: p for p in me.children(recursive=True) if p.pid not in skip}
    for p in psutil.process_iter(["pid"]):
        if p.pid == me.pid or p.pid in found or p.pid in skip:
            continue
        try:
            if p.environ().get(TAG_ENV) == tag:
                found[p.pid] = p
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return list(found.values())


def stop_processes(find, grace_s: float) -> int:
    """SIGTERM, then SIGKILL after ``grace_s``; again while any are left (a raylet may
    start a worker while it is being stopped). Returns how many were stopped."""
    import psutil

    stopped = 0
    for _ in range(3):
        procs = find()
        if not procs:
            break
        stopped += len(procs)
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=grace_s)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(alive, timeout=5)
    return stopped
