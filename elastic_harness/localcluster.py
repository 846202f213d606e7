"""A real multi-raylet Ray cluster on this machine, and a training run driven against it
(for the elastic tests and the recovery/chaos benchmarks).

``ray.cluster_utils.Cluster`` starts a head and worker nodes as separate raylets (each
with its own processes); removing a node SIGKILLs its raylet and everything under it,
as a dead machine would. The head holds the CPUs Ray Data reads with; each worker node
holds exactly one training worker (``scaling.cpus_per_worker`` = a worker node's CPUs).
The run itself is the real command line, ``python launch/run.py``, in a subprocess.
"""

from __future__ import annotations

import bisect
import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from elastic.cluster.bootstrap import WORKER_POOL, quiet_log_monitor
from elastic.observe.tracking import HISTORY_FILE

REPO = Path(__file__).resolve().parents[1]  # a source checkout: launch/run.py
NODE_CPUS = 3  # per worker node: one training worker each
FAST_HEALTH = {  # notice a dead node within seconds (see shared notes on Slurm)
    "health_check_period_ms": 1000,
    "health_check_failure_threshold": 3,
    "health_check_timeout_ms": 1000,
    **WORKER_POOL,  # as every Ray cluster elastic starts
}


class RayCluster:
    def __init__(
        self,
        worker_nodes: int,
        system_config: dict[str, Any] | None = None,
        node_cpus: int = NODE_CPUS,
    ) -> None:
        from ray.cluster_utils import Cluster

        from elastic.cluster.ray_internals import fast_worker_start

        self.node_cpus = node_cpus
        quiet_log_monitor()  # as every Ray node elastic starts
        fast_worker_start()
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 2,
                "object_store_memory": 256 * 1024 * 1024,
                "include_dashboard": False,
                "_system_config": FAST_HEALTH if system_config is None else system_config,
            },
        )
        self.nodes: list[Any] = []
        for _ in range(worker_nodes):
            self.add_node()

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_node(self) -> Any:
        """A worker node joins (``node_cpus``: by default one training worker's worth)."""
        node = self.cluster.add_node(num_cpus=self.node_cpus, object_store_memory=128 * 1024 * 1024)
        self.nodes.append(node)
        return node

    def remove_node(self, node: Any) -> None:
        """SIGKILL the node's raylet and every process under it, as a dead machine."""
        self.nodes.remove(node)
        self.cluster.remove_node(node, allow_graceful=False)

    def node_of_pid(self, pid: int) -> Any:
        for node in self.nodes:
            if pid in _descendants(_raylet_pid(node)):
                return node
        raise LookupError(f"pid {pid} is on no worker node")

    def train_worker_pids(self) -> list[int]:
        """PIDs of the Ray Train worker processes on this cluster's worker nodes."""
        return self.actor_pids("RayTrainWorker")

    def actor_pids(self, actor_class: str) -> list[int]:
        """PIDs of the processes of ``actor_class``'s actors on this cluster's worker
        nodes (not the head's)."""
        pids = []
        for node in self.nodes:
            for pid in _descendants(_raylet_pid(node)):
                try:
                    if actor_class in " ".join(psutil.Process(pid).cmdline()):
                        pids.append(pid)
                except psutil.Error:
                    continue
        return pids

    def worker_side_pids(self) -> set[int]:
        """Every process of this cluster's worker nodes (raylets, their workers and
        agents); the head's, the GCS's and the drivers' are not among them."""
        pids: set[int] = set()
        for node in self.nodes:
            for procs in node.all_processes.values():
                pids.update(p.process.pid for p in procs)
            pids |= _descendants(_raylet_pid(node))
        return pids

    def drain(self, node: Any, deadline_s: int) -> None:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "ray.scripts.scripts",
                "drain-node",
                f"--address={self.address}",
                f"--node-id={node.node_id}",
                "--reason=DRAIN_NODE_REASON_PREEMPTION",
                "--reason-message=test preemption",
                f"--deadline-remaining-seconds={deadline_s}",
            ],
            check=True,
            capture_output=True,
        )

    def shutdown(self) -> None:
        self.cluster.shutdown()


def _raylet_pid(node: Any) -> int:
    from elastic.cluster.ray_internals import ray_constants

    return node.all_processes[ray_constants().PROCESS_TYPE_RAYLET][0].process.pid


