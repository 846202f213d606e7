"""Checkpoints that cannot be trusted: damaged files, folders deleted by hand, a model
that changed, planted pickle payloads, and staging that a killed save leaves behind.

End to end on a real local Ray cluster (2 workers, DeepSpeed ZeRO-1 on gloo) from one
stopped run copied per test; engine-level checks in a gloo world of 1 (tests/ranks.py)."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import small_overrides, train
from ranks import free_port, start_ranks

from elastic.errors import CheckpointError, RunError
from elastic.train import checkpoint as ckpt
from elastic.train import integrity
from elastic.train.driver import read_events

pytestmark = pytest.mark.slow  # the fast tier: pytest -m 'not slow'

STAGING = ".staging"  # under the run's folder
COMMON = [
    "logger=none",
    "checkpoint.every_steps=2",
    "checkpoint.keep=3",
    "strategy.zero_stage=1",
    "scaling.max_failures=1",  # old code retried a checkpoint error 11 times
]


class _Payload:
    """What an attacker plants: unpickling it creates the marker file (it could run
    anything)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _replant(folder: str, rel: str) -> None:
    """An attacker who rewrites a file can rewrite its manifest entry too: the checksum
    then matches and only the loader stands in the way."""
    for path in glob.glob(os.path.join(folder, "manifest-rank*.json")):
        with open(path) as f:
            manifest = json.load(f)
        if rel in manifest["files"]:
            with open(os.path.join(folder, rel), "rb") as f:
                data = f.read()
            manifest["files"][rel] = {
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
            with open(path, "w") as f:
                json.dump(manifest, f)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


# -- end to end -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def stopped_run(ray_session, small_data, tmp_path_factory):
    """A run stopped at step 6 with checkpoints at steps 2, 4 and 6 (Ray keeps 3)."""
    storage = tmp_path_factory.mktemp("stopped")
    summary = train(
        small_overrides(small_data, storage, *COMMON, "run.name=base", "trainer.stop_at_step=6")
    )
    assert summary["status"] == "stopped" and summary["steps"] == 6
    return storage / "base"


def _copy(stopped_run, tmp_path, name: str) -> str:
    run_dir = tmp_path / name
    shutil.copytree(stopped_run, run_dir)
    return str(run_dir)


def _resume(small_data, tmp_path, name: str, *extra: str) -> dict:
    return train(small_overrides(small_data, tmp_path, *COMMON, f"run.name={name}", *extra))


def test_a_damaged_newest_checkpoint_falls_back_and_a_deleted_one_is_dropped(
    stopped_run, small_data, tmp_path, capsys
):
    """The newest checkpoint deleted by hand (how to drop one), the one before truncated:
    the run warns naming both, resumes from the newest intact one (step 2), moves the
    damaged one aside, trains past them; and the next start resumes as usual. Saves are
    staged under the run, not in /tmp: a save killed halfway (the driver's kill -9)
    leaves its staging folder there, and the next start removes it."""
    run_dir = _copy(stopped_run, tmp_path, "r")
    assert os.listdir(os.path.join(run_dir, STAGING)) == []  # cleaned after saves
    stale = os.path.join(run_dir, STAGING, "ckpt-r0-p99999-killed")
    os.makedirs(os.path.join(stale, "model"))
    with open(os.path.join(stale, "model", "mp_rank_00_model_states.pt"), "wb") as f:
        f.write(b"\0" * 1000)
    shutil.rmtree(os.path.join(run_dir, "step=000000006"))
    _truncate(os.path.join(run_dir, "step=000000004", "model", "mp_rank_00_model_states.pt"))

    summary = _resume(small_data, tmp_path, "r", "trainer.max_steps=8")
    assert summary["status"] == "finished" and summary["steps"] == 8
    assert os.listdir(os.path.join(run_dir, STAGING)) == []
    assert [e["step"] for e in read_events(run_dir) if e["event"] == "resume"] == [2]
    out = capsys.readouterr().out
    assert (
        f"warning: checkpoint {run_dir}/step=000000004 is damaged "
        "(model/mp_rank_00_model_states.pt has" in out
    )
    assert f"moved to {run_dir}/step=000000004.damaged; resuming from step=000000002" in out
    assert f"warning: checkpoint {run_dir}/step=000000006 was deleted: dropped" in out
    assert os.path.isdir(os.path.join(run_dir, "step=000000004.damaged"))
    # steps 4 and 6 were trained and saved again, into fresh folders
    assert integrity.damage(os.path.join(run_dir, "step=000000004")) is None
    assert ckpt.read_state(os.path.join(run_dir, "step=000000006")).step == 6

    again = _resume(small_data, tmp_path, "r", "trainer.max_steps=10")
    assert again["status"] == "finished" and again["steps"] == 10
    assert [e["step"] for e in read_events(run_dir) if e["event"] == "resume"] == [2, 8]
    assert "warning: checkpoint" not in capsys.readouterr().out


def test_no_intact_checkpoint_ends_the_run_in_one_line_changing_nothing(
    stopped_run, small_data, tmp_path
):
    run_dir = _copy(stopped_run, tmp_path, "r")
    for step in (2, 4, 6):
        _truncate(os.path.join(run_dir, f"step={step:09d}", "trainer_state.json"))
    snapshot = os.path.join(run_dir, "checkpoint_manager_snapshot.json")
    before = sorted(os.listdir(run_dir)), _read(snapshot)
    with pytest.raises(RunError) as e:
        _resume(small_data, tmp_path, "r", "trainer.max_steps=8")
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"no intact checkpoint left in {run_dir} (step=000000006: ")
    assert "trainer_state.json has" in message and "new run.name" in message
    # only the empty staging folder went
    assert (sorted([*os.listdir(run_dir), STAGING]), _read(snapshot)) == before


