"""Checkpoints: DeepSpeed state from every rank plus the trainer's own state.

Every rank writes its DeepSpeed shard files into a private temp dir and reports it to Ray
Train, which merges the ranks' files into one folder (``step=000001200``) and registers
it only once every rank has reported: a save killed halfway is never the latest
checkpoint. Rank 0 adds ``trainer_state.json`` (step, epoch, batch plan, history) and
``samples.npz`` (the epoch's sample bitmap); each rank adds its RNG state.

Restore at the saved world size loads the files as they are. A ZeRO 1-3 checkpoint
restored at another world size is first converted to a DeepSpeed universal checkpoint
in a temp dir (the checkpoint is never modified) and loaded resharded.
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


def remove_unregistered(run_dir: str, resumed_step: int) -> list[str]:
    """Delete checkpoint folders past the step this worker group resumed from.

    Ray Train resumes from the newest checkpoint it registered, so any ``step=N`` folder
    with N beyond it was left half-written by a group that failed while saving. Ray
    merges a later save of the same step into that folder; the failed group's extra
    rank files would then be read as shards of the new one (a resharding restore fails
    on them). Called on rank 0 before the group's first save."""
    removed: list[str] = []
    if not os.path.isdir(run_dir):
        return removed
    for name in os.listdir(run_dir):
        if name.startswith("step=") and name[5:].isdigit() and int(name[5:]) > resumed_step:
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)
            removed.append(name)
    return removed


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


def write(engine: Any, state: TrainerState, rank: int, path: str) -> None:
    """Write this rank's part of a checkpoint into ``path`` (every rank calls it: ZeRO
    saves are collective)."""
    engine.save_checkpoint(path, tag=DS_TAG)
    torch.save(_rng_state(), os.path.join(path, f"rng-rank{rank}.pt"))
    if rank == 0:
        with open(os.path.join(path, SAMPLES_FILE), "wb") as f:
            f.write(state.ledger.bitmaps_bytes())
        with open(os.path.join(path, STATE_FILE), "w") as f:
            json.dump(state.state_dict(), f, indent=1)


def save(engine: Any, state: TrainerState, rank: int, metrics: dict[str, Any]) -> None:
    """Write this rank's part of the checkpoint for ``state.step`` and report it to Ray."""
    import ray.train

    # the pid in the name lets a test (or an operator) see which process is saving
    tmp = tempfile.mkdtemp(prefix=f"elastic-ckpt-r{rank}-p{os.getpid()}-")
    try:
        write(engine, state, rank, tmp)
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


def needs_reshard(state: TrainerState, world_size: int, zero_stage: int) -> bool:
    """A ZeRO 1-3 checkpoint written at another world size loads only as a universal one
    (stage 0 keeps whole model and optimizer state on every rank: it loads as it is)."""
    saved = state.world_sizes[-1] if state.world_sizes else world_size
    return saved != world_size and zero_stage > 0


def to_universal(path: str) -> str:
    """Convert the DeepSpeed checkpoint in ``path`` to a universal one in a fresh temp dir
    (the checkpoint itself is never modified; the caller removes the dir)."""
    import argparse
    import contextlib
    import io

    from deepspeed.checkpoint import ds_to_universal

    out = tempfile.mkdtemp(prefix="elastic-universal-")
    args = argparse.Namespace(
        input_folder=os.path.join(path, DS_TAG),
        output_folder=os.path.join(out, DS_TAG),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # stages 1 and 2 lack the info the converter needs
    )
    # the converter prints and draws progress bars: keep the run's log readable
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal.main(args)
    return out


def restore(engine: Any, path: str, rank: int, universal: bool = False) -> None:
    """Load model, optimizer and scheduler state (and this rank's RNG) from a checkpoint
    folder; ``universal`` (an engine built with ``load_universal``) reshards it."""
    if universal:
        converted = to_universal(path)
        try:
            load_path, _ = engine.load_checkpoint(converted, tag=DS_TAG)
        finally:
            shutil.rmtree(converted, ignore_errors=True)
    else:
        load_path, _ = engine.load_checkpoint(path, tag=DS_TAG)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint under {path}/{DS_TAG}")
    rng = os.path.join(path, f"rng-rank{rank}.pt")
    if os.path.exists(rng):  # a rank that did not exist at the saved world size keeps its seed
        _set_rng_state(torch.load(rng, weights_only=False))
