"""Checkpoints: DeepSpeed state from every rank plus the trainer's own state.

Every rank writes its DeepSpeed shard files into a private temp dir and reports it to Ray
Train, which merges the ranks' files into one folder (``step=000001200``) and registers
it only once every rank has reported: a save killed halfway is never the latest
checkpoint. Rank 0 adds ``trainer_state.json`` (step, epoch, batch plan, history) and
``samples.npz`` (the epoch's sample bitmap); each rank adds its RNG state.

Restore at the saved world size loads the files as they are. A ZeRO 1-3 checkpoint
restored at another world size is first converted to a DeepSpeed universal checkpoint
in the run's staging folder, by the whole worker group (:mod:`elastic.train.reshard`;
the checkpoint is never modified), and loaded resharded.

Each rank also writes its manifest (:mod:`elastic.train.integrity`: the files' sizes and
sha256, checked before a resume). Loading never unpickles arbitrary objects: the
trainer's own state is JSON and npz, DeepSpeed's files load with ``weights_only=True``
and an allow-list of the three DeepSpeed classes they hold.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from elastic.errors import CheckpointError, StorageFullError, exception_text
from elastic.train.accounting import SampleLedger
from elastic.train.integrity import (
    DEEPSPEED_GLOBALS,
    DS_TAG,
    STAGING_DIR,
    write_manifest,
)

STATE_FILE = "trainer_state.json"
SAMPLES_FILE = "samples.npz"


def step_dir_name(step: int) -> str:
    return f"step={step:09d}"


def remove_unregistered(run_dir: str, resumed_step: int) -> list[str]:
    """Clear the checkpoint folders past the step this worker group resumed from.

    The group resumed from the newest checkpoint it was handed, so a ``step=N`` folder
    with N beyond it was left by a group that failed while saving (half-written), or
    right after (complete, but never registered). Ray merges a later save of the same
    step into that folder; the failed group's extra rank files would then be read as
    shards of the new one (a resharding restore fails on them). A half-written folder
    is deleted; a complete one (every rank's manifest and files, at full size: no
    hashing while the other ranks wait) is moved aside as ``step=N.unregistered``,
    never deleted. Called on rank 0 before the group's first
    save; returns the folders' names."""
    from elastic.train.integrity import set_aside, step_folders, unverified

    cleared: list[str] = []
    for step, name in step_folders(run_dir):
        if step <= resumed_step:
            continue
        folder = os.path.join(run_dir, name)
        if unverified(folder, hashes=False) is None:  # every rank's files, full size
            set_aside(folder, "unregistered")
        else:
            shutil.rmtree(folder, ignore_errors=True)
        cleared.append(name)
    return cleared


@dataclass
class TrainerState:
    """Everything besides model and optimizer that a resumed run needs."""

    step: int = 0
    epoch_start_step: int = 0
    """The step the current epoch began after: the run is at step ``step -
    epoch_start_step`` of the epoch's plan (:mod:`elastic.data.order`)."""
    data: dict[str, Any] = field(default_factory=dict)
    """The data the batches are planned on (:func:`elastic.data.reader.data_record`); a
    resume checks the data it finds against it."""
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