def test_a_checkpoint_for_another_model_ends_the_run_at_once(stopped_run, small_data, tmp_path):
    run_dir = _copy(stopped_run, tmp_path, "r")
    with pytest.raises(RunError) as e:
        _resume(small_data, tmp_path, "r", "trainer.max_steps=8", "model.hidden_dims=[128,64]")
    assert str(e.value) == (
        f"checkpoint {run_dir}/step=000000006 was written for another model (0.weight: "
        "64x32 in the checkpoint, 128x32 configured): use the model config it was trained "
        "with, or a new run.name"
    )
    # no worker group started (the stopped run's is the only one)
    assert len([e for e in read_events(run_dir) if e["event"] == "world_size"]) == 1


def _planted(stopped_run, small_data, tmp_path, plant) -> tuple[str, str, str]:
    """A payload planted by ``plant(newest checkpoint, marker path)``, then a resume:
    the run must end with a RunError and the payload must never have run. Returns the
    run dir, the newest checkpoint and the error's message."""
    run_dir = _copy(stopped_run, tmp_path, "r")
    marker = tmp_path / "payload-ran"
    newest = os.path.join(run_dir, "step=000000006")
    plant(newest, str(marker))
    with pytest.raises(RunError) as e:
        _resume(small_data, tmp_path, "r", "trainer.max_steps=8")
    assert not marker.exists()
    return run_dir, newest, str(e.value)


def test_a_payload_planted_in_a_deepspeed_file_is_refused_before_anything_runs(
    stopped_run, small_data, tmp_path
):
    rel = "model/zero_pp_rank_0_mp_rank_00_optim_states.pt"

    def plant(newest: str, marker: str) -> None:
        torch.save({"optimizer_state_dict": _Payload(marker)}, os.path.join(newest, rel))
        _replant(newest, rel)

    _, newest, message = _planted(stopped_run, small_data, tmp_path, plant)
    assert message.startswith(
        f"checkpoint {newest}: {rel} holds Python objects besides tensors (io.open): "
        "refused to load it"
    )


def test_a_payload_planted_in_the_rng_state_is_refused_by_the_worker(
    stopped_run, small_data, tmp_path
):
    """The RNG state is npz: a payload in it is refused where the worker loads it, the
    run ends at once (no retries) with the worker's one line; a payload in the old
    format's rng-rank0.pt is never read."""

    def plant(newest: str, marker: str) -> None:
        torch.save(_Payload(marker), os.path.join(newest, "rng-rank0.pt"))
        np.savez(os.path.join(newest, "rng-rank0.npz"), torch=np.array([_Payload(marker)]))
        _replant(newest, "rng-rank0.npz")

    run_dir, newest, message = _planted(stopped_run, small_data, tmp_path, plant)
    assert message.startswith(
        f"checkpoint {newest}/rng-rank0.npz is not the RNG state it wrote (ValueError: Object "
        "arrays cannot be loaded when allow_pickle=False): refused to load it"
    )
    # the run ended at its first worker group: no restart
    assert len([e for e in read_events(run_dir) if e["event"] == "world_size"]) == 1


