"""The real entry point, as a user runs it: a subprocess per command."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import small_overrides

pytestmark = pytest.mark.slow  # the fast tier: pytest -m 'not slow'

REPO = Path(__file__).resolve().parent.parent


def _cli(args: list[str], cwd: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "launch/run.py"), *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, like a terminal job
        **kw,
    )


def test_ctrl_c_stops_cleanly_the_same_command_resumes_and_a_closed_terminal_stops_it(
    small_data, tmp_path
):
    """Ctrl-C ends the run (130) keeping its checkpoints; the same command resumes from
    the newest. Then SIGHUP to the resumed run's process group, as a terminal (or ssh
    session) that closes sends it: it killed the driver at once (exit 129), no
    checkpoint, its Ray left running. Now the run checkpoints where it is and ends with
    75, as on SIGTERM, leaving nothing running."""
    args = small_overrides(
        small_data,
        tmp_path / "runs",
        "run.name=interrupted",
        "logger=none",
        "trainer.max_steps=100000",
        "trainer.max_epochs=0",
        "checkpoint.every_steps=5",
    )
    proc = _cli(args, tmp_path)
    deadline = time.time() + 300
    while not glob.glob(str(tmp_path / "runs/interrupted/step=*")):
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "no checkpoint within 300 s"
        time.sleep(0.5)
    time.sleep(2)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "last complete checkpoint is kept" in out

    # the same command resumes from the kept checkpoint; its terminal closes
    run = Session(_cli(args, tmp_path))
    run.wait_for(lambda: "[elastic] step " in run.out)
    os.killpg(run.proc.pid, signal.SIGHUP)
    assert run.finish() == 75, run.out
    assert "[elastic] SIGHUP: checkpointing now, then stopping" in run.out
    # no warning every few seconds from a Ray helper that needs a dashboard we do not run
    assert "State API may be temporarily unavailable" not in run.out
    summary = json.loads(Path(run.out.split("[elastic] summary: ")[1].split()[0]).read_text())
    with open(tmp_path / "runs/interrupted/metrics.jsonl") as f:
        resumes = [r["step"] for r in map(json.loads, f) if r.get("event") == "resume"]
    assert len(resumes) == 1 and resumes[0] >= 5 and resumes[0] % 5 == 0
    assert summary["status"] == "preempted" and summary["steps"] > resumes[0]
    assert os.path.basename(summary["checkpoint"]) == f"step={summary['steps']:09d}"
    assert summary["experiment"] == "smoke"
    assert run.left_running() == []


class Session:
    """A run started with _cli, its output read as it comes, and every process of its
    process tree seen while it ran (the driver is the subreaper of its Ray cluster)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        import threading

        self.proc = proc
        self.lines: list[str] = []
        self.seen: dict[int, psutil.Process] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def watch(self) -> None:
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(p.pid, p)

    def wait_for(self, what, timeout_s: float = 300) -> None:
        deadline = time.time() + timeout_s
        while not what():
            self.watch()
            assert self.proc.poll() is None, self.out
            assert time.time() < deadline, f"timed out; output:\n{self.out}"
            time.sleep(0.05)

    def finish(self, timeout_s: float = 300) -> int:
        deadline = time.time() + timeout_s
        while self.proc.poll() is None:
            self.watch()
            assert time.time() < deadline, f"still running; output:\n{self.out}"
            time.sleep(0.2)
        time.sleep(0.5)  # the reader thread drains the pipe
        return self.proc.returncode

    def left_running(self, grace_s: float = 10) -> list[str]:
        """This run's processes still alive ``grace_s`` after it ended."""
        deadline = time.time() + grace_s
        while True:
            alive = [f"{p.pid} {_name(p)}" for p in self.seen.values() if _alive(p)]
            if not alive or time.time() > deadline:
                return alive
            time.sleep(0.5)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""


