"""End to end on a real local Ray cluster: 2 Ray Train workers, real DeepSpeed on gloo,
real Parquet shards, real W&B offline files."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest
from conftest import assert_every_epoch_once, small_overrides, train

from elastic.train.driver import read_events

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]


def _losses(run_dir: str) -> dict[int, float]:
    """Per-step training loss from the run's metrics history (the last record per step)."""
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "train/loss" in rec:
                out[rec["step"]] = rec["train/loss"]
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_trains_checkpoints_and_resumes_exactly(stage, small_data, tmp_path):
    """One epoch of 1,000 rows at a global batch of 64 (16 steps, the last one partial,
    split unevenly over the 2 workers); then the same run stopped at step 5 and resumed:
    it continues bit for bit and trains every sample of the epoch exactly once."""
    common = [
        f"strategy.zero_stage={stage}",
        "trainer.max_steps=0",
        "trainer.max_epochs=1",
        "logger=none",
        "checkpoint.every_steps=3",
        "optim.lr=0.005",
    ]
    one_epoch = [{"epoch": 0, "trained": 1000, "duplicates": 0}]
    full = train(small_overrides(small_data, tmp_path, *common, "run.name=full"))
    assert full["status"] == "finished" and full["steps"] == 16
    assert full["world_sizes"] == [2]
    assert full["epochs_closed"] == one_epoch
    losses = _losses(os.path.join(tmp_path, "full"))
    first, last = (
        np.mean([losses[s] for s in (1, 2, 3)]),
        np.mean([losses[s] for s in (14, 15, 16)]),
    )
    assert last < 0.8 * first, losses
    assert full["val"]["r2"] > 0.2

    stopped = train(
        small_overrides(small_data, tmp_path, *common, "run.name=cut", "trainer.stop_at_step=5")
    )
    assert stopped["status"] == "stopped" and stopped["steps"] == 5
    ckpt_dir = stopped["checkpoint"]
    assert os.path.basename(ckpt_dir) == "step=000000005"
    assert os.path.exists(os.path.join(ckpt_dir, "trainer_state.json"))
    # DeepSpeed state: model (stage 0 keeps the optimizer there too) and ZeRO partitions
    assert glob.glob(os.path.join(ckpt_dir, "model", "*model_states.pt"))
    if stage > 0:
        assert len(glob.glob(os.path.join(ckpt_dir, "model", "*optim_states.pt"))) == 2

    resumed = train(small_overrides(small_data, tmp_path, *common, "run.name=cut"))
    assert resumed["status"] == "finished" and resumed["steps"] == 16
    assert resumed["samples_seen"] == full["samples_seen"] == 1000
    cut_dir = os.path.join(tmp_path, "cut")
    assert [e["step"] for e in read_events(cut_dir) if e["event"] == "resume"] == [5]
    # every sample of the epoch once across the cut: the ledger holds exactly the data
    assert_every_epoch_once(resumed, small_data / "train", epochs=1, rows=1000)

    # same world size, CPU fp32: the resumed run continues bit for bit
    expected, got = _losses(os.path.join(tmp_path, "full")), _losses(cut_dir)
    for step in range(6, 17):
        assert got[step] == expected[step], (step, got[step], expected[step])


