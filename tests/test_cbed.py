"""Electron diffraction: CBED patterns simulated with abTEM (the ``cbed`` extra; the
simulation tests skip without it), their schema and held-out groups, the synthetic
generator, and the multitask CNN that reads them."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import train

from elastic.datasets.cbed import MATERIALS, STRUCTURES, THICKNESS_UNIT_NM, Settings, synthetic
from elastic.models.resnet import ResNetConfig
from elastic.tasks import MetricSums, task_of
from elastic_harness.localcluster import REPO

PREPARE = str(REPO / "datasets" / "cbed" / "prepare.py")


def read(path):
    return pq.read_table(sorted(path.glob("*.parquet")))


def groups(table):
    return set(zip(table["material"].to_pylist(), table["thickness_nm"].to_pylist(), strict=True))


@pytest.mark.slow
def test_simulated_patterns_schema_labels_and_held_out_groups(tmp_path):
    pytest.importorskip("abtem", reason="the cbed extra is not installed")
    cmd = [
        sys.executable, PREPARE, str(tmp_path / "cbed"), "--materials", "Si,Cu,MgO",
        "--positions", "3", "--max-thickness-nm", "6", "--size", "32", "--shards", "2",
        "--val-fraction", "0.4", "--cpus", "2",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "simulating" in out.stderr  # the progress bar
    train_t, val_t = read(tmp_path / "cbed" / "train"), read(tmp_path / "cbed" / "val")
    rows = train_t.num_rows + val_t.num_rows
    assert f"wrote {train_t.num_rows} train and {val_t.num_rows} val patterns" in out.stdout
    assert train_t.num_rows and val_t.num_rows
    ids = train_t["sample_id"].to_pylist() + val_t["sample_id"].to_pylist()
    assert sorted(ids) == list(range(rows))
    # validation holds whole (material, thickness) groups that training never sees
    assert not groups(train_t) & groups(val_t)
    t = train_t
    meta = t.schema.metadata
    assert json.loads(meta[b"elastic.structures"]) == list(STRUCTURES)
    assert meta[b"elastic.pattern_size"] == b"32" and meta[b"elastic.energy_kev"] == b"200.0"
    pattern = np.stack(t["pattern"].to_numpy(zero_copy_only=False))
    assert pattern.shape == (t.num_rows, 32 * 32) and pattern.dtype == np.float32
    np.testing.assert_allclose(pattern.sum(1), 1.0, rtol=1e-4)
    # the central (transmitted) disk is brighter than the corners of the pattern
    p = pattern.reshape(-1, 32, 32)
    assert (p[:, 14:18, 14:18].mean((1, 2)) > 5 * p[:, :3, :3].mean((1, 2))).all()
    mats = t["material"].to_pylist()
    structure = t["structure"].to_numpy()
    assert all(STRUCTURES[s] == MATERIALS[m][0] for m, s in zip(mats, structure, strict=True))
    thick = t["thickness_nm"].to_numpy()
    assert thick.min() > 0 and thick.max() <= 6.5
    target = np.stack(t["target"].to_numpy(zero_copy_only=False))
    np.testing.assert_array_equal(target[:, 0], structure)
    np.testing.assert_allclose(target[:, 1], thick / THICKNESS_UNIT_NM, rtol=1e-6)
    # a thicker crystal scatters more out of the central disk: same probe, same crystal
    si = [
        (th, pat[14:18, 14:18].sum())
        for m, th, pat, xy in zip(mats, thick, p, t["probe_xy"].to_pylist(), strict=True)
        if m == "Si" and xy == t["probe_xy"].to_pylist()[mats.index("Si")]
    ]
    if len(si) >= 2:
        si.sort()
        assert si[-1][1] < si[0][1]
    assert np.stack(t["potential"].to_numpy(zero_copy_only=False)).shape == (t.num_rows, 256)


def test_bad_generator_input_is_one_line_and_writes_nothing(tmp_path):
    out = subprocess.run(
        [sys.executable, PREPARE, str(tmp_path / "c"), "--materials", "Si,Unobtainium"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"error: unknown material Unobtainium: use some of {', '.join(MATERIALS)}"
    ]
    assert not (tmp_path / "c").exists()


def test_synthetic_patterns_have_the_simulators_schema(tmp_path):
    train_rows, val_rows = synthetic(tmp_path / "s", 600, Settings(size=32), shards=3)
    assert train_rows + val_rows == 600
    t, v = read(tmp_path / "s" / "train"), read(tmp_path / "s" / "val")
    assert not groups(t) & groups(v)
    assert t.schema.names == [
        "sample_id", "pattern", "structure", "material", "thickness_nm", "probe_xy",
        "potential", "target",
    ]  # fmt: skip
    pattern = t.schema.field("pattern").type
    assert (pattern.value_type, pattern.list_size) == (pa.float32(), 32 * 32)
    assert t.schema.metadata[b"elastic.format"] == b"cbed"


def test_multitask_loss_and_metrics():
    """First `classes` outputs are logits, the rest regress target[:, 1:]."""
    out = torch.tensor([[5.0, 0.0, 0.0, 1.0], [0.0, 5.0, 0.0, 3.0], [5.0, 0.0, 0.0, 0.0]])
    y = torch.tensor([[0.0, 1.0], [1.0, 2.0], [2.0, 1.0]])
    task = task_of(ResNetConfig(task="multitask", output_dim=4, classes=3))
    losses = task.losses(out, y)
    ce = torch.nn.functional.cross_entropy(out[:, :3], y[:, 0].long(), reduction="none")
    torch.testing.assert_close(losses, ce + (out[:, 3] - y[:, 1]) ** 2)
    sums = MetricSums(task)
    sums.add(out, y, losses)
    m = sums.metrics()
    assert m["accuracy"] == pytest.approx(2 / 3)
    # R^2 of [1, 3, 0] against [1, 2, 1]: 1 - 2 / (2/3)
    assert m["r2"] == pytest.approx(1 - 2 / (2 / 3))


def _train_on_synthetic(tmp_path, experiment: str, *extra: str, size: int = 64) -> dict:
    """60 steps of ``experiment`` on 2,000 synthetic ``size`` x ``size`` patterns."""
    synthetic(tmp_path / "s", 2000, Settings(size=size), shards=4)
    return train(
        [
            f"+experiment={experiment}",
            f"data.path={tmp_path}/s/train",
            f"data.val_path={tmp_path}/s/val",
            f"run.storage_path={tmp_path}/runs",
            "trainer.max_steps=60",
            "logger=none",
            *extra,
        ]
    )


@pytest.mark.slow
def test_cbed_cnn_learns_structure_and_thickness_from_synthetic_patterns(tmp_path, ray_session):
    """The real pipeline with the cbed_cnn experiment: flat patterns reshaped, log
    intensities, two heads; on held-out groups the structure is far above chance and the
    thickness well above the mean (60 steps; the real patterns' figures are in the README)."""
    summary = _train_on_synthetic(tmp_path, "cbed_cnn", "checkpoint.every_steps=0")
    assert summary["status"] == "finished" and summary["samples_exactly_once"] is True
    val = summary["val"]
    assert val["accuracy"] >= 2 / len(STRUCTURES), val
    assert val["r2"] > 0.2, val  # thickness: well above the mean predictor (0)


@pytest.mark.slow
def test_cbed_vit_learns_in_bf16_with_zero3(tmp_path, ray_session):
    """The transformer experiment (the model bench.py gpu scales to ViT-L) on the same
    pipeline, in bf16 with parameters, gradients and optimizer state partitioned
    (ZeRO-3) and a checkpoint mid-run: it trains every sample once and learns the
    structure type well above chance in 60 steps. On 32 x 32 patterns (16 patches, not
    64): this CPU has no bf16 arithmetic (a bf16 matrix product takes ~20x the fp32
    one), and 64 x 64 took 100 s (val accuracy 0.57), 32 x 32 51 s (0.51; 2026-12-06)."""
    summary = _train_on_synthetic(
        tmp_path,
        "cbed_vit",
        "checkpoint.every_steps=30",
        "strategy.precision=bf16",
        "strategy.zero_stage=3",
        "model.input_size=32",
        size=32,
    )
    assert summary["status"] == "finished" and summary["samples_exactly_once"] is True
    assert summary["loss_last"] < 0.6 * summary["loss_first"]
    assert summary["val"]["accuracy"] >= 2 / len(STRUCTURES), summary["val"]
    # bf16 without the CPU's bf16 instructions is ~20x slower: said at the run's start
    warned = [e for e in summary["events"] if e["event"] == "bf16_slow_on_cpu"]
    with open("/proc/cpuinfo") as f:
        has_bf16 = re.search(r"\b(avx512_bf16|amx_bf16|bf16)\b", f.read()) is not None
    assert len(warned) == (0 if has_bf16 else 1), warned
