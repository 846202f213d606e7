"""The batch-allocation bootstrap without a batch system: node lists and launch commands
from recorded Slurm and LSF (Summit-style) environments, the job scripts' syntax, and
the one-line errors. There is no LSF here: the LSF tests run the real node-list and
``jsrun`` logic against recorded environments, and say so. Slurm itself runs for real
in tests/test_slurm.py."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from elastic.cluster import bootstrap
from elastic_harness.localcluster import REPO

SCRIPTS = [
    REPO / "launch" / "slurm" / "train.sbatch",
    REPO / "launch" / "slurm" / "join.sbatch",
    REPO / "launch" / "lsf" / "train.bsub",
]


def summit_env(tmp_path, hosts=("h41n01", "h41n02", "h41n03")) -> dict[str, str]:
    """What LSF gives a Summit batch script (recorded shape): the launch node batch3
    first with one slot, then each compute node with 42 slots."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("batch3\n" + "".join(f"{h}\n" * 42 for h in hosts))
    return {
        "LSB_JOBID": "812345",
        "LSB_DJOB_HOSTFILE": str(hostfile),
        "LSB_MCPU_HOSTS": "batch3 1 " + " ".join(f"{h} 42" for h in hosts),
        "LS_SUBCWD": str(tmp_path),
    }


def test_lsf_summit_nodes_skip_the_launch_node(tmp_path):
    """No LSF here: a recorded Summit environment stands in for a real job."""
    a = bootstrap.allocation(summit_env(tmp_path))
    assert a.scheduler == "lsf" and a.job_id == "812345"
    assert a.nodes == ["h41n01", "h41n02", "h41n03"]
    assert a.submit_dir == str(tmp_path)


def test_lsf_nodes_from_mcpu_hosts_when_there_is_no_hostfile(tmp_path):
    env = summit_env(tmp_path)
    del env["LSB_DJOB_HOSTFILE"]
    assert bootstrap.allocation(env).nodes == ["h41n01", "h41n02", "h41n03"]
    # no launch node listed (every host has the same slots): every host is a node
    env["LSB_MCPU_HOSTS"] = "h41n01 42 h41n02 42"
    assert bootstrap.allocation(env).nodes == ["h41n01", "h41n02"]
    env["LSB_MCPU_HOSTS"] = ""
    with pytest.raises(bootstrap.BootstrapError, match="LSB_MCPU_HOSTS"):
        bootstrap.allocation(env)


def test_lsf_launch_commands_are_whole_node_jsrun_resource_sets():
    """No LSF here: the jsrun command line is checked, not run."""
    cmd = bootstrap.launcher("lsf", 2, ["python", "-m", "elastic.cluster.bootstrap", "node"])
    assert cmd[:1] == ["jsrun"]
    assert "--nrs=2" in cmd and "--rs_per_host=1" in cmd and "--tasks_per_rs=1" in cmd
    assert "--cpu_per_rs=ALL_CPUS" in cmd and "--gpu_per_rs=ALL_GPUS" in cmd
    assert cmd[-4:] == ["python", "-m", "elastic.cluster.bootstrap", "node"]
    assert bootstrap.requeue_cmd("lsf", "812345") == ["brequeue", "812345"]


def test_slurm_launch_skips_the_head_node_and_survives_node_loss():
    cmd = bootstrap.launcher("slurm", 2, ["x"], first=1)
    assert cmd[0] == "srun" and cmd[-1] == "x"
    assert {"--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--relative=1", "--no-kill"} <= set(
        cmd
    )
    assert bootstrap.requeue_cmd("slurm", "7") == ["scontrol", "requeue", "7"]