def _save_rng(path: str) -> None:
    """This process's torch, numpy and Python RNG state as plain arrays (npz: no pickle)."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    version, mt, python_gauss = random.getstate()
    np.savez(
        path,
        torch=torch.get_rng_state().numpy(),
        numpy_keys=keys,
        numpy_rest=np.array([pos, has_gauss, gauss], dtype=np.float64),
        python_version=np.array(version),
        python_mt=np.array(mt, dtype=np.uint64),
        # random.gauss's cached value, or none ([])
        python_gauss=np.array([] if python_gauss is None else [python_gauss]),
    )


def _load_rng(path: str) -> None:
    with np.load(path, allow_pickle=False) as z:
        torch.set_rng_state(torch.from_numpy(z["torch"].copy()))
        pos, has_gauss, gauss = z["numpy_rest"].tolist()
        np.random.set_state(("MT19937", z["numpy_keys"], int(pos), int(has_gauss), gauss))
        python_gauss = z["python_gauss"].tolist()
        random.setstate(
            (
                int(z["python_version"]),
                tuple(z["python_mt"].tolist()),
                python_gauss[0] if python_gauss else None,
            )
        )


def write(engine: Any, state: TrainerState, rank: int, path: str) -> None:
    """Write this rank's part of a checkpoint into ``path`` (every rank calls it: ZeRO
    saves are collective)."""
    engine.save_checkpoint(path, tag=DS_TAG)
    _save_rng(os.path.join(path, f"rng-rank{rank}.npz"))
    if rank == 0:
        with open(os.path.join(path, SAMPLES_FILE), "wb") as f:
            f.write(state.ledger.bitmaps_bytes())
        with open(os.path.join(path, STATE_FILE), "w") as f:
            json.dump(state.state_dict(), f, indent=1)


def save(engine: Any, state: TrainerState, rank: int, metrics: dict[str, Any]) -> None:
    """Write this rank's part of the checkpoint for ``state.step`` and report it to Ray."""
    import ray.train

    context = ray.train.get_context()
    staging = os.path.join(context.get_storage().experiment_fs_path, STAGING_DIR)
    os.makedirs(staging, exist_ok=True)
    # the pid in the name lets a test (or an operator) see which process is saving
    tmp = tempfile.mkdtemp(prefix=f"ckpt-r{rank}-p{os.getpid()}-", dir=staging)
    try:
        write(engine, state, rank, tmp)
        write_manifest(engine, rank, context.get_world_size(), tmp)
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(tmp),
            checkpoint_dir_name=step_dir_name(state.step),
        )
    except Exception as e:
        # before the staged files go: their bytes are what filled the disk
        full = storage_full(e, tmp, f"writing the checkpoint of step {state.step}")
        if full:
            raise StorageFullError(full) from e
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


FULL_BYTES = 16 * 2**20
"""A filesystem with less free than this after a failed write is taken to be full
(torch.save says only "file write failed")."""


def storage_full(exc: BaseException, path: str, doing: str, wrote: bool = True) -> str | None:
    """One line when ``exc`` (raised while ``doing`` into ``path``) is ``path``'s
    filesystem being full. Where ``exc`` is known to come from writing there
    (``wrote``): an ENOSPC/EDQUOT anywhere in its chain, or less than
    :data:`FULL_BYTES` left; else it must be both (another disk full, a node's /tmp or
    /dev/shm, stays a failure Ray Train retries). A retry would fill it again: the run
    stops; the last complete checkpoint is kept."""
    import errno

    from elastic.errors import exception_chain

    chain = list(exception_chain(exc))
    full = any(
        isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in chain
    ) or any("No space left on device" in str(e) for e in chain)
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        free = None
    low = free is not None and free < FULL_BYTES
    if not ((full or low) if wrote else (full and low)):
        return None
    left = f"{free / 2**20:.1f} MiB free" if free is not None else "no space left"
    return (
        f"the run's storage is full ({left} at {path}, {doing}): free space (or move the run "
        "folder where there is room and point run.storage_path there), then run the same "
        "command: it resumes from the last complete checkpoint, which is kept"
    )


def read_state(path: str) -> TrainerState:
    """Trainer state of a checkpoint folder (no engine needed: tests and reports use it)."""
    state = TrainerState()
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            state.load_state_dict(json.load(f))
    except (OSError, ValueError) as e:  # a checkpoint written before manifests existed
        raise CheckpointError(f"checkpoint {path}: {STATE_FILE} is unreadable ({e})") from None
    except (TypeError, KeyError, AttributeError) as e:  # JSON, but not a trainer state
        raise CheckpointError(
            f"checkpoint {path}: {STATE_FILE} is not a trainer state ({type(e).__name__}: {e}):"
            " resume from another checkpoint (move this one aside) or start a new run.name"
        ) from None
    samples = os.path.join(path, SAMPLES_FILE)
    if os.path.exists(samples):
        try:
            with open(samples, "rb") as f:
                state.ledger.load_bitmaps(f.read())
        except Exception as e:  # not the npz of two bitmaps a checkpoint writes
            raise CheckpointError(
                f"checkpoint {path}: {SAMPLES_FILE} is not the samples bitmap it wrote "
                f"({type(e).__name__}: {exception_text(e, 120)}): resume from another "
                "checkpoint (move this one aside) or start a new run.name"
            ) from None
    return state


