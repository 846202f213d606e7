"""The batch scripts on a real Slurm 22.05 cluster: a controller and 3 compute nodes, each
in its own network namespace with its own IP (tests/slurm_cluster.py), brought up for
this module and always torn down. Jobs are the real ``sbatch launch/slurm/*.sbatch``;
node failures are real kills and real link cuts. Needs root and Debian's Slurm packages
(`.ci/run` installs them); elsewhere these tests are skipped, in CI they must run."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest
from conftest import assert_every_epoch_once, cluster_data, cluster_overrides
from slurm_cluster import ENDED, SlurmCluster, missing_requirements

from elastic_harness.localcluster import REPO, RunFiles

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

ROWS, BATCH = 2048, 48
ELASTIC = ("scaling.min_workers=2", "scaling.max_workers=3")
TRAIN = str(REPO / "launch" / "slurm" / "train.sbatch")
JOIN = str(REPO / "launch" / "slurm" / "join.sbatch")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = missing_requirements()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"the Slurm tests must run in CI: {why}")
        pytest.skip(why)
    # 6 CPUs a node (more than this machine has: slurmd is told so) so that two jobs
    # of 3 CPUs a node can share the nodes
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=3, cpus=6)
    c.up()
    try:
        yield c
    finally:
        c.down()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return cluster_data(tmp_path_factory.mktemp("slurm-data"), ROWS, seed=2)


def overrides(data, *extra: str) -> list[str]:
    # a node's 3 CPUs: one worker (2), one for Ray Data's read and decode tasks
    cpus = ("scaling.cpus_per_worker=2", "scaling.placement_strategy=SPREAD")
    return cluster_overrides(data, 256, BATCH, 2, *cpus, *extra)


class Job(RunFiles):
    """A submitted ``sbatch`` job and what its run has written so far."""

    def __init__(self, cluster: SlurmCluster, workdir: Path, *sbatch_args: str):
        self.cluster, self.workdir = cluster, workdir
        self.id = cluster.sbatch(
            "-c", "3", *sbatch_args, cwd=workdir,
            env={"ELASTIC_BOOTSTRAP_ARGS": "--object-store-mb 200 --wait-s 90"},
        )  # fmt: skip
        super().__init__(workdir / "runs" / f"slurm-{self.id}")

    @property
    def jobdir(self) -> Path:
        return self.workdir / "jobs" / self.id

    def state(self) -> str:
        return self.cluster.job_state(self.id)

    def exited(self) -> int | None:
        state = self.state()
        return None if state not in ENDED else (0 if state == "COMPLETED" else 1)

    def output(self) -> str:
        path = self.workdir / f"slurm-{self.id}.out"
        return path.read_text() if path.exists() else f"(no {path.name} yet)"

    def finish(self, timeout_s: float = 420) -> str:
        try:
            return self.cluster.wait_job(self.id, timeout_s)
        except TimeoutError as e:
            raise AssertionError(f"{e}\n{self.output()[-6000:]}") from None

    def nodes(self) -> dict[str, dict]:
        return {p.stem: json.loads(p.read_text()) for p in (self.jobdir / "nodes").glob("*.json")}


def assert_every_sample_once(s: dict, data, epochs: int = 2) -> None:
    assert s["status"] == "finished"
    assert_every_epoch_once(s, data / "train", epochs, ROWS)


def test_two_concurrent_jobs_one_losing_two_nodes_and_a_node_without_the_token(
    slurm, data, tmp_path
):
    """Job A (3 nodes, 3 workers) shares node n1 with job B (1 node): their Ray clusters
    use different ports, and a Ray node started on n3 without A's token (or with another
    token) is refused. Then A loses two nodes: after a checkpoint n3's network link is
    cut and A goes on at world size 2; once it has checkpointed at that size, every
    process on n2 is SIGKILLed (slurmd too: a crashed host) and A goes on at 1. Both jobs
    finish, every sample once (B never sees A's failures), the token is in no file but
    its own, and no process of either job is left on any node. One module
    of jobs: the suite pays two jobs' starts, not three."""
    grow = ("scaling.min_workers=1", "scaling.max_workers=3", "trainer.max_epochs=3")
    a = Job(slurm, tmp_path, "-N", "3", TRAIN, *overrides(data, *grow))
    b_dir = tmp_path / "b"
    b_dir.mkdir()
    one = ("scaling.min_workers=1", "scaling.max_workers=1", "trainer.max_epochs=1")
    b = Job(slurm, b_dir, "-N", "1", "-w", "n1", TRAIN, *overrides(data, *one))
    try:
        a.wait_for("job A's nodes", lambda: len(a.nodes()) == 3, timeout=120)
        b.wait_for("job B's node", lambda: len(b.nodes()) == 1, timeout=120)
        token = (a.jobdir / "token").read_text()
        assert stat.S_IMODE((a.jobdir / "token").stat().st_mode) == 0o600
        assert token != (b.jobdir / "token").read_text()
        assert set(b.nodes()) == {"n1"} and a.nodes()["n1"]["ports"] != b.nodes()["n1"]["ports"]

        address = json.loads((a.jobdir / "head.json").read_text())["address"]
        home = tmp_path / "stranger-home"  # no ~/.ray/auth_token to fall back on
        home.mkdir()
        wrong = tmp_path / "wrong-token"
        wrong.write_text("0" * 64)
        wrong.chmod(0o600)
        for extra in ({}, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(wrong)}):
            env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
            env.update(HOME=str(home), **extra)
            temp = f"/tmp/stranger-{os.getpid()}"
            cmd = ["ray", "start", f"--address={address}", f"--temp-dir={temp}", "--num-cpus=1"]
            out = subprocess.run(
                slurm.wrap("n3", cmd), env=env, capture_output=True, text=True, timeout=120
            )
            shutil.rmtree(temp, ignore_errors=True)
            assert out.returncode != 0, out.stdout[-3000:]
            assert "auth" in (out.stdout + out.stderr).lower(), (out.stdout + out.stderr)[-3000:]

        a.wait_for("a registered checkpoint", lambda: a.registered_steps(), timeout=240)
        for failure, node, world in (("link down", "n3", 2), ("processes killed", "n2", 1)):
            a.wait_checkpoint()
            at = time.time()
            if failure == "link down":
                slurm.link(node, up=False)
            else:
                slurm.kill_node(node)
            a.wait_step(at, world=world)
        a.wait_for("the end of training", lambda: list(a.dir.glob("hydra/*/summary.json")), 360)
        assert b.finish() == "COMPLETED", b.output()[-6000:]
    finally:
        slurm.link("n3", up=True)
        slurm.start_slurmd("n2")
        a.finish()
        for node in ("n2", "n3"):
            slurm.client("scontrol", "update", f"nodename={node}", "state=resume", check=False)
        slurm.wait_idle(["n2", "n3"], 120)
    sa, sb = a.summary(), b.summary()
    assert sa["world_sizes"] == [3, 2, 1], a.output()[-6000:]
    restarts = [(e["cause"], e["world_size"]) for e in sa["events"] if e["event"] == "restart"]
    assert [w for _, w in restarts] == [2, 1] and {c for c, _ in restarts} <= {
        "shrink",
        "failure",
    }, restarts
    assert_every_sample_once(sa, data, epochs=3)
    assert sb["world_sizes"] == [1]
    assert_every_sample_once(sb, data, epochs=1)
    # the token is in its file and nowhere else: not in logs, outputs or summaries
    for path in tmp_path.rglob("*"):
        if path.is_file() and path.name != "token" and path.stat().st_size < 50_000_000:
            assert token not in path.read_text(errors="replace"), path
    # both jobs' Ray processes are gone from every node (n3's once its link is back and
    # Slurm has ended the job's step there), and their node-local temp dirs but the
    # crashed host's (a SIGKILL leaves it, as a real crash leaves a node's /tmp)
    deadline = time.monotonic() + 60
    while (left := _leftovers(slurm)) and time.monotonic() < deadline:
        time.sleep(1)
    assert left == []

    def temps() -> set[str]:  # a node removes its own after its processes are gone
        return {p.name for j in (a, b) for p in Path("/tmp").glob(f"ej{j.id}-n*")}

    while not temps() <= {f"ej{a.id}-n2"} and time.monotonic() < deadline + 30:
        time.sleep(1)
    assert temps() <= {f"ej{a.id}-n2"}, temps()