def _descendants(pid: int) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


class RunFiles:
    """What a run (``run.storage_path``/``run.name``) has written so far."""

    EXIT_CHECK_S = 0.5
    """:meth:`wait_for` asks :meth:`exited` at most this often (a Slurm job's answer
    is a ``scontrol`` run in the controller's namespace: four processes a call)."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir
        self._records: list[dict[str, Any]] = []
        self._read_to = 0  # bytes of the history parsed into _records
        self._inode = 0  # of the history file they came from

    def records(self) -> list[dict[str, Any]]:
        """The run's records so far, every whole line of its history once: each call
        parses only the lines written since the last (waits poll it 10 times a second,
        and a history grows to thousands of lines); a line not yet ended is left for
        later."""
        try:
            with open(self.dir / HISTORY_FILE, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_ino != self._inode or st.st_size < self._read_to:  # a new file
                    self._records, self._read_to, self._inode = [], 0, st.st_ino
                f.seek(self._read_to)
                new = f.read()
        except FileNotFoundError:
            self._records, self._read_to = [], 0
            return []
        for line in new.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break  # being written
            try:
                self._records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a damaged line: the records end before it, as they did
            self._read_to += len(line)
        return list(self._records)

    def last_step(self) -> int:
        return max((r["step"] for r in self.records() if "train/loss" in r), default=0)

    def last_step_of_group(self, group: int) -> int:
        """The last step the run's ``group``-th worker group (1: the first) has trained,
        0 before it has: a group's records follow its ``startup`` record. (A group that a
        drain has told to go trains on until Ray Train restarts it: its steps are not the
        next group's.)"""
        starts, last = 0, 0
        for r in self.records():
            if r.get("event") == "startup":
                starts += 1
            if starts == group and "train/loss" in r:
                last = r["step"]
        return last

    def registered_steps(self) -> list[int]:
        """Steps of the checkpoints Ray Train has registered (complete on every rank)."""
        from elastic.train.integrity import registered_steps

        return registered_steps(str(self.dir))

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records() if r.get("event") == kind]

    def exited(self) -> int | None:
        """The exit code once the run is over, else None."""
        return None

    def output(self) -> str:
        return ""

    def wait_for(self, what: str, predicate: Any, timeout: float = 180.0, poll: float = 0.1):
        """``predicate()``'s first true value, asked every ``poll`` seconds; an
        AssertionError naming ``what`` if the run exits first or ``timeout`` passes.
        10 a second by default (a predicate that walks the process tree costs
        milliseconds of CPU a call: at 50 a second, a quarter of a core taken from the
        run it watches on 2 cores)."""
        deadline = time.monotonic() + timeout
        ask_exit = 0.0
        while (now := time.monotonic()) < deadline:
            value = predicate()
            if value:
                return value
            if now >= ask_exit:
                ask_exit = now + self.EXIT_CHECK_S
                rc = self.exited()
                if rc is not None:
                    raise AssertionError(f"run exited ({rc}) before {what}\n" + self.output())
            time.sleep(poll)
        raise AssertionError(f"timed out waiting for {what}\n" + self.output()[-5000:])

    def wait_step(
        self,
        since: float,
        world: int | None = None,
        restarted: bool = False,
        timeout: float = 300,
    ) -> float:
        """Time of the first training step logged after ``since`` (at ``world`` workers;
        ``restarted``: by a worker group started after ``since``, not a step that was
        already in flight when a worker was killed)."""

        def first() -> float | None:
            records = self.records()
            start = since
            if restarted:
                marks = [r["time"] for r in records if r.get("event") == "restart"]
                marks = [m for m in marks if m > since]
                if not marks:
                    return None
                start = marks[0]
            for r in records:
                ok = world is None or r.get("train/world_size") == world
                if "train/loss" in r and r["time"] > start and ok:
                    return r["time"]
            return None

        return self.wait_for(f"a step at world size {world or 'any'}", first, timeout=timeout)

    def wait_checkpoint(self, timeout: float = 300) -> None:
        """Until Ray has registered a checkpoint newer than the step trained now."""
        now = self.last_step()
        self.wait_for(
            "a checkpoint", lambda: any(s > now for s in self.registered_steps()), timeout
        )

    def shrink_then_grow(
        self, kill: Callable[[], Any], join: Callable[[], Any], smaller: int, larger: int
    ) -> dict[str, float]:
        """The recovery scenario the elastic tests (a Ray cluster, Slurm) and the
        recovery benchmark share: once a checkpoint is registered, ``kill()`` takes a node
        away and the run goes on at world size ``smaller``; once it has checkpointed at
        that size, ``join()`` adds a node and it grows to ``larger``. Returns the seconds
        from each action to the first step at the new size (``shrink_s``, ``grow_s``)."""
        out = {}
        for action, world, key in ((kill, smaller, "shrink_s"), (join, larger, "grow_s")):
            self.wait_checkpoint()
            t = time.time()
            action()
            out[key] = self.wait_step(t, world=world) - t
        return out

    def summary(self) -> dict[str, Any]:
        paths = sorted(glob.glob(str(self.dir / "hydra" / "*" / "summary.json")))
        assert paths, "no summary.json\n" + self.output()[-5000:]
        return json.loads(Path(paths[-1]).read_text())