def needs_reshard(state: TrainerState, world_size: int, zero_stage: int) -> bool:
    """A ZeRO 1-3 checkpoint written at another world size loads only as a universal one
    (stage 0 keeps whole model and optimizer state on every rank: it loads as it is)."""
    saved = state.world_sizes[-1] if state.world_sizes else world_size
    return saved != world_size and zero_stage > 0


@contextlib.contextmanager
def _weights_only(path: str) -> Iterator[None]:
    """Every ``torch.load`` inside (DeepSpeed's loader and its universal converter pass
    ``weights_only=False``) loads tensors and the allow-listed DeepSpeed classes only; a
    file holding anything else is refused in one line, never run."""
    import importlib

    allowed = []
    for name in DEEPSPEED_GLOBALS:
        module, _, attr = name.rpartition(".")
        allowed.append(getattr(importlib.import_module(module), attr))
    before = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"  # read by torch.load at every call
    try:
        with torch.serialization.safe_globals(allowed):
            yield
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))
        raise CheckpointError(
            f"checkpoint {path} holds a file with Python objects besides tensors"
            f" ({found.group(1) if found else 'not plain data'}): refused to load it"
        ) from None
    finally:
        if before is None:
            del os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"]
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = before


def restore(engine: Any, path: str, rank: int, universal: bool = False) -> str | None:
    """Load model, optimizer and scheduler state (and this rank's RNG) from a checkpoint
    folder; ``universal`` (an engine built with ``load_universal``) reshards it, from
    one conversion the group makes together (:mod:`elastic.train.reshard`; a
    collective: every rank of the group calls it). Returns the universal folder it
    loaded (removed by then), None when it loaded the checkpoint as it is."""
    converted = None
    with _weights_only(path):
        if universal:
            import torch.distributed as dist

            from elastic.train.reshard import shared_universal

            converted, mine = shared_universal(path, rank, dist.get_world_size())
            try:
                load_path, _ = engine.load_checkpoint(converted, tag=DS_TAG)
                # every rank has read it (a rank that failed does not wait here: the
                # others' next collective fails on it, and the group with them)
                dist.barrier()
            finally:
                if mine:
                    shutil.rmtree(converted, ignore_errors=True)
        else:
            load_path, _ = engine.load_checkpoint(path, tag=DS_TAG)
    if load_path is None:
        raise CheckpointError(f"checkpoint {path} has no DeepSpeed state in {DS_TAG}/")
    rng = os.path.join(path, f"rng-rank{rank}.npz")
    if rank == 0 and os.path.exists(os.path.join(path, "rng-rank0.pt")):
        # written before RNG state was npz: that format loads only by unpickling it
        print(f"[elastic] {path}: RNG state of the old format (rng-rank*.pt) not loaded")
    if os.path.exists(rng):  # a rank that did not exist at the saved world size keeps its seed
        load_rng(rng)
    return converted


def load_rng(path: str) -> None:
    """Set torch's, numpy's and Python's RNG state from ``path`` (an npz ``_save_rng``
    wrote); a :class:`CheckpointError` naming the file when it is not one."""
    try:
        _load_rng(path)
    except Exception as e:  # an object array (np.load refuses to unpickle it), another
        # kind of file, or arrays that are no RNG state: the same on every retry
        raise CheckpointError(
            f"checkpoint {path} is not the RNG state it wrote ({type(e).__name__}: "
            f"{exception_text(e, 120)}): refused to load it; resume from another checkpoint"
            " (move this one aside) or start a new run.name"
        ) from None
