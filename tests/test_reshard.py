"""Resharding resume: a ZeRO 1/2/3 checkpoint written at world size N resumes at M with
model and optimizer state, through elastic.train.checkpoint (real DeepSpeed engines, real
gloo process groups in forked processes: tests/ranks.py); the universal form it loads from
is made once, by the whole group (elastic.train.reshard), into one folder every rank reads,
then removed."""

from __future__ import annotations

import pytest
import torch
from ranks import free_port, start_ranks
from reshard_worker import run

pytestmark = pytest.mark.slow  # the fast tier: pytest -m 'not slow'


def _phase(world, stage, tmp_path, name, load=None, save=None) -> dict:
    dump = str(tmp_path / f"{name}.pt")
    start_ranks(run, (world, stage, free_port(), load, save, dump), world)
    return torch.load(dump, weights_only=False)


def _assert_same_state(before: dict, after: dict) -> None:
    assert before["state"].keys() == after["state"].keys()
    for key, value in before["state"].items():
        assert torch.equal(value, after["state"][key]), key  # bitwise
    assert after["global_steps"] == before["global_steps"]
    assert after["lr"] == before["lr"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_checkpoint_resumes_at_another_world_size(stage, tmp_path):
    # written at 2, resumed at 1 and at 3
    at2 = _phase(2, stage, tmp_path, "w2", save=str(tmp_path / "ckpt2"))
    assert not at2["universal"]
    for world in (1, 3):
        resumed = _phase(world, stage, tmp_path, f"w2to{world}", load=str(tmp_path / "ckpt2"))
        assert resumed["universal"]  # the world size changed: converted, then loaded
        # once for the group: every rank loaded the one folder rank 0 made, now removed
        folders = resumed["universal_folders"]
        assert len(folders) == world and len(set(folders)) == 1 and folders[0], folders
        assert not resumed["universal_left"]
        _assert_same_state(at2, resumed)
        # the loss continues: the next two steps match the run that went on at size 2
        # (up to the order of the cross-rank sums)
        assert resumed["next_losses"] == pytest.approx(at2["next_losses"], rel=1e-5)

    # written at 1, resumed at 2
    at1 = _phase(1, stage, tmp_path, "w1", save=str(tmp_path / "ckpt1"))
    resumed = _phase(2, stage, tmp_path, "w1to2", load=str(tmp_path / "ckpt1"))
    assert resumed["universal"]
    _assert_same_state(at1, resumed)
    assert resumed["next_losses"] == pytest.approx(at1["next_losses"], rel=1e-5)


def test_same_world_size_is_the_fast_path_and_exact(tmp_path):
    at2 = _phase(2, 2, tmp_path, "w2", save=str(tmp_path / "ckpt"))
    again = _phase(2, 2, tmp_path, "again", load=str(tmp_path / "ckpt"))
    assert not again["universal"]
    _assert_same_state(at2, again)
    assert again["next_losses"] == at2["next_losses"]  # to the bit


def test_zero0_checkpoint_loads_at_another_world_size(tmp_path):
    """Stage 0 keeps the whole model and optimizer on every rank: no conversion."""
    at2 = _phase(2, 0, tmp_path, "w2", save=str(tmp_path / "ckpt"))
    resumed = _phase(3, 0, tmp_path, "w3", load=str(tmp_path / "ckpt"))
    assert not resumed["universal"]
    _assert_same_state(at2, resumed)
    assert resumed["next_losses"] == pytest.approx(at2["next_losses"], rel=1e-5)
