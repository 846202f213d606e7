"""The data path around the plan: streaming bigger-than-memory data through the real
entry point, the cache decision, the validation split's shares."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import own_processes


@pytest.mark.slow
def test_a_dataset_four_times_the_object_store_streams_through(tmp_path):
    """410 MB of decoded rows through a 100 MB object store (the real entry point, its
    own embedded Ray): blocks stream and are released; every row trains once."""
    import json
    import subprocess
    import sys

    from elastic.config.schema import DataConfig
    from elastic.data.shards import check_dataset
    from elastic.datasets.synthetic import generate
    from elastic_harness.localcluster import REPO

    generate(str(tmp_path / "big"), None, 50_000, 0, 40, 2048, 4, seed=0)
    size = check_dataset(DataConfig(path=str(tmp_path / "big")))["train"].bytes
    store_mb = 100
    assert size >= 4 * store_mb * 1024 * 1024
    cmd = [
        sys.executable, str(REPO / "launch" / "run.py"), "+experiment=smoke",
        f"data.path={tmp_path}/big", "data.val_path=null", "model.input_dim=2048",
        "model.hidden_dims=[32]", "model.output_dim=4", "data.global_batch_size=500",
        "trainer.max_steps=0", "trainer.max_epochs=1", "data.cache_mb=0",
        "data.prefetch_mb=32", f"cluster.object_store_memory_mb={store_mb}", "logger=none",
        "checkpoint.every_steps=0", f"run.storage_path={tmp_path}/runs",
        f"hydra.run.dir={tmp_path}/out",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["samples_seen"] == 50_000
    assert summary["epochs_closed"] == [{"epoch": 0, "trained": 50_000, "duplicates": 0}]
    assert summary["samples_exactly_once"] is True


def test_the_cache_decision_counts_decoded_bytes(tmp_path):
    """The train split is cached in the workers only when what the cache would hold (the
    decoder's output, a worker may meet every row group over the epochs) fits
    data.cache_mb: contact maps are held packed (their bits, unpacked a step at a time),
    not as the float32 maps the model gets (32x more)."""
    from elastic.config.compose import compose
    from elastic.config.validate import to_typed
    from elastic.data.pipeline import decoded_bytes, fits_cache
    from elastic.data.shards import check_dataset
    from elastic.datasets.protein import synthetic

    synthetic(tmp_path / "p", frames=400, shards=2)
    cfg, _ = compose(["+experiment=protein_cvae", f"data.path={tmp_path}/p", "data.val_path=null"])
    data = to_typed(cfg).data
    split = check_dataset(data)["train"]
    decoded = decoded_bytes(data, split)
    width = 214 * 213 // 2  # the upper triangle's bits
    # a row: its packed map, its sample id (int64) and its label (float32)
    assert decoded == 400 * ((width + 7) // 8 + 8 + 4)
    data.cache_mb = decoded / 2**20 * 0.9  # a tenth short
    assert not fits_cache(data, split)
    data.cache_mb = decoded / 2**20 * 1.1
    assert fits_cache(data, split)


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_each_validation_row_is_read_by_exactly_one_worker(tmp_path, world):
    """The workers' shares of the validation split (each reads its own, no Ray Data)
    together hold every row of the split once, decoded as the train split is, and every
    worker has a share where there are row groups enough."""
    import pyarrow.parquet as pq

    from elastic.config.schema import DataConfig
    from elastic.data.shards import check_dataset
    from elastic.data.stream import val_blocks
    from elastic.datasets.synthetic import generate

    generate(str(tmp_path / "train"), str(tmp_path / "val"), 512, 1100, 4, 8, 3, seed=1)
    for path in (tmp_path / "val").glob("*.parquet"):  # several row groups per file
        pq.write_table(pq.read_table(path), path, row_group_size=100)
    cfg = DataConfig(path=str(tmp_path / "train"), val_path=str(tmp_path / "val"))
    files = check_dataset(cfg)["val"].files
    assert len(files) == 4
    table = pq.read_table(tmp_path / "val")
    expected = dict(zip(table["sample_id"].to_pylist(), table["y"].to_pylist(), strict=True))
    got: dict[int, list] = {}
    for rank in range(world):
        rows = 0
        for block in val_blocks(cfg, files, rank, world):
            assert block["x"].shape == (len(block["sample_id"]), 8)
            for i, y in zip(block["sample_id"].tolist(), block["y"].tolist(), strict=True):
                assert i not in got, f"row {i} read twice"
                got[i] = y
            rows += len(block["sample_id"])
        assert rows > 0, f"rank {rank} of {world} read nothing"
    assert len(expected) == 1100 and got.keys() == expected.keys()
    assert all(np.allclose(got[i], expected[i]) for i in expected)


@pytest.mark.slow
def test_the_warm_up_starts_the_processes_the_worker_groups_reads_run_in(
    small_data, ray_session, tmp_path, monkeypatch
):
    """Ray runs a task only in a process of its own runtime env, and kills an idle one
    past the node's soft limit: the driver's warm-up must start processes of the Ray
    Train workers' env (not the job's), and they must outlive an idle pause, else each
    worker group's first reads wait for new processes (seconds each). Fails with the
    warm-up in the job's env, and with Ray's default soft limit (warm processes killed),
    and with the warm-up blind to the variable the trainer sets (Ray Train's own drain
    watcher off), as the driver orders them: the warm-up first."""
    import time

    import psutil
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from elastic.config.compose import compose
    from elastic.config.validate import to_typed
    from elastic.data.pipeline import warm_up
    from elastic.data.shards import list_shards
    from elastic.train.trainer import interruptible

    def task_process(config: dict) -> None:
        """A Ray Train worker that waits past Ray's idle-process kill (1 s), then runs a
        task the way its Ray Data reads do (no runtime env of its own): in which process?"""
        import time

        import ray
        import ray.train

        from elastic.data.pipeline import _import_decoder

        time.sleep(3)
        pid = ray.get(ray.remote(_import_decoder).remote(config["data"], config["file"], 0.5))
        rank = ray.train.get_context().get_world_rank()
        with open(f"{config['out']}/{rank}", "w") as f:
            f.write(str(pid))

    from elastic.cluster import ray_internals

    _, _, switch = ray_internals.preemption_watcher()
    monkeypatch.delenv(switch, raising=False)  # as in a fresh driver (the session is shared)
    cfg, _ = compose(["+experiment=smoke", f"data.path={small_data}/train"])
    data = to_typed(cfg).data
    files = list_shards(data.path)
    warm = warm_up(data, files, (0, 0), processes=2)
    warm.join()
    assert len(set(warm.pids)) == 2, warm.pids
    before = {p.pid for p in psutil.Process().children(recursive=True)}

    # the product's trainer: its workers' env is what the warm-up must match (its own
    # drain watcher turns Ray Train's off, through a variable the workers inherit)
    trainer = interruptible(TorchTrainer)(
        task_process,
        train_loop_config={"data": data, "file": files[0], "out": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="warm", storage_path=str(tmp_path / "ray")),
        torch_config=TorchConfig(backend="gloo"),
    )
    trainer.fit()  # and ends its controller actor (the session is shared)
    used = {int((tmp_path / str(rank)).read_text()) for rank in (0, 1)}
    assert used <= before, f"the workers' tasks started processes {used - before}"
    assert all(psutil.pid_exists(p) for p in warm.pids)
    deadline = time.monotonic() + 15
    while own_processes("ray::TrainController"):
        assert time.monotonic() < deadline, "the test's Ray Train controller is left"
        time.sleep(0.5)


def test_splits_that_work_but_not_as_meant_are_warned_of(tmp_path):
    """A training split smaller than one global batch trained smaller batches without a
    word; a split with fewer row groups than workers leaves workers without rows."""
    from elastic.config.schema import DataConfig
    from elastic.data.shards import check_dataset, split_warnings
    from elastic.datasets.synthetic import generate

    generate(str(tmp_path / "train"), str(tmp_path / "val"), 48, 16, 1, 8, 1, seed=0)
    cfg = DataConfig(
        path=str(tmp_path / "train"), val_path=str(tmp_path / "val"), global_batch_size=64
    )
    warnings = split_warnings(cfg, 2, check_dataset(cfg))
    assert len(warnings) == 3, warnings
    assert "holds 48 rows, fewer than data.global_batch_size=64" in warnings[0]
    assert f"data.path={tmp_path / 'train'} has 1 row group(s) for up to 2 workers" in warnings[1]
    assert f"data.val_path={tmp_path / 'val'} has 1 row group(s)" in warnings[2]
    assert "the others have no validation rows" in warnings[2]
    cfg.global_batch_size = 48
    assert len(split_warnings(cfg, 1, check_dataset(cfg))) == 0


def test_a_resume_checks_the_data_by_name_rows_and_footer(tmp_path):
    """What a resume accepts of the data it finds, against the checkpoint's record:
    other values in a shard of the same name and rows stopped nothing before; with
    checkpoint.accept_changed_data they are taken anywhere, a changed layout only at an
    epoch's end; a checkpoint from before records were kept is refused mid-epoch,
    naming its folder in full (it named only step=N)."""
    import pyarrow.parquet as pq

    from elastic.config.schema import DataConfig
    from elastic.data.order import Layout
    from elastic.data.reader import data_record
    from elastic.data.shards import check_dataset
    from elastic.datasets.synthetic import generate
    from elastic.errors import CheckpointError
    from elastic.train.checkpoint import TrainerState
    from elastic.train.driver import check_resume_data

    generate(str(tmp_path / "train"), None, 256, 0, 2, 4, 1, seed=0)
    cfg = DataConfig(path=str(tmp_path / "train"), global_batch_size=32)

    def record() -> dict:
        split = check_dataset(cfg)["train"]
        return data_record(cfg, split.files, Layout(split.row_groups))

    saved = record()
    mid, end = (
        TrainerState(step=3, data=saved),
        TrainerState(step=8, epoch_start_step=8, data=saved),
    )
    ckpt = str(tmp_path / "runs/r/step=000000003")
    assert check_resume_data(mid, record(), cfg.path, ckpt) is None  # the same data
    shard = sorted((tmp_path / "train").glob("*.parquet"))[1]
    table = pq.read_table(shard)
    pq.write_table(table.set_column(2, "y", table["y"].take(list(range(len(table)))[::-1])), shard)
    now = record()
    with pytest.raises(CheckpointError, match=f"shard {shard.name} holds other data"):
        check_resume_data(mid, now, cfg.path, ckpt)
    warning = check_resume_data(mid, now, cfg.path, ckpt, accept_changed=True)
    assert warning is not None and "resuming on the data as it is now" in warning
    shard.unlink()  # a shard gone: the epoch's plan changes
    now = record()
    with pytest.raises(CheckpointError, match="resume from a checkpoint at an epoch's end"):
        check_resume_data(mid, now, cfg.path, ckpt, accept_changed=True)
    assert check_resume_data(end, now, cfg.path, ckpt, accept_changed=True) is not None
    legacy = TrainerState(step=3)  # no data record
    with pytest.raises(CheckpointError, match=f"checkpoint {ckpt} was written before batches"):
        check_resume_data(legacy, now, cfg.path, ckpt)