def test_outside_an_allocation_the_error_says_what_to_do(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LSB_"))}
    out = subprocess.run(
        [sys.executable, "-m", "elastic.cluster.bootstrap", "train", "--", "+experiment=smoke"],
        env=env, cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "no batch allocation found" in lines[0], out.stderr
    assert not (tmp_path / "jobs").exists()  # nothing created


def test_cluster_address_in_the_arguments_is_refused(tmp_path):
    a = bootstrap.Allocation("slurm", "7", ["n1"], str(tmp_path))
    with pytest.raises(bootstrap.BootstrapError, match="cluster.address is set by the job"):
        bootstrap.driver_cmd(["+experiment=smoke", "cluster.address=1.2.3.4:6379"], "", a)
    cmd = bootstrap.driver_cmd(["+experiment=smoke"], "10.0.0.1:10400", a)
    assert cmd[-2:] == ["cluster.address=10.0.0.1:10400", "run.name=slurm-7"]
    # a name the user gave is kept (and a requeue resumes it just the same)
    cmd = bootstrap.driver_cmd(["+experiment=smoke", "run.name=mine"], "10.0.0.1:10400", a)
    assert cmd[-1] == "cluster.address=10.0.0.1:10400"


def test_job_directory_token_is_private_and_fresh_each_start(tmp_path):
    jd = bootstrap.JobDir(tmp_path / "jobs" / "7")
    settings = bootstrap.JobSettings("7", "slurm", ["n1", "n2"], "0-ab")
    jd.create(settings)
    first = jd.token.read_text()
    assert stat.S_IMODE(jd.token.stat().st_mode) == 0o600 and len(first) == 64
    jd.mark("done")
    jd.create(settings)  # a requeued job: a new token, the old marks gone
    assert jd.token.read_text() != first and not jd.marked("done")
    assert json.loads((jd.path / "job.json").read_text())["nodes"] == ["n1", "n2"]
    assert bootstrap.job_dir_for("7", str(tmp_path / "jobs")).path == jd.path
    with pytest.raises(bootstrap.BootstrapError, match="no running elastic job"):
        bootstrap.job_dir_for("8", str(tmp_path / "jobs"))


def test_two_jobs_on_one_node_claim_different_port_blocks():
    base_a, lock_a = bootstrap.claim_ports("1001", "127.0.0.1")
    base_b, lock_b = bootstrap.claim_ports("1001", "127.0.0.1")  # same id hashes the same
    try:
        assert base_a != base_b
        assert abs(base_a - base_b) >= bootstrap.PORT_BLOCK
    finally:
        lock_a.close()  # type: ignore[attr-defined]
        lock_b.close()  # type: ignore[attr-defined]


def test_temp_dir_is_short_for_ray_sockets(monkeypatch):
    monkeypatch.setenv("TMPDIR", "/very/long/" + "x" * 80)
    assert str(bootstrap.temp_dir("123456789", "h41n01")) == "/tmp/ej123456789-h41n01"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_job_scripts_parse_and_pass_shellcheck(script):
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    if shutil.which("shellcheck") is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck is missing: .ci/run installs it")
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    out = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_ray_start_uses_only_the_claimed_ports_and_no_open_dashboard():
    s = bootstrap.JobSettings("7", "slurm", ["n1", "n2"], "0-ab")
    head = bootstrap.ray_start_cmd(s, "10.0.0.1", 12000, Path("/tmp/ej7-n1"))
    ports = [int(a.split("=")[1]) for a in head if a.split("=")[0].endswith("port")]
    assert len(ports) == len(bootstrap.PORT_NAMES) + 2  # + the worker port range
    assert all(12000 <= p < 12000 + bootstrap.PORT_BLOCK for p in ports)
    assert "--include-dashboard=false" in head and "--dashboard-host=127.0.0.1" in head
    assert "--node-ip-address=10.0.0.1" in head and "--head" in head
    node = bootstrap.ray_start_cmd(s, "10.0.0.2", 12200, Path("/t"), "10.0.0.1:12000")
    assert "--address=10.0.0.1:12000" in node and "--head" not in node
    assert not [a for a in node if "dashboard-port" in a or "include-dashboard" in a]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["never joins", "fails to start"])
def test_head_names_the_nodes_that_did_not_join(tmp_path, how):
    """A real Ray head on this machine waits for a node that never comes (or that wrote
    why it could not start): one line naming it, and this job's processes are gone."""
    jd = bootstrap.JobDir(tmp_path / "jobs" / "9")
    host = bootstrap.short_host()
    jd.create(
        bootstrap.JobSettings(
            "9", "slurm", [host, "ghost-node"], "0-ab", wait_s=3, object_store_mb=80
        )
    )
    if how == "fails to start":
        (jd.path / "nodes" / "ghost-node.failed").write_text("ray start failed (exit 1)\n")
    env = {**os.environ, "ELASTIC_NODE_IP": "127.0.0.1"}
    out = subprocess.run(
        [sys.executable, "-m", "elastic.cluster.bootstrap", "head", "--job-dir", str(jd.path)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    error = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(error) == 1 and "ghost-node" in error[0], out.stderr
    if how == "never joins":
        assert "did not join the Ray head within 3s" in error[0]
    else:
        assert "could not start: ghost-node: ray start failed" in error[0]
    assert jd.marked("done")
    assert "stopped this job's" in out.stdout
    assert not bootstrap.temp_dir("9", host).exists()


POOL_PROBE = """
import json, os, sys, time
import psutil, ray
from elastic.cluster import bootstrap
from elastic.cluster.connect import connect
from elastic.config.schema import ClusterConfig, ScalingConfig

# the worker pool elastic gives every node, with a shorter idle time than its 30 s
# (the test would otherwise wait that out)
KEEP_S = float(sys.argv[1])
bootstrap.WORKER_POOL = {**bootstrap.WORKER_POOL,
                         "idle_worker_killing_time_threshold_ms": int(KEEP_S * 1000)}

def task_pid():
    return os.getpid()

def idle_workers():
    me = psutil.Process()
    return [p.pid for p in me.children(recursive=True) if p.name() == "ray::IDLE"]

with connect(ClusterConfig(num_cpus=2), ScalingConfig()):
    time.sleep(5)
    at_start = idle_workers()
    pid = ray.get(ray.remote(task_pid).remote())  # a task: a pooled process runs it
    done = time.monotonic()
    time.sleep(KEEP_S / 2)
    alive_at_half = psutil.pid_exists(pid)
    while psutil.pid_exists(pid) and time.monotonic() - done < KEEP_S + 60:
        time.sleep(0.5)
    monitor = [p for p in psutil.Process().children(recursive=True)
               if any("log_monitor" in a for a in p.cmdline())]
    print(json.dumps({
        "at_start": at_start, "alive_at_half": alive_at_half,
        "gone_after_s": None if psutil.pid_exists(pid) else time.monotonic() - done,
        "monitor_env": {k: v for k, v in monitor[0].environ().items()
                        if k in {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD",
                                 "LOG_NAME_UPDATE_INTERVAL_S"}},
    }))
"""


@pytest.mark.slow
def test_an_embedded_node_keeps_an_idle_task_process_for_a_while_then_lets_it_go(tmp_path):
    """Each idle Ray process takes ~1% of a core (its main thread checks signals every
    10 ms), which a 2-core node takes out of training: elastic's nodes start none ahead
    of need, keep a read task's process 30 s (a pause between reads, a worker group's
    start after the driver's warm-up) and then let it go (Ray's own default keeps it for
    ever while a node holds fewer processes than CPUs, kills it after 1 s idle past
    that). The log monitor lists its folder every 0.5 s, not every 0.1 s. The probe
    keeps elastic's pool settings but an 8 s idle time, so that the suite does not wait
    30 s for the process to go."""
    assert bootstrap.WORKER_POOL["idle_worker_killing_time_threshold_ms"] == 30_000, (
        "the docs (performance.md, data/pipeline.py) say 30 s: change them with it"
    )
    keep_s = 8.0
    env = {k: v for k, v in os.environ.items() if k not in bootstrap.LOG_MONITOR_ENV}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run(
        [sys.executable, "-c", POOL_PROBE, str(keep_s)], env=env, cwd=tmp_path,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["at_start"] == [], f"processes started ahead of need: {got['at_start']}"
    assert got["alive_at_half"], "a read task's process died as soon as it idled"
    assert got["gone_after_s"] is not None, f"an idle task process lived on past {keep_s + 60} s"
    assert keep_s - 1 <= got["gone_after_s"] <= keep_s + 12, got["gone_after_s"]
    assert got["monitor_env"] == bootstrap.LOG_MONITOR_ENV