def _leftovers(slurm: SlurmCluster) -> list[str]:
    """Processes of elastic jobs still on the nodes: (node, pid, command)."""
    found = []
    for node in slurm.names:
        for pid in slurm.pids(node):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if b"ELASTIC_RAY_TAG=" in env:
                found.append(f"{node} {pid} {cmd.decode(errors='replace')[:150]}")
    return found


def test_a_join_allocation_grows_the_job_then_usr1_requeues_it_and_it_resumes(
    slurm, data, tmp_path
):
    """A 2-node job; a second allocation (join.sbatch, 1 node) joins its Ray cluster after
    the first checkpoint: the job grows to world size 3. Then Slurm's warning signal to
    the batch step (what --signal=B:USR1@120 sends before the time limit): the run
    checkpoints at that step, the joining job ends with the job's Ray cluster, the job
    requeues itself, and the requeued job (its 2 nodes) resumes from that checkpoint and
    finishes, every sample once. Both in one job: the suite pays one job's start and
    one training run, not two."""
    job = Job(slurm, tmp_path, "-N", "2", "-w", "n1,n2", TRAIN, *overrides(data, *ELASTIC))
    job.wait_for("a registered checkpoint", lambda: job.registered_steps(), timeout=240)
    join = slurm.sbatch("-N", "1", "-w", "n3", "-c", "3", JOIN, job.id, cwd=tmp_path)
    grown = job.wait_for(
        "the group grown to 3",
        lambda: [e for e in job.events("restart") if e["cause"] == "grow"],
        timeout=240,
    )[0]
    job.wait_for("a step at world size 3", lambda: job.last_step() > grown["step"], timeout=120)
    slurm.client("scancel", "--signal=USR1", "--batch", job.id)
    preempted = job.wait_for("the preemption checkpoint", lambda: job.events("preempted"), 120)
    stopped_at = preempted[0]["step"]
    assert preempted[0]["reason"] == "SIGUSR1" and preempted[0]["world_size"] == 3, preempted
    assert slurm.wait_job(join, 120) == "COMPLETED"
    job.wait_for(
        "the requeued job's resume",
        lambda: [e for e in job.events("resume") if e["step"] == stopped_at],
        timeout=300,
    )
    assert job.finish() == "COMPLETED", job.output()[-6000:]
    s = job.summary()
    assert s["world_sizes"] == [2, 3, 2], s["world_sizes"]
    assert [(e["cause"], e["world_size"]) for e in s["events"] if e["event"] == "restart"] == [
        ("grow", 3)
    ]
    # the grow resumed from a periodic checkpoint; the requeued job from the signal's
    resumes = [e["step"] for e in s["events"] if e["event"] == "resume"]
    assert resumes == [grown["step"], stopped_at] and stopped_at > grown["step"], resumes
    assert "Restarts=1" in slurm.client("scontrol", "show", "job", job.id).stdout
    assert_every_sample_once(s, data)
