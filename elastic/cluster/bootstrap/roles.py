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
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from elastic.cluster.bootstrap.common import PREEMPTED, REPO, BootstrapError, log, short_host
from elastic.cluster.bootstrap.jobdir import (
    JobDir,
    JobSettings,
    default_jobs_dir,
    job_dir_for,
    write_json,
)
from elastic.cluster.bootstrap.node import RayNode, ray_env
from elastic.cluster.bootstrap.ports import PORT_BLOCK
from elastic.cluster.bootstrap.schedulers import (
    SCHEDULERS,
    Allocation,
    allocation,
    detect_scheduler,
)


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
    sched = SCHEDULERS[job.scheduler]
    try:
        with open(jobdir.log_file("launcher"), "a") as out:
            if sched.head_on_batch_host:
                # the batch script runs on the first node: the head runs here
                if len(job.nodes) > 1:
                    workers = subprocess.Popen(
                        sched.launcher(len(job.nodes) - 1, node_cmd, first=1),
                        stdout=out, stderr=subprocess.STDOUT,
                    )  # fmt: skip
                rc = run_head(jobdir, args, sig, keep=(workers.pid,) if workers else ())
            else:
                # the batch script runs on a launch node (LSF): the head gets a compute node
                head_cmd = [*me, "head", "--job-dir", str(jobdir.path), "--", *args]
                head = subprocess.Popen(sched.launcher(1, head_cmd))
                if len(job.nodes) > 1:
                    workers = subprocess.Popen(
                        sched.launcher(len(job.nodes) - 1, node_cmd),
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
        subprocess.run(sched.requeue_cmd(job.job_id))
    return rc


def run_join(ns: argparse.Namespace, sig: Signals) -> int:
    jobdir = job_dir_for(ns.job, ns.jobs_dir)
    s = jobdir.settings()
    if jobdir.marked("done") or jobdir.head() is None:
        raise BootstrapError(f"job {s.job_id} is not running (no head, or done): nothing to join")
    env = dict(os.environ)
    sched = SCHEDULERS[detect_scheduler(env)]
    nodes = sched.nodes(env)
    log(f"{len(nodes)} nodes ({', '.join(nodes)}) join job {s.job_id} at {jobdir.head()}")
    node_cmd = [
        sys.executable,
        "-m",
        "elastic.cluster.bootstrap",
        "node",
        "--job-dir",
        str(jobdir.path),
    ]
    p = subprocess.Popen(sched.launcher(len(nodes), node_cmd))
    sig.child = p
    return p.wait()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    passthrough: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, passthrough = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(
        prog="python -m elastic.cluster.bootstrap",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
