"""protein_cvae: the convolutional VAE on contact maps, as a module and through the real
pipeline (synthetic maps of the protein converter's schema; no extra needed)."""

from __future__ import annotations

import pytest
import torch
from conftest import train

from elastic.datasets.protein import synthetic
from elastic.models.cvae import CVAEConfig
from elastic.tasks import MetricSums, task_of


def test_the_vae_reads_and_writes_upper_triangles_of_symmetric_maps():
    torch.manual_seed(0)
    cfg = CVAEConfig(residues=30, channels=[8, 16], latent_dim=4)
    model = cfg.build()
    x = (torch.rand(5, cfg.input_dim) < 0.2).float()
    out = model(x)
    assert out.shape == (5, cfg.input_dim + 2 * cfg.latent_dim) == (5, cfg.output_dim)
    model.eval()  # the mean of the code, no sampling: the same map gives the same logits
    torch.testing.assert_close(model(x), model(x))
    # the loss is cross entropy + beta KL, both per contact value
    vae = task_of(cfg)
    losses = vae.losses(out, x)
    assert losses.shape == (5,) and bool((losses > 0).all())
    # a few steps on one batch lower it, and the metrics read contacts back
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = vae.losses(model(x), x).mean().item()
    for _ in range(30):
        opt.zero_grad()
        vae.losses(model(x), x).mean().backward()
        opt.step()
    model.eval()
    out = model(x)
    last = vae.losses(out, x)
    assert last.mean().item() < 0.7 * first
    sums = MetricSums(vae)
    sums.add(out, x, last)
    m = sums.metrics()
    assert set(m) == {"loss", "samples", "bce", "kl", "f1"} and m["samples"] == 5
    assert 0 <= m["f1"] <= 1


@pytest.mark.slow
def test_protein_cvae_trains_through_the_pipeline(tmp_path, ray_session):
    """The experiment's model and task (the target is the input) on a small protein."""
    synthetic(tmp_path / "train", frames=256, residues=40, shards=2)
    synthetic(tmp_path / "val", frames=64, residues=40, seed=1, first_sample_id=256)
    summary = train(
        [
            "+experiment=protein_cvae",
            f"data.path={tmp_path}/train",
            f"data.val_path={tmp_path}/val",
            f"run.storage_path={tmp_path}/runs",
            "model.residues=40",
            "model.channels=[8,16]",
            "trainer.max_steps=40",
            "checkpoint.every_steps=20",
            "logger=none",
        ]
    )
    assert summary["status"] == "finished" and summary["samples_exactly_once"] is True
    assert summary["loss_last"] < 0.75 * summary["loss_first"]  # 1.82 -> 1.13 here
    val = summary["val"]
    # reconstructed contacts of held-out frames (0.65 here after 40 steps)
    assert val["samples"] == 64 and val["f1"] > 0.5, val
    assert val["bce"] < val["loss"] and val["kl"] > 0