def test_a_replaced_state_file_ends_the_run_in_one_line_naming_it(
    stopped_run, small_data, tmp_path
):
    """A state file replaced by another kind of file (its manifest entry rewritten too):
    a samples bitmap that is no bitmap was a traceback on the driver; an RNG state
    without the RNG's arrays was retried by every worker group (354 s). The RNG file is
    read where the planted payload's is (which shows the run ends there at once)."""
    run_dir = _copy(stopped_run, tmp_path, "r")
    newest = os.path.join(run_dir, "step=000000006")
    for replaced in ("samples.npz", "rng-rank0.npz"):
        np.savez(os.path.join(newest, replaced), other=np.zeros(3))
        _replant(newest, replaced)
    with pytest.raises(RunError) as e:
        _resume(small_data, tmp_path, "r", "trainer.max_steps=8")
    message = str(e.value)
    assert "\n" not in message and "samples.npz" in message and newest in message, message
    assert "resume from another checkpoint" in message, message
    with pytest.raises(CheckpointError) as e:
        ckpt.load_rng(os.path.join(newest, "rng-rank0.npz"))
    assert str(e.value) == (
        f"checkpoint {newest}/rng-rank0.npz is not the RNG state it wrote (KeyError: 'torch "
        "is not a file in the archive'): refused to load it; resume from another checkpoint "
        "(move this one aside) or start a new run.name"
    )


def _verified_steps(run_dir: str) -> list[int]:
    return sorted(
        int(n[5:])
        for n in os.listdir(run_dir)
        if n[5:].isdigit() and integrity.damage(os.path.join(run_dir, n)) is None
    )


def test_a_lost_list_a_torn_record_and_rewritten_data_at_one_resume(
    stopped_run, small_data, tmp_path, capsys
):
    """Three things a crash or a user leaves behind, met by one resume:
    - Ray Train's list of the run's checkpoints cut short: the run started from step 0
      and its worker group deleted every checkpoint, verified ones too. Now the list is
      moved aside and the run resumes from the newest checkpoint that verifies.
    - a history whose last line a full disk cut off: every later resume trained to the
      end, then failed reading it (exit 1, no summary.json). Now it is moved aside.
    - a shard written again with other values, same name and rows (or another
      data.path with the same names): the resume took it without a word. Now it stops
      the resume, unless accepted.
    And NaN rows in the validation split (it gave a "finished" run with null validation
    metrics and no row named): they are left out of validation and named."""
    import math

    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    run_dir = _copy(stopped_run, tmp_path, "r")
    _truncate(os.path.join(run_dir, integrity.RAY_SNAPSHOT))
    history = os.path.join(run_dir, "metrics.jsonl")
    whole = _read(history)
    with open(history, "a") as f:
        f.write('{"step": 7, "train/lo')
    data = tmp_path / "data"
    shutil.copytree(small_data, data)
    shard = sorted((data / "train").glob("*.parquet"))[1]
    table = pq.read_table(shard)
    column = table.column_names.index("y")
    y = table["y"].combine_chunks()
    flipped = type(y).from_arrays(pc.negate(y.flatten()), y.type.list_size)
    pq.write_table(table.set_column(column, "y", flipped), shard)
    (val_shard,) = glob.glob(str(data / "val/*.parquet"))
    table = pq.read_table(val_shard)
    ids = table["sample_id"].to_numpy()
    bad = ids[[3, 40]]
    x = np.stack(table["x"].to_numpy(zero_copy_only=False)).astype(np.float32)
    x[np.isin(ids, bad)] = np.nan
    x_column = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), x.shape[1])
    pq.write_table(table.set_column(table.schema.get_field_index("x"), "x", x_column), val_shard)

    with pytest.raises(RunError) as e:
        _resume(data, tmp_path, "r", "trainer.max_steps=8")
    assert str(e.value) == (
        f"data.path={data}/train changed since checkpoint {run_dir}/step=000000006 was "
        f"written: shard {shard.name} holds other data than when the checkpoint was written "
        "(same name and rows, another footer: other values, or another file); restore the "
        "shards it was trained on to resume, to train on the data as it is now, add "
        "checkpoint.accept_changed_data=true; or start a new run.name"
    )
    summary = _resume(
        data, tmp_path, "r", "trainer.max_steps=8", "checkpoint.accept_changed_data=true"
    )
    assert summary["status"] == "finished" and summary["steps"] == 8
    assert [e["step"] for e in read_events(run_dir) if e["event"] == "resume"] == [6]
    val = summary["val"]
    assert val["rows_left_out"] == 2 and val["samples"] == len(ids) - 2, val
    assert all(math.isfinite(v) for v in val.values()), val
    (event,) = [e for e in summary["events"] if e["event"] == "val_rows_left_out"]
    name = os.path.basename(val_shard)
    assert (
        "2 with a loss that is not finite (nan/inf in the row): "
        f"sample_id {bad[0]} ({name}), {bad[1]} ({name})" in event["detail"]
    ), event
    out = capsys.readouterr().out
    assert "resuming on the data as it is now" in out
    assert f"Ray Train's checkpoint list in {run_dir} is unreadable (" in out
    assert "resuming from the newest checkpoint whose manifests verify, step=000000006" in out
    assert os.path.exists(os.path.join(run_dir, integrity.RAY_SNAPSHOT + ".damaged"))
    assert _verified_steps(run_dir) == [2, 4, 6, 8]  # none lost, the new one registered
    assert integrity.registered_steps(run_dir) == [8]
    assert f"warning: {history}: 1 line(s) that are not whole records (line " in out
    assert _read(history + ".damaged") == '{"step": 7, "train/lo\n'
    assert _read(history).startswith(whole)  # every whole record kept, in order
    assert all(json.loads(line) for line in _read(history).splitlines())


