"""The dataset-size series of ``bench.py scale``, on the product's own code without Ray:

- ``ledger``: what a checkpoint keeps to check exactly-once (the epoch's sample bitmap,
  :class:`~elastic.train.accounting.SampleLedger`) for 10^6 to 10^9 sample ids: its
  bytes, and the seconds to write and read it (rank 0, at every checkpoint). A bitmap
  half full of random bits stands for one mid-epoch; the last closed epoch's, full.
- ``ledger_merge``: rank 0 folding the ids trained since the last checkpoint into it
  (global batch x checkpoint interval ids, 10^4 to 10^7).
- ``resume_state``: what a checkpoint keeps to resume the data exactly (the position
  follows from the step; the data record names every shard and row group, to refuse
  changed data): bytes of ``trainer_state.json``; and what the driver sends every
  worker of every group it starts (the shard list and row groups the batches are
  planned on, :class:`~elastic.train.worker_args.WorkerArgs`), pickled.
- ``config_checks``: the checks before Ray starts (``launch/run.py``'s composition and
  the driver's data preparation: every shard's footer) on 10 to 10^4 shards. A shard
  here stands for 10^5 samples in 10 row groups; its footer is the size a real one's
  is (the rows themselves are never read), written with 1 row a group.
"""

from __future__ import annotations

import json
import os
import pickle
import time
from typing import Any

import numpy as np

SAMPLES_PER_SHARD = 100_000
GROUPS_PER_SHARD = 10


def ledger_point(ids: int, workdir: str) -> dict[str, float]:
    from elastic.train.accounting import SampleLedger

    ledger = SampleLedger()
    rng = np.random.default_rng(0)
    ledger.bitmap = rng.integers(0, 256, (ids + 7) // 8, dtype=np.uint8)
    ledger.last_closed_bitmap = np.full((ids + 7) // 8, 255, np.uint8)
    path = os.path.join(workdir, "samples.npz")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(ledger.bitmaps_bytes())
        f.flush()
        os.fsync(f.fileno())
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        SampleLedger().load_bitmaps(f.read())
    load_s = time.perf_counter() - t0
    size = os.path.getsize(path)
    os.remove(path)
    return {"bytes": size, "save_s": save_s, "load_s": load_s}


def merge_point(merged: int, space: int = 10**9) -> float:
    """Seconds rank 0 takes to fold ``merged`` fresh ids (of a dataset of ``space``)
    into the epoch's bitmap, one checkpoint's worth."""
    from elastic.train.accounting import SampleLedger

    rng = np.random.default_rng(1)
    ledger = SampleLedger()
    ledger.bitmap = np.zeros(space // 8, np.uint8)
    ids = rng.choice(space, merged, replace=False).astype(np.int64)
    per_rank = np.array_split(ids, 8)
    t0 = time.perf_counter()
    ledger.merge(per_rank)
    took = time.perf_counter() - t0
    assert ledger.trained == merged and ledger.duplicates == 0, "the merge lost ids"
    return took


def shards_of(samples: int) -> int:
    return max(1, samples // SAMPLES_PER_SHARD)


def make_split(path: str, shards: int) -> None:
    from elastic.datasets.synthetic import write_shards

    write_shards(path, shards * GROUPS_PER_SHARD, shards, 64, 4, 0, row_group_rows=1)


def config_point(data_dir: str) -> dict[str, Any]:
    """Seconds of the checks before Ray starts, and the resume state's bytes, for the
    split in ``data_dir``: composition (every config check) then the driver's data
    preparation, as ``launch/run.py`` runs them in one process."""
    from elastic.config.compose import compose, typed_config
    from elastic.data.order import Layout
    from elastic.data.reader import data_record
    from elastic.train.checkpoint import TrainerState
    from elastic.train.driver import prepare_data
    from elastic.train.worker_args import WorkerArgs

    t0 = time.perf_counter()
    cfg, name = compose(
        [
            "+experiment=smoke",
            f"data.path={data_dir}",
            "data.val_path=null",
            "model.input_dim=64",
            "model.output_dim=4",
            f"run.storage_path={os.path.dirname(data_dir)}/runs",
        ]
    )
    typed = typed_config(cfg, name)
    composed = time.perf_counter()
    split = prepare_data(typed)["train"]
    done = time.perf_counter()
    layout = Layout(split.row_groups)
    record = data_record(typed.data, split.files, layout)
    state = json.dumps(TrainerState(step=1, data=record).state_dict(), indent=1)
    args = WorkerArgs(typed, {}, "", split.files, layout, record, True, split.rows)
    return {
        "config_s": done - t0,
        "compose_s": composed - t0,
        "prepare_s": done - composed,
        "state_bytes": len(state.encode()),
        "worker_args_bytes": len(pickle.dumps(args)),
        "row_groups": sum(len(g) for g in split.row_groups),
    }
