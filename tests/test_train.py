"""End to end on a real local Ray cluster: 2 Ray Train workers, real DeepSpeed on gloo,
real Parquet shards, real W&B offline files."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest
from conftest import assert_every_epoch_once, planned_digests, small_overrides, train

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
    """The train split fits data.cache_mb, so each worker keeps every row group it reads
    and later epochs come from its memory; with data.cache_mb=0 every epoch is read
    again through Ray Data. The plan is the same: the same losses to the bit, every
    epoch trained once."""
    common = [
        "trainer.max_steps=0",
        "trainer.max_epochs=3",
        "logger=none",
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


def _records(run_dir) -> dict[int, dict]:
    """The last metrics record of every logged step (a step trained again after a
    restart is logged again; the last one is what the surviving model saw)."""
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "train/loss" in rec:
                out[rec["step"]] = rec
    return out


def test_every_world_size_trains_the_same_batches_and_a_resize_resumes_them(small_data, tmp_path):
    """The global batch is a function of (data, seed, epoch, step) alone: one worker,
    and a run at 3 workers (which do not divide the batch of 64) stopped in the middle
    of its first epoch and resumed at 2, train the same rows at every step (their ids
    digests equal the plan's, computed apart from the runs) with the same loss up to
    fp32 summation order, and every sample of both epochs once."""
    common = [
        "trainer.max_steps=0",
        "trainer.max_epochs=2",
        "logger=none",
        "checkpoint.every_steps=0",
        "data.lanes=12",  # the row order's lanes, fixed: not derived from max_workers
    ]
    one = train(small_overrides(small_data, tmp_path, *common, "scaling.workers=1", "run.name=one"))
    assert one["status"] == "finished" and one["steps"] == 32 and one["world_sizes"] == [1]
    cut = [*common, "run.name=cut"]
    stopped = train(
        small_overrides(small_data, tmp_path, *cut, "scaling.workers=3", "trainer.stop_at_step=7")
    )
    assert stopped["status"] == "stopped" and stopped["world_sizes"] == [3]
    resumed = train(small_overrides(small_data, tmp_path, *cut, "scaling.workers=2"))
    assert resumed["status"] == "finished" and resumed["steps"] == 32
    assert resumed["world_sizes"] == [3, 2]
    assert_every_epoch_once(resumed, small_data / "train", epochs=2, rows=1000)

    planned = planned_digests(small_data / "train", {"global_batch_size": 64, "lanes": 12}, 32)
    by_one, by_cut = _records(tmp_path / "one"), _records(tmp_path / "cut")
    assert {s: r["train/batch_digest"] for s, r in by_one.items()} == planned
    assert {s: r["train/batch_digest"] for s, r in by_cut.items()} == planned
    worst = max(
        abs(by_cut[s]["train/loss"] - by_one[s]["train/loss"]) / abs(by_one[s]["train/loss"])
        for s in planned
    )
    assert worst < 1e-4, worst  # fp32 sums in another order; another batch differs by ~10%

    # any step's samples can be named after the run, without it (a loss spike replayed)
    import subprocess
    import sys

    from elastic.cluster.localcluster import REPO
    from elastic.data.ids import ids_digest

    for step in (5, 20):
        out = subprocess.run(
            [sys.executable, str(REPO / "launch" / "batch.py"), str(tmp_path / "cut"),
             str(step), "--data", str(small_data / "train")],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        batch = json.loads(out.stdout)
        assert (batch["epoch"], batch["step_in_epoch"]) == ((step - 1) // 16, (step - 1) % 16 + 1)
        assert len(set(batch["sample_ids"])) == len(batch["sample_ids"]) == 64
        assert ids_digest(np.array(batch["sample_ids"])) == by_cut[step]["train/batch_digest"]


def test_a_resume_on_shards_that_changed_is_refused_in_one_line(small_data, tmp_path):
    """Shards added, removed or rewritten between a checkpoint and its resume would
    re-map the epoch's rows: the resume ends before Ray starts, naming the shard."""
    import shutil

    from elastic.errors import CheckpointError

    data = tmp_path / "data"
    shutil.copytree(small_data, data)
    run = ["logger=none", "checkpoint.every_steps=0", "run.name=changing"]
    stopped = train(small_overrides(data, tmp_path, *run, "trainer.stop_at_step=3"))
    assert stopped["status"] == "stopped"
    shard = sorted((data / "train").glob("*.parquet"))[-1]
    moved = shutil.move(shard, tmp_path / shard.name)
    with pytest.raises(CheckpointError, match=rf"{shard.name} is gone.*restore the shards"):
        train(small_overrides(data, tmp_path, *run))
    shutil.copy(moved, shard)
    shutil.copy(moved, data / "train" / "part-99999.parquet")
    with pytest.raises(CheckpointError, match="part-99999.parquet is new"):
        train(small_overrides(data, tmp_path, *run))
    os.remove(data / "train" / "part-99999.parquet")
    import pyarrow.parquet as pq

    table = pq.read_table(moved)
    pq.write_table(table.slice(0, table.num_rows - 1), shard)  # one row fewer
    with pytest.raises(CheckpointError, match=rf"{shard.name} holds {table.num_rows - 1} rows"):
        train(small_overrides(data, tmp_path, *run))
    shutil.copy(moved, shard)  # as it was: the run resumes
    mid = small_overrides(data, tmp_path, *run, "data.global_batch_size=32")
    with pytest.raises(CheckpointError, match=r"data.global_batch_size=32 \(was 64\)"):
        train(mid)
    assert train(small_overrides(data, tmp_path, *run))["status"] == "finished"