@pytest.mark.parametrize("how", ["missing", "names a missing folder", "not an object"])
def test_a_checkpoint_list_that_cannot_be_used_falls_back_to_the_folders(
    stopped_run, tmp_path, how
):
    from elastic.models.mlp import MLPConfig

    run_dir = _copy(stopped_run, tmp_path, "r")
    path = os.path.join(run_dir, integrity.RAY_SNAPSHOT)
    with open(path) as f:
        snapshot = json.load(f)
    snapshot["latest_checkpoint_result"]["checkpoint_dir_name"] = "step=000000099"
    if how == "missing":
        os.remove(path)
    else:
        with open(path, "w") as f:
            json.dump(None if how == "not an object" else snapshot, f)
    model = MLPConfig(input_dim=32, output_dim=4, hidden_dims=[64, 64])
    resume = integrity.prepare_resume(run_dir, model)
    assert resume.path == os.path.join(run_dir, "step=000000006") and not resume.registered
    assert "resuming from the newest checkpoint whose manifests verify" in resume.warnings[0]
    assert _verified_steps(run_dir) == [2, 4, 6]


def test_a_run_killed_in_its_first_save_starts_afresh_keeping_what_it_wrote(stopped_run, tmp_path):
    """No checkpoint list yet (Ray Train writes it at the first registration) and only a
    half-written folder: the run starts from step 0, the folder moved aside, not deleted
    (and not refused, which would need a new run.name)."""
    from elastic.models.mlp import MLPConfig

    run_dir = _copy(stopped_run, tmp_path, "r")
    os.remove(os.path.join(run_dir, integrity.RAY_SNAPSHOT))
    for step in (4, 6):
        shutil.rmtree(os.path.join(run_dir, ckpt.step_dir_name(step)))
    _truncate(os.path.join(run_dir, "step=000000002", "trainer_state.json"))
    resume = integrity.prepare_resume(run_dir, MLPConfig(input_dim=32, output_dim=4))
    assert resume.path is None and resume.registered
    assert os.path.isdir(os.path.join(run_dir, "step=000000002.damaged"))
    assert resume.warnings[-1] == f"no checkpoint in {run_dir} verifies: the run starts from step 0"


def test_a_full_disk_is_told_apart_from_another_disk_full(tmp_path):
    """ENOSPC while writing the run's own files ends the run; ENOSPC from elsewhere (a
    node's /tmp or /dev/shm) while the run's storage has room stays a failure Ray
    Train retries (a node's trouble, not the run's)."""
    import errno

    error = OSError(errno.ENOSPC, "No space left on device")
    assert ckpt.storage_full(error, str(tmp_path), "saving") is not None
    assert ckpt.storage_full(error, str(tmp_path), "training", wrote=False) is None
    assert ckpt.storage_full(RuntimeError("gloo: connection reset"), str(tmp_path), "x") is None


# -- engine level (no Ray) ------------------------------------------------------------


