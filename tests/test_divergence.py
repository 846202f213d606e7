"""Runs that would "succeed" on garbage: a non-finite loss stops the run at its step with
one line naming the rows, nothing non-finite is ever checkpointed, a worker that fits on
no node fails at once, and every JSON the run writes is strict JSON.

Real local Ray, real DeepSpeed engines on gloo, real Parquet shards with real NaN rows."""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import small_overrides, train

from elastic.errors import ConfigError, RunError

pytestmark = pytest.mark.usefixtures("ray_session")

NAN_IDS = (5, 6, 7)


@pytest.fixture(scope="module")
def nan_data(small_data, tmp_path_factory):
    """The small dataset with NaN inputs in three rows of one shard."""
    root = tmp_path_factory.mktemp("nan")
    shutil.copytree(small_data / "train", root / "train")
    shutil.copytree(small_data / "val", root / "val")
    for shard in sorted(glob.glob(str(root / "train/*.parquet"))):
        table = pq.read_table(shard)
        ids = table["sample_id"].to_numpy()
        if not np.isin(NAN_IDS, ids).all():
            continue
        x = np.stack(table["x"].to_numpy(zero_copy_only=False)).astype(np.float32)
        x[np.isin(ids, NAN_IDS)] = np.nan
        column = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), x.shape[1])
        table = table.set_column(table.schema.get_field_index("x"), "x", column)
        pq.write_table(table, shard)
        return root, os.path.basename(shard)
    raise AssertionError(f"no shard holds sample ids {NAN_IDS}")


def _checkpoints_finite(run_dir: str) -> dict[int, bool]:
    """step -> whether every float tensor of the checkpoint's model states is finite
    (read independently of the trainer: the DeepSpeed files themselves)."""
    out = {}
    for folder in sorted(glob.glob(os.path.join(run_dir, "step=*"))):
        finite = True
        for f in glob.glob(os.path.join(folder, "model", "*model_states.pt")):
            states = torch.load(f, map_location="cpu", weights_only=False)
            for t in states["module"].values():
                finite &= bool(torch.isfinite(t).all())
        out[int(folder.rsplit("=", 1)[1])] = finite
    return out


@pytest.mark.parametrize("stage", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_nan_rows_stop_the_run_at_their_step_and_keep_the_good_checkpoints(
    stage, nan_data, tmp_path
):
    root, shard = nan_data
    overrides = small_overrides(
        root,
        tmp_path,
        f"strategy.zero_stage={stage}",
        "trainer.max_steps=0",
        "trainer.max_epochs=2",
        "checkpoint.every_steps=1",
        "checkpoint.keep=2",
        "logger=none",
        "run.name=nan",
    )
    with pytest.raises(RunError) as err:
        train(overrides)
    message = str(err.value)
    assert "\n" not in message
    assert "training diverged at step" in message
    assert any(f"sample_id {i} ({shard})" in message for i in NAN_IDS), message
    step = int(message.split("training diverged at step ")[1].split(":")[0])
    # the step that met the NaN rows was never checkpointed; what is kept is finite and
    # from before it (retention never displaced a good checkpoint with a bad one)
    kept = _checkpoints_finite(str(tmp_path / "nan"))
    assert all(kept.values()), kept
    assert all(s < step for s in kept), (step, kept)
    assert len(kept) == min(2, step - 1), (step, kept)
    with open(tmp_path / "nan" / "metrics.jsonl") as f:
        for line in f:  # strict JSON: no bare NaN even where the loss was nan
            json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))


def test_a_worker_no_node_can_hold_fails_at_once(small_data, tmp_path):
    overrides = small_overrides(small_data, tmp_path, "scaling.cpus_per_worker=64")
    with pytest.raises(ConfigError, match=r"scaling.cpus_per_worker: a worker needs 64 CPU"):
        train(overrides)


@pytest.mark.slow
def test_a_strict_placement_the_nodes_cannot_give_fails_at_once(small_data, tmp_path):
    """STRICT_SPREAD with fewer nodes than workers: retried 182 times in 16.5 minutes."""
    overrides = small_overrides(small_data, tmp_path, "scaling.placement_strategy=STRICT_SPREAD")
    with pytest.raises(ConfigError) as e:
        train(overrides)
    assert str(e.value).startswith(
        "scaling.placement_strategy=STRICT_SPREAD puts each worker on a node of its own, but "
        "the cluster's nodes hold 1 of scaling.min_workers=2 (1 node(s): 4 CPU): use SPREAD"
    ), str(e.value)


@pytest.mark.slow
def test_a_group_that_cannot_be_placed_ends_the_run_after_the_placement_timeout(
    small_data, tmp_path, cpus_held
):
    """No worker group could be started (the nodes' CPUs are held): Ray Train retried it
    for ever (182 times in 16.5 minutes); now the run ends in one line."""
    overrides = small_overrides(
        small_data, tmp_path, "logger=none", "scaling.placement_timeout_s=5"
    )
    with pytest.raises(RunError) as e:
        train(overrides)
    message = str(e.value)
    assert message.startswith("no worker group could be started for "), message
    assert "scaling.min_workers=2, 1 CPU each, scaling.placement_strategy=PACK" in message


def test_summary_is_strict_json_with_non_finite_values(tmp_path):
    from elastic.train.driver import write_summary

    path = write_summary({"val": {"loss": math.nan, "r2": -math.inf}, "steps": 3}, tmp_path)
    text = Path(path).read_text()
    summary = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
    assert summary == {"val": {"loss": None, "r2": None}, "steps": 3}


@pytest.mark.slow
def test_a_shard_with_a_damaged_page_ends_the_run_naming_it(small_data, tmp_path):
    """Footer intact, one page header overwritten: reading it fails the same way every
    time, so the run ends at once naming the file (it was retried 11 times, unnamed)."""
    root = tmp_path / "data"
    shutil.copytree(small_data, root)
    shard = sorted(glob.glob(str(root / "train/*.parquet")))[2]
    column = pq.ParquetFile(shard).metadata.row_group(0).column(1)
    raw = bytearray(Path(shard).read_bytes())
    raw[column.data_page_offset : column.data_page_offset + 64] = b"\xab" * 64
    Path(shard).write_bytes(bytes(raw))
    overrides = small_overrides(
        root, tmp_path, "logger=none", "run.name=damaged", "scaling.max_failures=3"
    )
    with pytest.raises(RunError) as err:
        train(overrides)
    message = str(err.value)
    assert f"shard {shard} cannot be read" in message and "\n" not in message, message
    lines = (tmp_path / "damaged" / "metrics.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    assert not [e for e in events if e.get("event") == "restart"], "it was retried"
