"""One start of a run at a time: a second start of the same run.name is refused in one
line naming the first; a dead start's lock is taken over."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from conftest import small_overrides

from elastic.train.runlock import LOCK_FILE, run_lock

REPO = Path(__file__).resolve().parent.parent
HOLD = (
    "import sys, time\n"
    "from elastic.train.runlock import run_lock\n"
    "with run_lock(sys.argv[1]):\n"
    "    print('held', flush=True)\n"
    "    time.sleep(120)\n"
)


def _holder(run_dir: Path) -> subprocess.Popen:
    """Another process that holds the run's lock (as a running driver does)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_start_of_a_running_run_is_refused_naming_the_first(small_data, tmp_path):
    """Two starts of one run.name: the second resumed from the first's checkpoint while
    the first ran, deleted its newest checkpoint as stale, and crashed."""
    run_dir = tmp_path / "runs" / "twice"
    checkpoint = run_dir / "step=000000150"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.pt").write_bytes(b"the first run's")
    first = _holder(run_dir)
    try:
        args = small_overrides(
            small_data, tmp_path / "runs", "run.name=twice", "logger=none", "trainer.max_steps=2"
        )
        proc = subprocess.run(
            [sys.executable, str(REPO / "launch/run.py"), *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        first.kill()
        first.wait()
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert len(lines) == 1, lines
    assert f"run {run_dir} is in use by another start of it (pid {first.pid} on " in lines[0]
    assert socket.gethostname() in lines[0] and "use another run.name" in lines[0]
    assert "connected to" not in proc.stdout
    assert (checkpoint / "model.pt").read_bytes() == b"the first run's"


def test_the_lock_of_a_killed_start_is_taken_over_and_said(tmp_path):
    first = _holder(tmp_path)
    first.send_signal(signal.SIGKILL)  # no clean-up: the file still names it
    first.wait()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == first.pid
    with run_lock(str(tmp_path)) as taken:
        assert taken is not None and f"left locked by pid {first.pid}" in taken, taken
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    # a clean end leaves the file empty: the next start takes it without a word
    assert (tmp_path / LOCK_FILE).read_text() == ""
    with run_lock(str(tmp_path)) as taken:
        assert taken is None