def _engine_worker(rank: int, stage: int, port: int, root: str, out: str) -> None:
    """Train 2 steps and write a checkpoint; then, per case, restore a copy of it (planted
    with a payload, or not) into a fresh engine and note what happened."""
    import random
    import sys

    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    from elastic.config.schema import DataConfig, StrategyConfig, TrainConfig
    from elastic.errors import CheckpointError
    from elastic.models.mlp import MLPConfig
    from elastic.train.batch import BatchPlan
    from elastic.train.engine import build_engine, init_distributed

    init_distributed(False)
    cfg = TrainConfig(
        model=MLPConfig(input_dim=8, hidden_dims=[16], output_dim=3),
        data=DataConfig(path="unused", global_batch_size=4),
        strategy=StrategyConfig(zero_stage=stage),
    )
    plan = BatchPlan.for_world(4, 1)
    torch.manual_seed(0)
    engine = build_engine(cfg, plan, cfg.model.build())
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
        engine.step()
    saved = os.path.join(root, "saved")
    os.makedirs(saved)
    ckpt.write(engine, ckpt.TrainerState(step=2, world_sizes=[1]), 0, saved)

    def draw() -> list[float]:
        return [torch.rand(1).item(), float(np.random.rand()), random.random()]

    expected = draw()
    cases = ["plain", "deepspeed-model", "rng", "old-rng"]
    if stage:
        cases += ["universal", "deepspeed-optim"]
    results = {}
    for case in cases:
        folder = os.path.join(root, case)
        shutil.copytree(saved, folder)
        marker = folder + ".payload-ran"
        if case.startswith("deepspeed"):
            kind = case.split("-")[1]
            [target] = glob.glob(os.path.join(folder, "model", f"*{kind}_states.pt"))
            torch.save({"module": _Payload(marker)}, target)
        elif case == "rng":
            np.savez(os.path.join(folder, "rng-rank0.npz"), torch=np.array([_Payload(marker)]))
        elif case == "old-rng":  # where RNG state was a pickle
            torch.save(_Payload(marker), os.path.join(folder, "rng-rank0.pt"))
        universal = case == "universal"
        fresh = build_engine(cfg, plan, cfg.model.build(), load_universal=universal)
        result: dict = {}
        try:
            ckpt.restore(fresh, folder, 0, universal=universal)
            result["draws"] = (expected, draw())
            result["global_steps"] = fresh.global_steps
        except CheckpointError as e:
            result["error"] = str(e)
        except Exception as e:  # what the payload did to the loader
            result["other"] = repr(e)
        result["payload_ran"] = os.path.exists(marker)
        results[case] = result
    with open(out, "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip teardown: see tests/reshard_worker.py


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_restore_loads_plain_files_and_never_runs_a_planted_payload(stage, tmp_path):
    """DeepSpeed's files load with weights_only=True (three allow-listed DeepSpeed
    classes) at every ZeRO stage, through the universal conversion too, and the RNG state
    comes back (the random numbers after the restore are those after the save). A payload
    planted in a DeepSpeed file or the RNG state is refused in one line (here without the
    driver's check in front: planted while the run runs); one in the old format's
    rng-rank0.pt is never read."""
    out = str(tmp_path / "results.json")
    start_ranks(_engine_worker, (stage, free_port(), str(tmp_path), out), 1)
    with open(out) as f:
        results = json.load(f)
    for case, result in results.items():
        assert result["payload_ran"] is False, case
        if case in ("plain", "universal", "old-rng"):
            assert "draws" in result, (case, result)
            expected, got = result["draws"]
            assert got == expected and result["global_steps"] == 2, case
        else:
            assert "refused to load it" in result.get("error", ""), (case, result)
            assert "\n" not in result["error"]


def test_a_disk_that_fills_up_during_a_run_ends_it_in_one_line_keeping_the_checkpoint(
    small_data, tmp_path, tmpfs
):
    """The run's filesystem fills while it trains (a real tmpfs, filled to the last
    byte after its first checkpoint): each worker group failed the same way, retried
    (214 s, 11 W&B offline folders). Now one line, no retry, the checkpoint intact."""
    import threading
    import time

    from conftest import fill

    storage = tmpfs("storage", 16 * 1024)
    run_dir = storage / "full"

    def fill_after_a_checkpoint() -> None:
        deadline = time.time() + 300
        while not integrity.registered_steps(str(run_dir)) and time.time() < deadline:
            time.sleep(0.2)
        fill(storage)

    filler = threading.Thread(target=fill_after_a_checkpoint, daemon=True)
    filler.start()
    overrides = small_overrides(
        small_data,
        storage,
        *COMMON,
        "run.name=full",
        "trainer.max_steps=0",
        "trainer.max_epochs=100",
        "scaling.max_failures=3",
    )
    with pytest.raises(RunError) as e:
        train(overrides)
    filler.join()
    message = str(e.value)
    assert "\n" not in message and message.startswith("the run's storage is full ("), message
    assert "it resumes from the last complete checkpoint, which is kept" in message
    kept = integrity.registered_steps(str(run_dir))
    assert kept and all(
        integrity.damage(str(run_dir / ckpt.step_dir_name(s))) is None for s in kept
    )
    # one worker group: not retried (a torn last record, if any, is left out)
    assert len([r for r in read_events(str(run_dir)) if r["event"] == "world_size"]) == 1
