"""Ray inside a batch allocation: ``python -m elastic.cluster.bootstrap ROLE ...``.

The job scripts (``launch/slurm/*.sbatch``, ``launch/lsf/*.bsub``) only allocate and
call this; training knobs never live in shell. Roles:

- ``train [-- HYDRA ARGS]``: the batch script's process. Makes the job directory (a fresh
  0600 token, the job's settings), starts a ``node`` on every other node of the
  allocation (``srun`` / ``jsrun``), runs the ``head`` (here on Slurm, whose batch host
  is the first node; on the first compute node through ``jsrun`` on LSF, whose batch
  script runs on a launch node), passes a preemption signal on, and on exit code 75
  (checkpointed on a signal) requeues the job, which resumes from the same storage.
- ``head``: starts the Ray head on this node's allocation address, waits for the
  allocation's nodes (a timeout names the missing ones), runs ``launch/run.py`` with the
  explicit head address, then tears down this job's processes and nobody else's.
- ``node``: starts a Ray worker node that joins the head named in the job directory,
  and stays until the job is done (or its head is gone).
- ``join JOB``: a second allocation whose nodes join a running job, which grows.

Every node's Ray gets per-job ports (a claimed block, so two jobs on the same nodes
never collide), a short node-local temp dir, token authentication with the job's token
(a node without it is refused), fast node-death detection, and no dashboard unless
asked for (then bound to localhost).

Over 400 lines on purpose: the four roles are one protocol (the job directory, port
blocks, token, node wait and teardown they share); split, it would be read across files.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import MutableMapping
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PREEMPTED = 75  # launch/run.py's exit code after a checkpoint on a stop signal

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
cores). Kept for ever instead (a soft limit of 64, until 2026-12-05), the read
processes outlived their use: once every worker holds its split in its cache no task
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


# Per-job port blocks: every port a Ray node listens on comes from its block
PORT_BASE, PORT_TOP, PORT_BLOCK = 10000, 32000, 200
PORT_NAMES = (
    "port", "node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port",
    "dashboard-port",
)  # fmt: skip
WORKER_PORTS = (10, PORT_BLOCK - 1)  # offsets of min/max worker ports in a block
LOCK_DIR = Path("/tmp/elastic-ports")
TAG_ENV = "ELASTIC_RAY_TAG"


class BootstrapError(RuntimeError):
    """A one-line, user-facing reason the job cannot start."""


def log(msg: str) -> None:
    print(f"[elastic.bootstrap {short_host()}] {msg}", flush=True)


def short_host() -> str:
    return socket.gethostname().split(".")[0]


# ---------------------------------------------------------------- the allocation
@dataclass
class Allocation:
    scheduler: str  # slurm | lsf
    job_id: str
    nodes: list[str]  # compute nodes, the head's first (LSF: launch node skipped)
    submit_dir: str
    restart: int = 0  # Slurm requeue count / LSF rerun: a new incarnation of the job


def detect_scheduler(env: dict[str, str]) -> str:
    if env.get("SLURM_JOB_ID"):
        return "slurm"
    if env.get("LSB_JOBID"):
        return "lsf"
    raise BootstrapError(
        "no batch allocation found (neither SLURM_JOB_ID nor LSB_JOBID is set): submit "
        "with sbatch launch/slurm/train.sbatch or bsub < launch/lsf/train.bsub, or run "
        "python launch/run.py directly for an embedded local cluster"
    )


def slurm_nodes(env: dict[str, str]) -> list[str]:
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise BootstrapError("SLURM_JOB_NODELIST is not set: run inside a Slurm allocation")
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True
    )
    if out.returncode != 0:
        raise BootstrapError(f"scontrol show hostnames {nodelist} failed: {out.stderr.strip()}")
    return out.stdout.split()


def lsf_nodes(env: dict[str, str]) -> list[str]:
    """Compute nodes of an LSF job, in order, without the launch node the batch script
    runs on (Summit: ``batchN``, listed first with one slot, the compute nodes with 42)."""
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


def allocation(env: dict[str, str] | None = None) -> Allocation:
    env = dict(os.environ) if env is None else env
    scheduler = detect_scheduler(env)
    if scheduler == "slurm":
        return Allocation(
            "slurm",
            env["SLURM_JOB_ID"],
            slurm_nodes(env),
            env.get("SLURM_SUBMIT_DIR") or os.getcwd(),
            int(env.get("SLURM_RESTART_COUNT") or 0),
        )
    return Allocation(
        "lsf",
        env["LSB_JOBID"],
        lsf_nodes(env),
        env.get("LS_SUBCWD") or os.getcwd(),
        int(env.get("LSB_RESTART") == "Y"),
    )


def launcher(scheduler: str, count: int, cmd: list[str], first: int = 0) -> list[str]:
    """One task per node on ``count`` nodes of the allocation, from node index ``first``
    (Slurm); LSF places resource sets on free whole nodes."""
    if scheduler == "slurm":
        return [
            "srun", f"--nodes={count}", f"--ntasks={count}", "--ntasks-per-node=1",
            f"--relative={first}", "--no-kill", "--kill-on-bad-exit=0", "--overlap", *cmd,
        ]  # fmt: skip
    return [
        "jsrun", f"--nrs={count}", "--rs_per_host=1", "--tasks_per_rs=1",
        "--cpu_per_rs=ALL_CPUS", "--gpu_per_rs=ALL_GPUS", "--bind=none", *cmd,
    ]  # fmt: skip


def requeue_cmd(scheduler: str, job_id: str) -> list[str]:
    return ["scontrol", "requeue", job_id] if scheduler == "slurm" else ["brequeue", job_id]


# ---------------------------------------------------------------- the job directory
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


# ---------------------------------------------------------------- one node's Ray
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


# ---------------------------------------------------------------- roles
class Signals:
    """Stop signals received by a role: remembered, and passed on to a child if set."""

    def __init__(self, *signums: int):
        self.received: list[int] = []
        self.child: subprocess.Popen | None = None
        for s in signums:
            signal.signal(s, self._on)

    def _on(self, signum: int, _frame: object) -> None:
        self.received.append(signum)
        if self.child is not None and self.child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.child.send_signal(signum)


def wait_for(pred, timeout_s: float, every_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every_s)
    return bool(pred())


def driver_cmd(args: list[str], address: str, job: Allocation | JobSettings) -> list[str]:
    keys = {a.split("=", 1)[0].lstrip("+~") for a in args if "=" in a}
    if "cluster.address" in keys:
        raise BootstrapError(
            "cluster.address is set by the job's bootstrap (its head's address): remove it "
            "from the sbatch/bsub arguments"
        )
    run = REPO / "launch" / "run.py"
    if not run.is_file():
        raise BootstrapError(f"{run} not found: install elastic from its repository (pip -e)")
    extra = [f"cluster.address={address}"]
    if "run.name" not in keys:
        # a requeued job keeps its id: the same name resumes from the same storage
        extra.append(f"run.name={job.scheduler}-{job.job_id}")
    return [sys.executable, str(run), *args, *extra]


def run_head(jobdir: JobDir, args: list[str], sig: Signals, keep: tuple[int, ...] = ()) -> int:
    """Start the Ray head, wait for the allocation's nodes, run the driver, tear down
    (leaving ``keep``, the other nodes' launcher, to end by itself)."""
    s = jobdir.settings()
    node = RayNode(jobdir, s, head=True)
    try:
        node.start()
        node.record()
        write_json(
            jobdir.path / "head.json",
            {"address": node.address, "host": node.host, "incarnation": s.incarnation},
        )
        log(f"Ray head at {node.address} (ports {node.base}..{node.base + PORT_BLOCK - 1})")
        expected = set(s.nodes)
        if not wait_for(
            lambda: expected <= set(jobdir.joined()) or jobdir.failed() or sig.received, s.wait_s
        ):
            missing = sorted(expected - set(jobdir.joined()))
            raise BootstrapError(
                f"nodes {', '.join(missing)} did not join the Ray head within {s.wait_s:.0f}s "
                f"(see their logs in {jobdir.path / 'logs'}); raise --wait-s if they are slow"
            )
        failed = jobdir.failed()
        if failed:
            raise BootstrapError(
                "nodes could not start: " + "; ".join(f"{h}: {why}" for h, why in failed.items())
            )
        if sig.received:
            return PREEMPTED
        log(f"all {len(expected)} nodes joined: {', '.join(s.nodes)}")
        cmd = driver_cmd(args, node.address, s)
        env = ray_env(jobdir, f"{s.job_id}:{s.incarnation}:driver")
        driver = subprocess.Popen(cmd, env=env)
        sig.child = driver
        forwarded = False
        while driver.poll() is None:
            if not forwarded and jobdir.marked("preempt"):
                driver.send_signal(signal.SIGUSR1)  # LSF: the launch node's signal
                forwarded = True
            time.sleep(0.5)
        return driver.returncode
    finally:
        jobdir.mark("done")
        node.teardown(keep)


def run_node(jobdir: JobDir, sig: Signals) -> int:
    """Join the job's head and stay until the job is done or the head is gone."""
    s = jobdir.settings()
    if not wait_for(
        lambda: (jobdir.head() or {}).get("incarnation") == s.incarnation or jobdir.marked("done"),
        s.wait_s,
    ):
        raise BootstrapError(f"no Ray head in {jobdir.path}/head.json after {s.wait_s:.0f}s")
    if jobdir.marked("done"):
        return 0
    head = jobdir.head() or {}
    try:
        node = RayNode(jobdir, s, head=False)
        node.start(head["address"])
    except BootstrapError as e:
        (jobdir.path / "nodes" / f"{short_host()}.failed").write_text(f"{e}\n")
        raise
    try:
        node.record()
        log(f"joined the Ray head at {head['address']}")
        while not sig.received and not jobdir.marked("done"):
            if (jobdir.head() or {}).get("incarnation") != s.incarnation:
                break  # the job was requeued: this node belongs to the old one
            if not node.alive():
                log("this node's raylet exited (head gone or node declared dead)")
                return 1
            time.sleep(1)
        return 0
    finally:
        node.teardown()


def run_train(args: list[str], ns: argparse.Namespace, sig: Signals) -> int:
    job = allocation()
    jobdir = JobDir(Path(ns.jobs_dir or default_jobs_dir()).resolve() / job.job_id)
    settings = JobSettings(
        job_id=job.job_id,
        scheduler=job.scheduler,
        nodes=job.nodes,
        incarnation=f"{job.restart}-{secrets.token_hex(4)}",
        wait_s=ns.wait_s,
        object_store_mb=ns.object_store_mb,
        dashboard=ns.dashboard,
        dashboard_host=ns.dashboard_host,
    )
    driver_cmd(args, "", job)  # argument mistakes fail before anything starts
    jobdir.create(settings)
    log(f"{job.scheduler} job {job.job_id} on {len(job.nodes)} nodes ({', '.join(job.nodes)}); "
        f"job directory {jobdir.path}")  # fmt: skip
    me = [sys.executable, "-m", "elastic.cluster.bootstrap"]
    node_cmd = [*me, "node", "--job-dir", str(jobdir.path)]
    workers = None
    try:
        with open(jobdir.log_file("launcher"), "a") as out:
            if job.scheduler == "slurm":
                # the batch script runs on the first node: the head runs here
                if len(job.nodes) > 1:
                    workers = subprocess.Popen(
                        launcher("slurm", len(job.nodes) - 1, node_cmd, first=1),
                        stdout=out, stderr=subprocess.STDOUT,
                    )  # fmt: skip
                rc = run_head(jobdir, args, sig, keep=(workers.pid,) if workers else ())
            else:
                # LSF: the batch script runs on a launch node; the head gets a compute node
                head_cmd = [*me, "head", "--job-dir", str(jobdir.path), "--", *args]
                head = subprocess.Popen(launcher("lsf", 1, head_cmd))
                if len(job.nodes) > 1:
                    workers = subprocess.Popen(
                        launcher("lsf", len(job.nodes) - 1, node_cmd),
                        stdout=out, stderr=subprocess.STDOUT,
                    )  # fmt: skip
                while head.poll() is None:
                    if sig.received and not jobdir.marked("preempt"):
                        jobdir.mark("preempt")  # the head passes it to the driver
                    time.sleep(0.5)
                rc = head.returncode
    finally:
        jobdir.mark("done")  # every node leaves
        if workers is not None:
            try:
                workers.wait(timeout=30)
            except subprocess.TimeoutExpired:
                workers.terminate()
    if rc == PREEMPTED and ns.requeue:
        log(f"checkpointed on a stop signal: requeueing job {job.job_id} to resume")
        subprocess.run(requeue_cmd(job.scheduler, job.job_id))
    return rc


def run_join(ns: argparse.Namespace, sig: Signals) -> int:
    jobdir = job_dir_for(ns.job, ns.jobs_dir)
    s = jobdir.settings()
    if jobdir.marked("done") or jobdir.head() is None:
        raise BootstrapError(f"job {s.job_id} is not running (no head, or done): nothing to join")
    env = dict(os.environ)
    scheduler = detect_scheduler(env)
    nodes = slurm_nodes(env) if scheduler == "slurm" else lsf_nodes(env)
    log(f"{len(nodes)} nodes ({', '.join(nodes)}) join job {s.job_id} at {jobdir.head()}")
    node_cmd = [
        sys.executable,
        "-m",
        "elastic.cluster.bootstrap",
        "node",
        "--job-dir",
        str(jobdir.path),
    ]
    p = subprocess.Popen(launcher(scheduler, len(nodes), node_cmd))
    sig.child = p
    return p.wait()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    passthrough: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, passthrough = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(prog="python -m elastic.cluster.bootstrap", description=__doc__)
    sub = ap.add_subparsers(dest="role", required=True)
    t = sub.add_parser("train", help="bootstrap Ray across this allocation and train")
    t.add_argument("--jobs-dir", help="where job directories go (default: SUBMIT_DIR/jobs)")
    t.add_argument("--wait-s", type=float, default=300.0, help="how long to wait for the nodes")
    t.add_argument("--object-store-mb", type=int, default=None)
    t.add_argument("--dashboard", action="store_true", help="start Ray's dashboard")
    t.add_argument("--dashboard-host", default="127.0.0.1")
    t.add_argument("--no-requeue", dest="requeue", action="store_false",
                   help="exit 75 on preemption instead of requeueing the job")  # fmt: skip
    j = sub.add_parser("join", help="this allocation's nodes join a running job")
    j.add_argument("job", help="the job id, or its job directory")
    j.add_argument("--jobs-dir")
    for role in ("head", "node"):
        r = sub.add_parser(role, help=f"internal: the {role} of a job")
        r.add_argument("--job-dir", required=True)
    ns = ap.parse_args(argv)
    sig = Signals(signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    try:
        if ns.role == "train":
            return run_train(passthrough, ns, sig)
        if ns.role == "join":
            return run_join(ns, sig)
        jobdir = JobDir(Path(ns.job_dir))
        if ns.role == "head":
            return run_head(jobdir, passthrough, sig)
        return run_node(jobdir, sig)
    except BootstrapError as e:
        print(f"[elastic.bootstrap] error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
