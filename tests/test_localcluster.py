"""The helpers the end-to-end tests and benchmarks watch runs with
(elastic_harness/localcluster.py): what they read, and that watching costs the run
nothing it does not need."""

from __future__ import annotations

import json
import os
import time

import psutil
import pytest

from elastic.observe.tracking import HISTORY_FILE
from elastic_harness.localcluster import RunFiles, Slowdown


def test_records_are_every_whole_line_so_far_and_a_new_file_starts_over(tmp_path):
    run = RunFiles(tmp_path)
    assert run.records() == []
    history = tmp_path / HISTORY_FILE
    with open(history, "w") as f:
        f.write(json.dumps({"step": 1, "train/loss": 0.5}) + "\n")
        f.write('{"step": 2, "train/lo')  # a line being written
    assert run.records() == [{"step": 1, "train/loss": 0.5}]
    with open(history, "a") as f:
        f.write('ss": 0.4}\n{"event": "epoch_end"}\n')
    assert [r.get("step") for r in run.records()] == [1, 2, None]
    assert run.last_step() == 2 and len(run.events("epoch_end")) == 1
    # what a caller does with the list is its own
    run.records().clear()
    assert len(run.records()) == 3
    # a damaged line: the records end before it, now and later
    with open(history, "a") as f:
        f.write("not json\n" + json.dumps({"step": 3, "train/loss": 0.3}) + "\n")
    assert run.last_step() == 2
    # a new, shorter history (the run folder made again): read from its start
    history.write_text(json.dumps({"step": 7, "train/loss": 0.1}) + "\n")
    assert run.records() == [{"step": 7, "train/loss": 0.1}]
    # a new file in its place, longer than what was read of the old one
    fresh = tmp_path / "fresh.jsonl"
    fresh.write_text("".join(json.dumps({"step": s, "train/loss": 1.0}) + "\n" for s in range(9)))
    os.replace(fresh, history)
    assert [r["step"] for r in run.records()] == list(range(9))
    history.unlink()
    assert run.records() == []


class _Counted(RunFiles):
    def __init__(self, run_dir, exit_at: float) -> None:
        super().__init__(run_dir)
        self.asked, self.exit_at = 0, exit_at

    def exited(self) -> int | None:
        self.asked += 1
        return 3 if time.monotonic() >= self.exit_at else None


def test_a_wait_asks_whether_the_run_ended_twice_a_second_and_names_what_it_waited_for(
    tmp_path,
):
    """A Slurm job's "ended?" is four processes (scontrol in the controller's
    namespace): asked at every 20 ms poll, ~200 processes a second beside the job."""
    run = _Counted(tmp_path, exit_at=time.monotonic() + 1.2)
    with pytest.raises(AssertionError, match=r"run exited \(3\) before step 5"):
        run.wait_for("step 5", lambda: run.last_step() >= 5, poll=0.01)
    assert 2 <= run.asked <= 4, run.asked  # ~1.2 s at 0.5 s: not ~120 polls
    # the predicate's value, at once
    assert _Counted(tmp_path, exit_at=0).wait_for("x", lambda: [1]) == [1]


def test_a_slowdown_spins_only_once_applied():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("slowing one process down needs 2 CPUs")
    me = psutil.Process()
    before = {p.pid for p in me.children()}
    slowdown = Slowdown(busy=2)
    victim = psutil.Popen(["sleep", "30"])
    try:
        assert {p.pid for p in me.children()} == before | {victim.pid}  # whole until then
        slowdown.apply([victim.pid])
        spinners = {p.pid for p in me.children()} - before - {victim.pid}
        assert len(spinners) == 2
        assert all(psutil.Process(p).cpu_affinity() == [slowdown.slow_cpu] for p in spinners)
        assert victim.cpu_affinity() == [slowdown.slow_cpu]
    finally:
        slowdown.stop()
        victim.kill()
        victim.wait()
    assert not [
        p for p in spinners if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
    ]
