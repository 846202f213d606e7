"""Which samples a run trained at a step: ``python launch/batch.py RUN_DIR STEP``.

Every global batch is a function of the data and the plan's settings alone
(:mod:`elastic.data.order`), so the rows of any step of a run can be named after the
fact without the run: to look at the samples behind a loss spike, or to train that
batch again. The settings and the data's row groups come from the run's newest
checkpoint (``trainer_state.json``); the shards must be the ones it trained on.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from elastic.errors import CheckpointError, ConfigError


def newest_state(run_dir: str) -> dict[str, Any]:
    """The trainer state of the run's newest checkpoint folder (``step=N``)."""
    steps = sorted(
        n for n in os.listdir(run_dir) if n.startswith("step=") and n[5:].isdigit()
    ) if os.path.isdir(run_dir) else []  # fmt: skip
    if not steps:
        raise ConfigError(f"{run_dir} holds no checkpoint (step=N): give a run's folder")
    path = os.path.join(run_dir, steps[-1], "trainer_state.json")
    try:
        with open(path) as f:
            return dict(json.load(f))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable ({e})") from None


def step_batch(run_dir: str, data_path: str, step: int) -> dict[str, Any]:
    """Global batch ``step`` (1-based, as logged) of the run in ``run_dir`` on the shards
    in ``data_path``: its epoch, its step in the epoch and its rows, lane by lane, as
    sample ids and (file, row group, row)."""
    from elastic.data.order import Layout
    from elastic.data.reader import data_changes, data_record, epoch_plan
    from elastic.data.settings import DataConfig
    from elastic.data.shards import check_dataset

    state = newest_state(run_dir)
    saved = state.get("data")
    if not saved:
        raise CheckpointError(
            f"{run_dir}: its checkpoint was written before batches were planned from the "
            "data; its steps cannot be named"
        )
    cfg = DataConfig(
        path=data_path,
        global_batch_size=saved["global_batch_size"],
        lanes=saved["lanes"],
        shuffle_window_rows=saved["window"],
        seed=saved["seed"],
        shuffle=saved["shuffle"],
    )
    split = check_dataset(cfg)["train"]
    layout = Layout(split.row_groups)
    changed = data_changes(saved, data_record(cfg, split.files, layout))
    if changed:
        raise CheckpointError(f"{data_path} is not the data {run_dir} trained on: {changed}")
    if step < 1:
        raise ConfigError(f"step {step}: steps count from 1, as the run logs them")
    per_epoch = epoch_plan(cfg, layout, 0).steps  # the same every epoch
    epoch, into = divmod(step - 1, per_epoch)
    rows = epoch_plan(cfg, layout, epoch).batch(into)
    import pyarrow.parquet as pq

    shards = [pq.ParquetFile(f) for f in split.files]
    ids: dict[tuple[int, int], np.ndarray] = {}
    sample_ids = []
    for f, g, r in rows:
        if (f, g) not in ids:
            ids[(f, g)] = shards[f].read_row_group(g, columns=["sample_id"])["sample_id"].to_numpy()
        sample_ids.append(int(ids[(f, g)][r]))
    return {
        "step": step,
        "epoch": epoch,
        "step_in_epoch": into + 1,
        "sample_ids": sample_ids,
        "rows": [
            {"file": os.path.basename(split.files[f]), "row_group": g, "row": r} for f, g, r in rows
        ],
    }