def test_wandb_offline_run_holds_the_logged_metrics(small_data, tmp_path):
    from wandb_records import history

    summary = train(
        small_overrides(
            small_data,
            tmp_path,
            "trainer.max_steps=6",
            "logger=wandb",
            "run.name=tracked",
            "trainer.val_every_steps=4",
            "metrics.target='val/r2>=0.9999'",  # out of reach in 6 steps
        )
    )
    # a run that never met its target: recorded, with no time to it
    assert summary["target"] == "val/r2>=0.9999" and summary["time_to_target_s"] is None
    assert summary["val"]["r2"] < 0.9999
    run_dir = summary["wandb_dir"]
    assert run_dir and os.path.basename(run_dir).startswith("offline-run-")
    rows = history(run_dir)
    keys = set().union(*rows)
    for key in (
        "train/loss",
        "train/lr",
        "train/samples_per_s",
        "train/data_wait_share",
        "train/world_size",
        "val/loss",
        "val/r2",
    ):
        assert key in keys, key
    # our step axis (W&B's own _step only grows; a restart logs steps again)
    steps = [r["trainer/step"] for r in rows if "train/loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]
    # validation mid-run (every 4 steps) and at the end
    assert [r["trainer/step"] for r in rows if "val/loss" in r] == [4, 6]
    # the run's start is an event there too
    assert [r["event/world_size/world_size"] for r in rows if "event/world_size" in r] == [2]
    logged = {r["trainer/step"]: r["train/loss"] for r in rows if "train/loss" in r}
    assert logged == _losses(os.path.join(tmp_path, "tracked"))


def test_cached_epochs_train_exactly_as_streamed_ones(small_data, tmp_path):
    """The train split fits data.cache_mb, so epochs after the first come from each
    worker's memory; with data.cache_mb=0 every epoch is read again through Ray Data.
    With the files in shard order every epoch, the same rows in the same order: the same
    losses to the bit, every epoch trained once."""
    common = [
        "trainer.max_steps=0",
        "trainer.max_epochs=3",
        "logger=none",
        "data.shuffle_files=false",
    ]
    runs = {}
    for name, cache in (("cached", "data.cache_mb=512"), ("streamed", "data.cache_mb=0")):
        runs[name] = train(
            small_overrides(small_data, tmp_path, *common, cache, f"run.name={name}")
        )
        assert runs[name]["epochs_closed"] == [
            {"epoch": e, "trained": 1000, "duplicates": 0} for e in range(3)
        ]
    cached, streamed = _losses(tmp_path / "cached"), _losses(tmp_path / "streamed")
    assert len(cached) == runs["cached"]["steps"] >= 3 * 16
    assert cached == streamed
    # a process that trains again and again (a notebook; this suite) keeps no run's
    # Ray Train controller (~400 MB each) once its fit() has returned
    assert _eventually(lambda: not _processes("ray::TrainController")), "controllers left"


@pytest.mark.parametrize("cache", ["cached", "streamed"])
def test_a_resume_in_a_later_epoch_continues_exactly(cache, small_data, tmp_path):
    """Files in a new order every epoch (data.shuffle_files, the default): a run stopped
    in its second epoch and resumed continues bit for bit, whether the later epochs come
    from the worker cache (blocks reordered per epoch) or are read again (the file
    order of the epoch it resumes in); every epoch trained once."""
    common = [
        "trainer.max_steps=0",
        "trainer.max_epochs=3",
        "logger=none",
        "checkpoint.every_steps=0",
        "data.cache_mb=512" if cache == "cached" else "data.cache_mb=0",
    ]
    full = train(small_overrides(small_data, tmp_path, *common, "run.name=full"))
    assert full["steps"] == 48
    cut = [*common, "run.name=cut"]
    stopped = train(small_overrides(small_data, tmp_path, *cut, "trainer.stop_at_step=20"))
    assert stopped["status"] == "stopped" and stopped["steps"] == 20
    resumed = train(small_overrides(small_data, tmp_path, *cut))
    assert resumed["status"] == "finished" and resumed["steps"] == 48
    assert_every_epoch_once(resumed, small_data / "train", epochs=3, rows=1000)
    expected, got = _losses(tmp_path / "full"), _losses(tmp_path / "cut")
    assert [got[s] for s in range(21, 49)] == [expected[s] for s in range(21, 49)]


def _processes(title: str) -> list[int]:
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        if (p.info["cmdline"] or [""])[0].startswith(title):
            found.append(p.pid)
    return found


def _eventually(check, timeout: float = 15.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def test_adjust_policy_keeps_training_where_the_batch_does_not_split(small_data, tmp_path):
    """3 workers cannot split a global batch of 64: scaling.batch_policy=adjust trains
    with 63 and a learning rate scaled by 63/64, and says so in the events."""
    summary = train(
        small_overrides(
            small_data,
            tmp_path,
            "scaling.min_workers=3",
            "scaling.max_workers=3",
            "scaling.batch_policy=adjust",
            "trainer.max_steps=4",
            "logger=none",
            "run.name=adjust",
        )
    )
    assert summary["status"] == "finished" and summary["world_sizes"] == [3]
    [event] = [e for e in summary["events"] if e["event"] == "batch_policy"]
    assert (event["requested_global_batch_size"], event["global_batch_size"]) == (64, 63)
    assert event["lr_scale"] == 63 / 64
    assert summary["samples_seen"] == 4 * 63
    with open(os.path.join(tmp_path, "adjust", "metrics.jsonl")) as f:
        lrs = {json.loads(line).get("train/lr") for line in f} - {None}
    assert lrs == {1e-3 * 63 / 64}
