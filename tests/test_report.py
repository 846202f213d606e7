"""The seed studies' metrics: time to a target metric, a scaling sweep (Hydra multirun,
the real command line) and its report with figures, the driver's progress display."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from conftest import FAST_POLL

from elastic.errors import ConfigError
from elastic.observe.metrics import (
    parse_target,
    read_records,
    run_seconds,
    sessions,
    time_to_target,
)
from elastic.observe.progress import DriverProgress
from elastic_harness.localcluster import REPO


def test_target_parses_and_bad_targets_say_how_to_write_one():
    t = parse_target("val/accuracy>=0.9")
    assert (t.key, t.op, t.value) == ("val/accuracy", ">=", 0.9)
    assert t.met(0.9) and not t.met(0.89)
    assert parse_target("val/loss <= 1e-3").met(0.0005)
    for bad in ("val/accuracy=0.9", "accuracy>=0.9", "val/accuracy>=high", ""):
        with pytest.raises(ConfigError, match=r"metrics.target=.*METRIC>=NUMBER"):
            parse_target(bad)


def test_run_time_counts_sessions_not_the_queue_between_them():
    """A run stopped at t=100 and re-run at t=1000 (a requeued job): the target met at
    t=1030 took 100 + 30 s of the run's time."""
    records = [
        {"event": "session_start", "time": 0.0},
        {"step": 5, "time": 50.0, "val/accuracy": 0.5},
        {"event": "session_end", "time": 100.0},
        {"event": "session_start", "time": 1000.0},
        {"step": 10, "time": 1030.0, "val/accuracy": 0.95},
        {"step": 15, "time": 1060.0, "val/accuracy": 0.97},
    ]
    assert sessions(records) == [(0.0, 100.0), (1000.0, 1060.0)]
    assert run_seconds(sessions(records), 1060.0) == 160.0
    assert time_to_target(records, parse_target("val/accuracy>=0.9")) == 130.0
    assert time_to_target(records, parse_target("val/accuracy>=0.99")) is None
    # a validation that left rows out (their loss not finite) is not the split's metric:
    # it does not meet a target
    records[4]["val/rows_left_out"] = 3
    assert time_to_target(records, parse_target("val/accuracy>=0.9")) == 160.0


def test_a_history_cut_off_is_repaired_at_the_next_start_keeping_every_record(tmp_path):
    """A last line cut off (a full disk) is moved to metrics.jsonl.damaged; a whole last
    record that only lost its newline is kept and ended; a line of garbage in the middle
    is moved too, named by its number."""
    from elastic.observe.metrics import repair_records

    history = tmp_path / "metrics.jsonl"
    history.write_text('{"step": 1}\n{"step": 2}')
    assert repair_records(str(tmp_path)) is None
    assert [r["step"] for r in read_records(str(tmp_path))] == [1, 2]
    assert history.read_text() == '{"step": 1}\n{"step": 2}\n'
    history.write_text('{"step": 1}\n\x00\x00garbage\n{"step": 3}\n{"step": 4, "lo')
    warning = repair_records(str(tmp_path))
    assert warning is not None and "2 line(s) that are not whole records (line 2, 4:" in warning
    assert history.read_text() == '{"step": 1}\n{"step": 3}\n'
    assert (tmp_path / "metrics.jsonl.damaged").read_text() == '\x00\x00garbage\n{"step": 4, "lo\n'
    assert repair_records(str(tmp_path)) is None  # whole now: nothing more to say


def test_progress_bar_on_a_terminal_shows_step_eta_world_and_loss():
    out = io.StringIO()
    bar = DriverProgress(20, "bar", out=out)
    for step, world in ((4, 2), (12, 1)):
        bar.update({"step": step, "epoch": 0, "loss": 0.25, "world": world, "samples_per_s": 900.0})
    bar.close()
    text = out.getvalue()
    assert "12/20" in text and "world 1" in text and "loss 0.25" in text and "eta" in text