class Run(RunFiles):
    """``python launch/run.py`` in a subprocess, and what it has written so far."""

    def __init__(self, storage: Path, name: str, overrides: list[str], address: str = "") -> None:
        super().__init__(storage / name)
        self.log = open(storage / f"{name}.log", "w")  # noqa: SIM115
        cmd = [
            sys.executable,
            str(REPO / "launch/run.py"),
            *overrides,
            f"run.storage_path={storage}",
            f"run.name={name}",
        ]
        if address:
            cmd.append(f"cluster.address={address}")
        env = {**os.environ, "WANDB_MODE": "offline"}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def exited(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def finish(self, timeout: float = 300.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.log.close()

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return Path(self.log.name).read_text()


def saving_pids(run_dir: Path) -> dict[int, str]:
    """Processes writing a checkpoint of the run in ``run_dir`` right now (each rank
    stages its part in ``<run>/.staging/ckpt-r<rank>-p<pid>-*``, elastic.train.checkpoint)."""
    out = {}
    for path in glob.glob(os.path.join(run_dir, ".staging", "ckpt-r*-p*-*")):
        pid = int(os.path.basename(path).split("-p", 1)[1].split("-", 1)[0])
        out[pid] = path
    return out


# -- real slowness, for the straggler test and bench (no injected sleeps) ---------------


def train_workers_under(pid: int) -> list[int]:
    """PIDs of the Ray Train worker processes below process ``pid`` (a run's driver
    with its embedded cluster)."""
    pids = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "RayTrainWorker" in " ".join(p.cmdline()):
                pids.append(p.pid)
        except psutil.Error:
            continue
    return pids


def pin(pid: int, cpu: int) -> None:
    """Every thread of process ``pid`` onto CPU ``cpu`` (threads it starts later
    inherit it from the thread that starts them)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except OSError:  # a thread that just ended
            continue


def pin_apart(slow: list[int], slow_cpu: int, fast: list[int], fast_cpu: int) -> None:
    """Pin ``slow`` to ``slow_cpu`` and ``fast`` to ``fast_cpu``, twice half a second
    apart (threads started meanwhile by threads not yet pinned)."""
    for _ in range(2):
        for pid in slow:
            pin(pid, slow_cpu)
        for pid in fast:
            pin(pid, fast_cpu)
        time.sleep(0.5)


CPU_CGROUP = "/sys/fs/cgroup/cpu"  # cgroup v1's cpu controller, where it is mounted


class Throttle:
    """Makes processes really slower at a fixed rate: a cgroup v1 CPU quota (``fraction``
    of one CPU per ``period_us``) on them, pinned to one CPU, and ``fast`` ones pinned to
    another: a slow node, not :class:`Slowdown`'s noisy neighbour (under which the hetero
    bench's rebalanced pair came out above the ideal of its alone runs; under the quota
    it did not). Needs a writable cpu cgroup (root here;
    :meth:`available`). :meth:`stop` moves the processes back and removes the cgroup."""

    def __init__(self, fraction: float = 0.5, period_us: int = 10_000) -> None:
        if not 0 < fraction < 1:
            raise ValueError(f"Throttle: fraction {fraction} is not in (0, 1)")
        if not self.available():
            raise RuntimeError(f"Throttle: {CPU_CGROUP} is not a writable cpu cgroup")
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise RuntimeError("slowing one worker down needs 2 CPUs")
        self.fast_cpu, self.slow_cpu = cpus[0], cpus[1]
        self.fraction = fraction
        self.path = os.path.join(CPU_CGROUP, f"elastic-throttle-{os.getpid()}-{time.time_ns()}")
        os.mkdir(self.path)
        self._write("cpu.cfs_period_us", period_us)
        self._write("cpu.cfs_quota_us", int(fraction * period_us))
        self.slowed: list[int] = []

    @staticmethod
    def available() -> bool:
        return os.access(os.path.join(CPU_CGROUP, "cpu.cfs_quota_us"), os.W_OK) and os.access(
            CPU_CGROUP, os.W_OK
        )

    def _write(self, name: str, value: int, path: str | None = None) -> None:
        with open(os.path.join(path or self.path, name), "w") as f:
            f.write(str(value))

    def apply(self, slow: list[int], fast: list[int] | None = None) -> None:
        """Put every thread of ``slow`` under the quota (threads started later inherit
        it) on one CPU, and ``fast`` on the other, pinned twice half a second apart."""
        for pid in slow:
            self._write("cgroup.procs", pid)
            self.slowed.append(pid)
        pin_apart(slow, self.slow_cpu, fast or [], self.fast_cpu)

    def throttled_s(self) -> float:
        """Seconds the quota has held the processes back so far (cpu.stat)."""
        with open(os.path.join(self.path, "cpu.stat")) as f:
            stat = dict(line.split() for line in f)
        return int(stat.get("throttled_time", 0)) / 1e9

    def stop(self) -> None:
        for pid in self.slowed:
            try:
                self._write("cgroup.procs", pid, CPU_CGROUP)
            except OSError:  # it ended
                continue
        for _ in range(50):  # threads that just ended leave it a moment later
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


class Slowdown:
    """Makes processes really slower: pins them to one CPU beside ``busy`` processes
    that spin on it (each then gets 1 / (busy + 1) of the CPU), and pins ``fast`` ones
    to another CPU alone. The spinning starts at :meth:`apply`, not before: until then
    the machine is whole (spinners started at once took one of 2 cores from everything
    else while a run started, ~30 s a run in the suite); :meth:`stop` ends it."""

    def __init__(self, busy: int = 1) -> None:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise RuntimeError("slowing one worker down needs 2 CPUs")
        self.fast_cpu, self.slow_cpu = cpus[0], cpus[1]
        self.spinners = busy
        self.busy: list[subprocess.Popen[bytes]] = []

    def apply(self, slow: list[int], fast: list[int] | None = None) -> None:
        """Start the spinners on one CPU (if not yet), pin ``slow`` to it and ``fast``
        to the other, twice half a second apart (threads started meanwhile by threads
        not yet pinned). The spinners take the slowed ones' niceness (Ray starts its
        workers niced: a spinner at nice 0 would take nearly all of the CPU from
        them)."""
        if slow:
            if not self.busy:
                spin = [sys.executable, "-c", "while True: pass"]
                self.busy = [subprocess.Popen(spin) for _ in range(self.spinners)]
                for p in self.busy:
                    pin(p.pid, self.slow_cpu)
            nice = psutil.Process(slow[0]).nice()
            for p in self.busy:
                psutil.Process(p.pid).nice(nice)
        pin_apart(slow, self.slow_cpu, fast or [], self.fast_cpu)

    def stop(self) -> None:
        for p in self.busy:
            p.kill()
            p.wait()
        self.busy = []


class CpuClock(threading.Thread):
    """CPU seconds used so far by a local cluster's processes, sampled every
    ``period_s``: the head side (the drivers, the GCS, the head node's raylet and its
    workers: Ray Train's controller, Ray Data's reads) apart from the worker side (the
    worker nodes' processes). A process that ends keeps the seconds it had used at its
    last sample. On a machine with fewer cores than processes, wall times stretch with
    the process count; CPU seconds tell what each side did, whatever the sharing.
    Without a ``cluster``, every process under this one is the head side (a run's or a
    peer's whole tree, as ``bench overhead`` counts it)."""

    def __init__(self, cluster: RayCluster | None, period_s: float = 0.5) -> None:
        super().__init__(name="cpu-clock", daemon=True)
        self.cluster, self.period_s = cluster, period_s
        self.samples: list[tuple[float, float, float]] = []  # (time, head s, worker s)
        self.head_kinds: list[dict[str, float]] = []  # each sample's head s by process
        self._last: dict[int, tuple[float, bool]] = {}  # pid -> (cpu s, worker)
        self._kinds: dict[str, float] = {}  # head s so far by kind of process
        self._stop_event = threading.Event()
        self._sample()
        self.start()

    def _sample(self) -> None:
        workers = self.cluster.worker_side_pids() if self.cluster is not None else set()
        me = os.getpid()
        for p in psutil.Process(me).children(recursive=True):
            try:
                t = p.cpu_times()
                # asked every time: a pooled worker ("ray_idle") becomes an actor or a
                # task's process later, and its seconds from then on are that kind's
                kind = _kind(p)
            except psutil.Error:
                continue
            used, worker = t.user + t.system, p.pid in workers
            if not worker:
                since = used - self._last.get(p.pid, (0.0, False))[0]
                self._kinds[kind] = self._kinds.get(kind, 0.0) + since
            self._last[p.pid] = (used, worker)
        worker_s = sum(s for s, w in self._last.values() if w)
        head_s = sum(s for s, w in self._last.values() if not w)
        self.samples.append((time.time(), head_s, worker_s))
        self.head_kinds.append(dict(self._kinds))

    def head_by_kind(self, t0: float, t1: float) -> dict[str, float]:
        """The head side's CPU seconds from ``t0`` to ``t1`` by kind of process
        (interpolated, as :meth:`between`), largest first."""
        first, last = self._kinds_at(t0), self._kinds_at(t1)
        spent = {k: v - first.get(k, 0.0) for k, v in last.items()}
        return dict(sorted(((k, v) for k, v in spent.items() if v > 0), key=lambda kv: -kv[1]))

    def _kinds_at(self, t: float) -> dict[str, float]:
        i, j, f = self._bracket(t)
        a, b = self.head_kinds[i], self.head_kinds[j]  # b holds every kind a does
        return {k: a.get(k, 0.0) + f * (v - a.get(k, 0.0)) for k, v in b.items()}

    def run(self) -> None:
        while not self._stop_event.wait(self.period_s):
            self._sample()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def _bracket(self, t: float) -> tuple[int, int, float]:
        """The samples either side of time ``t`` and how far from the first to the
        second ``t`` lies (0 to 1); before the first sample or after the last, that one."""
        times = [s[0] for s in self.samples]
        i = bisect.bisect_left(times, t)
        if i == 0:
            return 0, 0, 0.0
        if i == len(times):
            return i - 1, i - 1, 0.0
        t0, t1 = times[i - 1], times[i]
        return i - 1, i, (t - t0) / (t1 - t0) if t1 > t0 else 1.0

    def at(self, t: float) -> tuple[float, float]:
        """(head, worker) CPU seconds used by time ``t`` (epoch seconds), interpolated."""
        i, j, f = self._bracket(t)
        (_, h0, w0), (_, h1, w1) = self.samples[i], self.samples[j]
        return h0 + f * (h1 - h0), w0 + f * (w1 - w0)

    def between(self, t0: float, t1: float) -> tuple[float, float]:
        """(head, worker) CPU seconds used from ``t0`` to ``t1``."""
        (h0, w0), (h1, w1) = self.at(t0), self.at(t1)
        return h1 - h0, w1 - w0


def _kind(p: psutil.Process) -> str:
    """What a cluster process is, in a word: ``ray::TrainController``, ``raylet``,
    ``gcs_server``, ``driver`` (launch/run.py), ``ray_idle`` (a pooled worker) ..."""
    cmd = p.cmdline()
    name = cmd[0] if cmd else p.name()
    if name.startswith("ray::"):  # an actor's title names the method it runs: not kept
        return name.split()[0].split(".")[0]
    base = os.path.basename(name)
    if not base.startswith("python"):
        # a program of its own: its name (the raylet's arguments name the worker's
        # script, default_worker.py, which made it a pooled worker here once)
        return base
    if any(c.endswith("launch/run.py") for c in cmd):
        return "driver"
    script = next((c for c in cmd[1:] if not c.startswith("-")), "")
    if script.endswith("default_worker.py"):
        return "ray_idle"
    return os.path.basename(script) or base
