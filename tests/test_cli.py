"""The real entry point, as a user runs it: a subprocess per command."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import small_overrides

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


def test_ctrl_c_stops_cleanly_and_the_same_command_resumes(small_data, tmp_path):
    args = small_overrides(
        small_data,
        tmp_path / "runs",
        "run.name=interrupted",
        "logger=none",
        "trainer.max_steps=400",
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

    # the same command, shorter, resumes from the kept checkpoint and finishes
    args = [a for a in args if not a.startswith("trainer.max_steps")]
    resumed = _cli([*args, "trainer.max_steps=12"], tmp_path)
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    # no warning every few seconds from a Ray helper that needs a dashboard we do not run
    assert "State API may be temporarily unavailable" not in out
    summary_path = out.split("[elastic] summary: ")[1].split()[0]
    summary = json.loads(Path(summary_path).read_text())
    with open(tmp_path / "runs/interrupted/metrics.jsonl") as f:
        resumes = [r["step"] for r in map(json.loads, f) if r.get("event") == "resume"]
    assert len(resumes) == 1 and resumes[0] >= 5 and resumes[0] % 5 == 0
    if resumes[0] < 12:
        assert summary["status"] == "finished" and summary["steps"] == 12
    assert summary["experiment"] == "smoke"