@pytest.mark.slow
def test_a_scaling_sweep_and_its_report(small_data, tmp_path, ray_session):
    """``-m scaling.workers=1,2`` with a target metric: each run records its time to
    target (checked against its own history), the driver prints plain progress lines
    with the ETA (no terminal), and report.py turns the sweep into tables whose numbers
    are the runs' and valid PNG figures. On the session's Ray (``cluster.address``): a
    sweep's jobs each start an embedded cluster otherwise, which other tests cover."""
    import ray

    address = ray.get_runtime_context().gcs_address
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable, str(REPO / "launch/run.py"), "-m", "+experiment=smoke",
        f"data.path={small_data}/train", f"data.val_path={small_data}/val",
        "model.input_dim=32", "model.output_dim=4", "model.hidden_dims=[64,64]",
        "data.global_batch_size=64", "scaling.workers=1,2", "trainer.max_steps=0",
        "trainer.max_epochs=2", "trainer.val_every_steps=4", "trainer.log_every_steps=2",
        "metrics.target=val/r2>=0.1", "optim.lr=0.005", "logger=none",
        "trainer.progress=plain", "trainer.progress_every_s=0.01",
        f"run.storage_path={tmp_path}/runs", f"hydra.sweep.dir={sweep}", FAST_POLL,
        f"cluster.address={address}",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    progress = [line for line in out.stdout.splitlines() if "[elastic] progress:" in line]
    assert any("world 1" in line for line in progress), out.stdout[-3000:]
    assert any("world 2" in line and "/32 (" in line and "eta" in line for line in progress)

    summaries = {}
    for job in ("0", "1"):
        s = json.loads((sweep / job / "summary.json").read_text())
        summaries[s["world_sizes"][0]] = s
        assert s["target"] == "val/r2>=0.1"
        records = read_records(s["run_dir"])
        start = next(r["time"] for r in records if r.get("event") == "session_start")
        hit = next(r for r in records if r.get("val/r2", -1) >= 0.1)
        assert s["time_to_target_s"] == pytest.approx(hit["time"] - start, abs=1e-6)
        assert 0 < s["time_to_target_s"] < s["run_s"]
        # the same run's records against a target it never met
        assert time_to_target(records, parse_target("val/r2>=1.5")) is None
    assert sorted(summaries) == [1, 2]
    # each job its own run (not a resume of the job before it), named after the job
    assert [summaries[w]["run_dir"][-2:] for w in (1, 2)] == ["-0", "-1"]
    assert all(s["samples_seen"] == 2000 and s["steps"] == 32 for s in summaries.values())

    rep = subprocess.run(
        [sys.executable, str(REPO / "launch/report.py"), str(sweep)], capture_output=True, text=True
    )
    assert rep.returncode == 0, rep.stderr
    tables = json.loads((sweep / "report.json").read_text())
    tp = {r["world_size"]: r for r in tables["throughput"]}
    for w in (1, 2):
        assert tp[w]["samples_per_s"] == summaries[w]["samples_per_s"]
    rate1, rate2 = summaries[1]["samples_per_s"], summaries[2]["samples_per_s"]
    assert tp[2]["scaling_efficiency"] == pytest.approx(rate2 / rate1 / 2)
    learn = {r["world_size"]: r for r in tables["learning"]}
    assert learn[2]["time_to_target_s"] == summaries[2]["time_to_target_s"]
    assert learn[2]["learning_speedup"] == pytest.approx(
        summaries[1]["time_to_target_s"] / summaries[2]["time_to_target_s"]
    )
    shares = {r["world_size"]: r for r in tables["breakdown"]}
    assert shares[2]["backward"] == summaries[2]["time_breakdown"]["backward"]
    md = (sweep / "report.md").read_text()
    assert f"| 2 | 1 | {rate2:,.0f} |" in md
    import matplotlib.image

    for name in ("throughput", "time_breakdown", "val_vs_time", "speedup"):
        image = matplotlib.image.imread(sweep / f"{name}.png")
        assert image.shape[0] > 200 and image.shape[1] > 300, name
        assert f"![{name}.png]({name}.png)" in md

    missing = subprocess.run(
        [sys.executable, str(REPO / "launch/report.py"), str(tmp_path / "nowhere")],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'nowhere'} does not exist: give a multirun or run directory"
    ]


def test_repeats_are_averaged_with_their_spread(tmp_path):
    """Two seeds at each world size (summary files as runs write them): the report's
    rows are the means, the spreads are the sample standard deviations, and a run that
    never reached the target counts in runs but not in reached."""
    from elastic.observe.report import find_runs, tables

    runs = {
        "a": (1, 100.0, 50.0),
        "b": (1, 120.0, 70.0),
        "c": (2, 180.0, 30.0),
        "d": (2, 200.0, None),
    }
    for name, (world, rate, ttt) in runs.items():
        (tmp_path / name).mkdir()
        summary = {
            "run_name": name,
            "experiment": "x",
            "world_sizes": [world],
            "samples_per_s": rate,
            "time_to_target_s": ttt,
            "target": "val/accuracy>=0.9",
            "val": {"accuracy": 0.9},
            "time_breakdown": {"data_wait": 0.1, "backward": 0.5},
        }
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    rows = tables(find_runs([str(tmp_path)]))
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "summary.json").write_text('{"steps": 3')  # a damaged file
    with pytest.raises(ValueError, match=r"e/summary.json is not a readable summary.json"):
        find_runs([str(tmp_path)])
    one, two = rows["throughput"]
    assert (one["samples_per_s"], two["samples_per_s"]) == (110.0, 190.0)
    assert one["samples_per_s_std"] == pytest.approx(14.1421356)
    assert two["scaling_efficiency"] == pytest.approx(190 / 110 / 2)
    learn = rows["learning"]
    assert [(r["runs"], r["reached"]) for r in learn] == [(2, 2), (2, 1)]
    assert learn[1]["learning_speedup"] == pytest.approx(60.0 / 30.0)
