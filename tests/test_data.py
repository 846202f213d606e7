"""The per-epoch shuffle each worker applies to its rows: deterministic from
(data.seed, epoch, rank), new every epoch, lossless."""

from __future__ import annotations

import numpy as np
import pytest

from elastic.data.stream import shuffled


def blocks(n_blocks: int = 10, rows: int = 37):
    """A worker's blocks as Ray Data hands them over: ids in order, a payload column."""
    for b in range(n_blocks):
        ids = np.arange(b * rows, (b + 1) * rows, dtype=np.int64)
        yield {"sample_id": ids, "x": ids[:, None] * 2.0, "y": ids % 3}


def order(buffer_rows: int, seed: int, epoch: int, rank: int = 0) -> np.ndarray:
    out = list(shuffled(blocks(), buffer_rows, seed, epoch, rank))
    for b in out:  # rows keep their payload
        np.testing.assert_array_equal(b["x"][:, 0], b["sample_id"] * 2.0)
        np.testing.assert_array_equal(b["y"], b["sample_id"] % 3)
    return np.concatenate([b["sample_id"] for b in out])


def test_same_seed_and_epoch_same_order_next_epoch_another():
    first = order(100, seed=7, epoch=3)
    np.testing.assert_array_equal(first, order(100, seed=7, epoch=3))
    assert not np.array_equal(first, order(100, seed=7, epoch=4))
    assert not np.array_equal(first, order(100, seed=8, epoch=3))
    assert not np.array_equal(first, order(100, seed=7, epoch=3, rank=1))


def test_every_row_exactly_once_and_really_mixed():
    ids = order(100, seed=0, epoch=0)
    np.testing.assert_array_equal(np.sort(ids), np.arange(370))
    assert not np.array_equal(ids, np.arange(370))
    # rows travel further than one block: the buffer mixes across blocks
    first_step = ids[:64]
    assert len(np.unique(first_step // 37)) >= 3
    # a buffer larger than the share shuffles the whole share
    whole = order(10_000, seed=0, epoch=0)
    np.testing.assert_array_equal(np.sort(whole), np.arange(370))
    assert whole[-1] != 369 or whole[0] != 0


def test_zero_buffer_keeps_the_shard_order():
    np.testing.assert_array_equal(order(0, seed=0, epoch=0), np.arange(370))


@pytest.mark.slow
def test_a_dataset_four_times_the_object_store_streams_through(tmp_path):
    """410 MB of decoded rows through a 100 MB object store (the real entry point, its
    own embedded Ray): blocks stream and are released; every row trains once."""
    import json
    import subprocess
    import sys

    from elastic.cluster.localcluster import REPO
    from elastic.config.schema import DataConfig
    from elastic.data.shards import check_dataset
    from elastic.datasets.synthetic import generate

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


def _epochs_as_read(train_dir, shuffle_files: bool, first_epoch: int, epochs: int):
    """Each epoch of a 2-worker streaming split of the train shards, as the workers read
    it (a fresh split whose first execution counts as ``first_epoch``, as after a
    resume): a list per epoch of each worker's sample ids, in order."""
    import threading

    from elastic.config.schema import DataConfig
    from elastic.data.pipeline import build_datasets, data_config
    from elastic.data.shards import check_dataset

    cfg = DataConfig(path=str(train_dir), seed=5, shuffle_files=shuffle_files)
    datasets = build_datasets(cfg, check_dataset(cfg)["train"], max_workers=2)
    splits = data_config(lambda: first_epoch).configure(datasets, 2, None, None)
    seen = []
    for _ in range(epochs):
        ids: list[list[int]] = [[], []]

        def read(rank: int, ids=ids) -> None:
            for b in splits[rank]["train"].iter_batches(batch_size=None):
                ids[rank] += b["sample_id"].tolist()

        threads = [threading.Thread(target=read, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seen.append(ids)
    return seen


@pytest.mark.slow
def test_file_order_is_fixed_by_seed_and_epoch_and_new_every_epoch(small_data, ray_session):
    """data.shuffle_files: Ray Data reads the shards in an order fixed by (data.seed,
    epoch); a split that starts at epoch 1 (a resume) reads epoch 1's order; every row
    of every epoch exactly once over the two workers."""
    rows = 1000
    run = _epochs_as_read(small_data / "train", True, first_epoch=0, epochs=3)
    for epoch in run:
        assert sorted(epoch[0] + epoch[1]) == list(range(rows))
    files = [_file_order(epoch) for epoch in run]
    assert len({repr(f) for f in files}) == 3, files  # a new order every epoch
    assert any(w != sorted(w) for f in files for w in f), files
    # what a worker reads depends on the epoch only, not on where the split started
    resumed = _epochs_as_read(small_data / "train", True, first_epoch=1, epochs=2)
    assert resumed == run[1:]
    # off: shard order every epoch
    plain = _epochs_as_read(small_data / "train", False, first_epoch=3, epochs=2)
    assert plain[0] == plain[1]
    assert all(w == sorted(w) for w in _file_order(plain[0]))


def _file_order(epoch: list[list[int]]) -> list[list[int]]:
    """Each worker's shards in the order it met them (the small shards hold 200 ids each)."""
    return [list(dict.fromkeys(i // 200 for i in ids)) for ids in epoch]


def test_the_cache_decision_counts_decoded_bytes(tmp_path):
    """Packed contact maps are ~30x larger decoded than in Parquet: the train split is
    cached in the workers only when its decoded size fits data.cache_mb per worker."""
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
    width = 214 * 213 // 2  # the upper triangle, one float32 each
    assert decoded >= 400 * width * 4 > 20 * split.bytes
    data.cache_mb = decoded / 2**20 / 2 * 0.9  # a tenth short of half each at 2 workers
    assert not fits_cache(data, split, 2)
    data.cache_mb = decoded / 2**20 / 2 * 1.1
    assert fits_cache(data, split, 2)


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
