"""A real Slurm 22.05 cluster on this machine: a controller and N compute nodes, each in
its own network namespace with its own IP (recipe: ../shared/notes/slurm-netns.md).

Nothing is added to the root network namespace: a hub namespace holds a bridge, every
node namespace has a veth into it, and there is no default route. Needs root and
Debian's slurmctld, slurmd, slurm-client and munge (`.ci/run` installs them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

BINARIES = ("slurmctld", "slurmd", "sbatch", "munged", "nsenter", "unshare", "ip")
SUBNET = "10.250.0"
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "OUT_OF_MEMORY")


def missing_requirements() -> str | None:
    """Why this machine cannot run the cluster, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, slurmd)"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install slurmctld slurmd slurm-client munge)"
    return None


def _run(cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, **kw)


class SlurmCluster:
    """``up()`` brings it up in under a few seconds; ``down()`` always takes it all away."""

    def __init__(self, root: Path, nodes: int = 3, cpus: int = 2, prefix: str | None = None):
        self.root = root
        self.n = nodes
        self.cpus = cpus
        self.prefix = prefix or f"el{os.getpid() % 100000}"
        self.hub = f"{self.prefix}-hub"
        self.names = [f"n{i}" for i in range(1, nodes + 1)]
        self.conf = root / "etc" / "slurm.conf"
        self.daemons: dict[str, subprocess.Popen] = {}
        self.logs: list = []
        self.started_munged = False

    # ---- names and addresses
    def ns(self, node: str) -> str:
        return self.hub if node == "ctl" else f"{self.prefix}-{node}"

    def ip(self, node: str) -> str:
        return f"{SUBNET}.1" if node == "ctl" else f"{SUBNET}.{10 + int(node[1:])}"

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def wrap(self, node: str, cmd: list[str]) -> list[str]:
        """``cmd`` run as if on ``node``: its network namespace, its /etc/hosts and
        hostname. Not ``ip netns exec``: that remounts /sys and slurmd loses its cgroups."""
        ns = self.ns(node)
        script = f'mount --bind /etc/netns/{ns}/hosts /etc/hosts && hostname {node} && exec "$@"'
        return [
            "nsenter", f"--net=/run/netns/{ns}", "unshare", "--mount", "--uts",
            "--propagation", "private", "sh", "-c", script, "sh", *cmd,
        ]  # fmt: skip

    def client(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command (sbatch, squeue, scontrol...) from the controller's host."""
        return _run(self.wrap("ctl", list(cmd)), check=check, env=self.env())

    # ---- lifecycle
    def up(self, timeout_s: float = 30) -> SlurmCluster:
        try:
            self._network()
            self._munge()
            self._config()
            self.daemons["ctl"] = self._daemon("ctl", ["slurmctld", "-D", "-f", str(self.conf)])
            for node in self.names:
                self.start_slurmd(node)
            self.wait_idle(self.names, timeout_s)
        except BaseException:
            self.down()
            raise
        return self

    def start_slurmd(self, node: str) -> None:
        (self.root / "spool" / node).mkdir(parents=True, exist_ok=True)
        self.daemons[node] = self._daemon(node, ["slurmd", "-D", "-f", str(self.conf), "-N", node])

    def _daemon(self, node: str, cmd: list[str]) -> subprocess.Popen:
        out = open(self.root / "log" / f"{cmd[0]}-{node}.out", "w")  # noqa: SIM115
        self.logs.append(out)
        return subprocess.Popen(
            self.wrap(node, cmd), env=self.env(), stdout=out, stderr=subprocess.STDOUT
        )

    def wait_idle(self, nodes: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        idle: set[str] = set()
        while time.monotonic() < deadline:
            out = self.client("sinfo", "-h", "-N", "-t", "idle,mix", "-o", "%N", check=False)
            idle = set(out.stdout.split())
            if idle >= set(nodes):
                return
            time.sleep(0.3)
        raise TimeoutError(f"Slurm nodes not idle after {timeout_s}s: {sorted(set(nodes) - idle)}")

    def _network(self) -> None:
        hub = self.hub
        _run(["ip", "netns", "add", hub])
        _run(["ip", "-n", hub, "link", "set", "lo", "up"])
        _run(["ip", "-n", hub, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", hub, "addr", "add", f"{self.ip('ctl')}/24", "dev", "br0"])
        _run(["ip", "-n", hub, "link", "set", "br0", "up"])
        for node in self.names:
            ns = self.ns(node)
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            veth = f"v{node}"
            peer = ["peer", "name", "eth0", "netns", ns]
            _run(["ip", "-n", hub, "link", "add", veth, "type", "veth", *peer])
            _run(["ip", "-n", hub, "link", "set", veth, "master", "br0", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.ip(node)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{self.ip(h)} {h}\n" for h in ["ctl", *self.names]
        )
        for node in ["ctl", *self.names]:
            d = Path("/etc/netns") / self.ns(node)
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text(hosts)

    def _munge(self) -> None:
        if _run(["pgrep", "-x", "munged"], check=False).returncode == 0:
            return  # one munged serves every namespace through its unix socket
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        _run(["runuser", "-u", "munge", "--", "munged"])
        self.started_munged = True

    def _config(self) -> None:
        for d in ("etc", "state", "spool", "log", "run"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        r = self.root
        nodes = "".join(
            f"NodeName={n} NodeAddr={self.ip(n)} CPUs={self.cpus} RealMemory=4000\n"
            for n in self.names
        )
        self.conf.write_text(
            f"""ClusterName=elastic
SlurmctldHost=ctl({self.ip("ctl")})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job may start again after this many seconds (default 120)
AuthInfo=cred_expire=8
# backfill every 5 s (default 30): a requeued job starts soon after it may
SchedulerParameters=bf_interval=1
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
SlurmdTimeout=20
KillWait=5
InactiveLimit=0
MinJobAge=300
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
{nodes}PartitionName=debug Nodes=n[1-{self.n}] Default=YES MaxTime=INFINITE State=UP
"""
        )

    def down(self) -> None:
        """Kill every process in the namespaces (scancel can leave reparented ones under
        proctrack/linuxproc), the daemons, then delete the namespaces and host files."""
        for node in [*self.names, "ctl"]:
            self.kill_node(node)
        for p in self.daemons.values():
            if p.poll() is None:
                p.kill()
            p.wait()
        for node in [*self.names, "ctl"]:
            _run(["ip", "netns", "delete", self.ns(node)], check=False)
            shutil.rmtree(Path("/etc/netns") / self.ns(node), ignore_errors=True)
        for f in self.logs:
            f.close()
        if self.started_munged:
            _run(["pkill", "-x", "munged"], check=False)

    # ---- jobs and faults
    def sbatch(self, *args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
        out = _run(
            self.wrap("ctl", ["sbatch", "--parsable", *args]),
            cwd=cwd, env={**self.env(), **(env or {})},
        )  # fmt: skip
        return out.stdout.strip().split(";")[0]

    def job_state(self, job: str) -> str:
        out = self.client("scontrol", "show", "job", job, "-o", check=False).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def wait_job(self, job: str, timeout_s: float, states=ENDED) -> str:
        deadline = time.monotonic() + timeout_s
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.job_state(job)
            if state in states:
                return state
            time.sleep(1)
        raise TimeoutError(f"job {job} still {state} after {timeout_s}s")

    def pids(self, node: str) -> list[int]:
        out = _run(["ip", "netns", "pids", self.ns(node)], check=False).stdout
        return [int(p) for p in out.split()]

    def kill_node(self, node: str) -> None:
        """SIGKILL every process on the node (its slurmd too): a crashed host."""
        for pid in self.pids(node):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def link(self, node: str, up: bool) -> None:
        """A network partition: the node's link into the hub goes down (or back up)."""
        _run(["ip", "-n", self.hub, "link", "set", f"v{node}", "up" if up else "down"])