def _catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for ``signum`` (its entry point installs one)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt"))
    return bool(caught >> (signum - 1) & 1)


@pytest.mark.parametrize(
    "signum,moment",
    [
        (signal.SIGTERM, "started"),  # composing the config, before the data and Ray
        (signal.SIGHUP, "started"),  # a closed terminal: it killed the driver (exit 129)
        (signal.SIGUSR1, "[elastic] dataset:"),  # Ray starting
        # inside ray.init(), where Ray's own SIGTERM handler (sys.exit) is in place
        (signal.SIGTERM, "gcs_server"),
        (signal.SIGTERM, "[elastic] connected to"),  # planning the datasets, the trainer
    ],
)
def test_a_stop_signal_during_start_up_exits_75_and_leaves_nothing_running(
    small_data, tmp_path, signum, moment
):
    """A batch script requeues on exit 75: a stop signal at any moment of the start-up
    must end with it (not 134 with a C++ stack dump, not 138 without a word), with Ray
    shut down and none of the run's processes left behind."""
    args = small_overrides(small_data, tmp_path / "runs", "run.name=stopped", "logger=none")
    run = Session(_cli(args, tmp_path))
    if moment == "started":
        run.wait_for(lambda: _catches(run.proc.pid, signum), timeout_s=60)
    elif moment == "gcs_server":
        run.wait_for(lambda: any(_name(p) == moment for p in list(run.seen.values())))
    else:
        run.wait_for(lambda: moment in run.out)
    run.proc.send_signal(signum)
    rc = run.finish()
    name = signal.Signals(signum).name
    assert rc == 75, run.out
    # stopped where start-up was; or, when the signal lands once the fit has begun
    # (a loaded machine may get there first), the fit's own stop: checkpoint, then 75
    assert f"[elastic] {name}: stopped" in run.out or (
        f"[elastic] {name}: checkpointing now, then stopping" in run.out
        and "[elastic] preempted: run the same command" in run.out
    ), run.out
    assert "Traceback" not in run.out
    assert run.left_running() == []
    assert not glob.glob(f"/tmp/elastic-ray-{run.proc.pid}"), "the cluster's files are left"


def test_a_stop_signal_while_no_group_can_start_ends_the_run_at_once(
    small_data, tmp_path, cpus_held
):
    """SIGTERM while Ray Train retries a worker group's start (no node has room: the
    session cluster's CPUs are held by another actor): it printed "checkpointing now"
    and was then ignored. With no group up there is nothing newer than the last
    checkpoint: the run ends, 75."""
    import ray

    address = ray.get_runtime_context().gcs_address
    args = small_overrides(small_data, tmp_path / "runs", "run.name=unplaced", "logger=none")
    run = Session(_cli([*args, f"cluster.address={address}"], tmp_path))
    run.wait_for(lambda: "Attempting to start training worker group" in run.out)
    time.sleep(3)  # its start is being retried
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish(timeout_s=60) == 75, run.out  # not a hang
    assert "[elastic] SIGTERM: stopped; the last complete checkpoint" in run.out, run.out


def test_a_run_started_with_nohup_keeps_ignoring_a_hang_up(small_data, tmp_path):
    """``nohup`` ignores SIGHUP for a run meant to outlive its terminal: the entry point
    must leave it so (acting on it would stop the run when the ssh session closes)."""
    args = small_overrides(small_data, tmp_path / "runs", "run.name=nohup", "logger=none")
    proc = _cli(args, tmp_path, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    run = Session(proc)
    run.wait_for(lambda: _catches(proc.pid, signal.SIGTERM), timeout_s=60)
    with open(f"/proc/{proc.pid}/status") as f:
        ignored = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn"))
    assert ignored >> (signal.SIGHUP - 1) & 1, "SIGHUP is no longer ignored"
    assert not _catches(proc.pid, signal.SIGHUP)
    proc.send_signal(signal.SIGTERM)
    assert run.finish() == 75, run.out
