"""Checkpoints: DeepSpeed state from every rank plus the trainer's own state.

Every rank writes its DeepSpeed shard files into a private temp dir and reports it to Ray
Train, which merges the ranks' files into one folder (``step=000001200``) and registers
it only once every rank has reported: a save killed halfway is never the latest
checkpoint. Rank 0 adds ``trainer_state.json`` (step, epoch, batch plan, history) and
``samples.npz`` (the epoch's sample bitmap); each rank adds its RNG state.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from elastic.accounting import SampleLedger

DS_TAG = "model"
STATE_FILE = "trainer_state.json"
SAMPLES_FILE = "samples.npz"


def step_dir_name(step: int) -> str:
    return f"step={step:09d}"


@dataclass
class TrainerState:
    """Everything besides model and optimizer that a resumed run needs."""

    step: int = 0
    samples_seen: int = 0
    loss_first: float | None = None
    loss_last: float | None = None
    world_sizes: list[int] = field(default_factory=list)
    batch_plans: list[dict[str, int]] = field(default_factory=list)
    wandb_run_id: str | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    time_s: dict[str, float] = field(default_factory=dict)
    """Cumulative seconds per phase over all sessions (data_wait, forward, ...)."""
    train_wall_s: float = 0.0
    ledger: SampleLedger = field(default_factory=SampleLedger)

    @property
    def epoch(self) -> int:
        return self.ledger.epoch

    def state_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ledger"] = self.ledger.state_dict()
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        ledger = self.ledger
        ledger.load_state_dict(d.pop("ledger"))
        for k, v in d.items():
            setattr(self, k, v)
        self.ledger = ledger


def _rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save(engine: Any, state: TrainerState, rank: int, metrics: dict[str, Any]) -> None:
    """Write this rank's part of the checkpoint for ``state.step`` and report it to Ray."""
    import ray.train

    tmp = tempfile.mkdtemp(prefix=f"elastic-ckpt-r{rank}-")
    try:
        engine.save_checkpoint(tmp, tag=DS_TAG)
        torch.save(_rng_state(), os.path.join(tmp, f"rng-rank{rank}.pt"))
        if rank == 0:
            with open(os.path.join(tmp, SAMPLES_FILE), "wb") as f:
                f.write(state.ledger.bitmaps_bytes())
            with open(os.path.join(tmp, STATE_FILE), "w") as f:
                json.dump(state.state_dict(), f, indent=1)
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(tmp),
            checkpoint_dir_name=step_dir_name(state.step),
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_state(path: str) -> TrainerState:
    """Trainer state of a checkpoint folder (no engine needed: tests and reports use it)."""
    state = TrainerState()
    with open(os.path.join(path, STATE_FILE)) as f:
        state.load_state_dict(json.load(f))
    samples = os.path.join(path, SAMPLES_FILE)
    if os.path.exists(samples):
        with open(samples, "rb") as f:
            state.ledger.load_bitmaps(f.read())
    return state


def restore(engine: Any, checkpoint: Any, rank: int, world_size: int) -> TrainerState:
    """Load model, optimizer, scheduler and trainer state from a reported checkpoint."""
    with checkpoint.as_directory() as path:
        state = read_state(path)
        saved_world = state.world_sizes[-1] if state.world_sizes else world_size
        if saved_world != world_size:
            raise NotImplementedError(
                f"checkpoint {path} was written at world size {saved_world}, this run has "
                f"{world_size}: resharding resume is not supported yet; run with "
                f"scaling.min_workers=scaling.max_workers={saved_world}"
            )
        load_path, _ = engine.load_checkpoint(path, tag=DS_TAG)
        if load_path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint under {path}/{DS_TAG}")
        rng = os.path.join(path, f"rng-rank{rank}.pt")
        if os.path.exists(rng):
            _set_rng_state(torch.load(rng, weights_only=False))
    return state
