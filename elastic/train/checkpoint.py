"""Checkpoints: DeepSpeed state from every rank plus the trainer's own state.

Every rank writes its DeepSpeed shard files into a private temp dir and reports it to Ray
Train, which merges the ranks' files into one folder (``step=000001200``) and registers
it only once every rank has reported: a save killed halfway is never the latest
checkpoint. Rank 0 adds ``trainer_state.json`` (step, epoch, batch plan, history) and
``samples.npz`` (the epoch's sample bitmap); each rank adds its RNG state.

Restore at the saved world size loads the files as they are. A ZeRO 1-3 checkpoint
restored at another world size is first converted to a DeepSpeed universal checkpoint
in the run's staging folder (the checkpoint is never modified) and loaded resharded.

Trust: each rank also writes ``manifest-rank{r}.json`` (size and sha256 of every file it
wrote; rank 0 adds the model's parameter shapes). Before a run resumes, the driver checks
the newest checkpoint Ray Train registered against its manifests; a damaged one is moved
aside (``step=...damaged``) and dropped from Ray Train's list, and the run resumes from the
newest intact one. Loading never unpickles arbitrary objects: the trainer's own state is
JSON and npz, DeepSpeed's files load with ``weights_only=True`` and an allow-list of the
three DeepSpeed classes they hold.
"""

from __future__ import annotations

import contextlib
import hashlib
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

from elastic.errors import CheckpointError
from elastic.train.accounting import SampleLedger

DS_TAG = "model"
STATE_FILE = "trainer_state.json"
SAMPLES_FILE = "samples.npz"
MANIFEST_RE = re.compile(r"manifest-rank(\d+)\.json")
STAGING_DIR = ".staging"
"""Under the run's folder: where ranks write a checkpoint before Ray Train copies it into
its ``step=N`` folder (a process killed meanwhile leaves it there, not in /tmp; the next
start of the run removes it)."""
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"
"""Ray Train's list of the run's registered checkpoints (in the run's folder)."""
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
)
"""The only non-tensor classes DeepSpeed's checkpoint files hold (ZeRO 0-3, fp32 and bf16,
and the universal conversion's files): plain records, safe to build on load."""


def step_dir_name(step: int) -> str:
    return f"step={step:09d}"


def manifest_name(rank: int) -> str:
    return f"manifest-rank{rank}.json"


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


def damage(path: str) -> str | None:
    """What is wrong with the checkpoint folder ``path``, naming the file, or None when
    every file is as its rank wrote it (or the checkpoint predates manifests: nothing to
    compare with)."""
    if not os.path.isdir(path):
        return "the folder is missing"
    if not any(MANIFEST_RE.fullmatch(n) for n in os.listdir(path)):
        return None
    listed: list[tuple[str, int, str]] = []  # (file, bytes, sha256) of every rank
    world, rank = 1, 0
    while rank < world:
        name = manifest_name(rank)
        try:
            with open(os.path.join(path, name)) as f:
                manifest = json.load(f)
            world = int(manifest["world_size"]) if rank == 0 else world
            listed += [(rel, m["bytes"], m["sha256"]) for rel, m in manifest["files"].items()]
        except FileNotFoundError:
            return f"{name} is missing"
        except (ValueError, KeyError, TypeError, AttributeError):
            return f"{name} is unreadable"
        rank += 1
    for rel, size, _ in listed:  # sizes first: a truncated file is found without reading
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            return f"{rel} is missing"
        if os.path.getsize(full) != size:
            return f"{rel} has {os.path.getsize(full)} bytes, {size} when written"
    for rel, _, sha256 in listed:
        if _sha256(os.path.join(path, rel)) != sha256:
            return f"{rel} is not what was written (sha256 differs)"
    return None


def refuse_unsafe(path: str) -> None:
    """Refuse, naming the file, a checkpoint whose DeepSpeed files hold classes beyond
    DeepSpeed's allow-list (read from the pickle's opcodes: nothing is run). Loading
    refuses them anyway (see ``restore``); this names the file, before Ray starts."""
    for root, _, names in os.walk(os.path.join(path, DS_TAG)):
        for name in sorted(n for n in names if n.endswith(".pt")):
            full = os.path.join(root, name)
            try:
                unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(full)
            except Exception:  # not a zip checkpoint: the weights-only load decides
                continue
            unsafe = sorted(set(unsafe) - set(DEEPSPEED_GLOBALS))
            if unsafe:
                raise CheckpointError(
                    f"checkpoint {path}: {os.path.relpath(full, path)} holds Python objects"
                    f" besides tensors ({', '.join(unsafe)}): refused to load it (loading"
                    " would run them); resume from another checkpoint or a new run.name"
                )


def check_intact(path: str) -> None:
    """A worker's check of the checkpoint it resumes from (the driver checked the run's
    newest at start; this covers a restart within the run)."""
    why = damage(path)
    if why:
        raise CheckpointError(
            f"checkpoint {path} is damaged ({why}): run the same command again to resume"
            " from the newest intact checkpoint (the damaged one is then moved aside)"
        )
    refuse_unsafe(path)


def check_model(path: str, model_cfg: Any) -> None:
    """Refuse a checkpoint written for another model than ``model_cfg`` builds, naming the
    first key that differs (shapes from the checkpoint's manifest; the model is built on
    the meta device: no memory)."""
    try:
        with open(os.path.join(path, manifest_name(0))) as f:
            saved = json.load(f)["model"]
    except FileNotFoundError:
        return  # written before manifests existed
    with torch.device("meta"):
        configured = _shapes(model_cfg.build())
    for key in [*saved, *(k for k in configured if k not in saved)]:
        if saved.get(key) == configured.get(key):
            continue
        if key not in configured:
            diff = f"{key}: in the checkpoint, not in the configured model"
        elif key not in saved:
            diff = f"{key}: in the configured model, not in the checkpoint"
        else:
            shape = "x".join
            diff = (
                f"{key}: {shape(map(str, saved[key]))} in the checkpoint,"
                f" {shape(map(str, configured[key]))} configured"
            )
        raise CheckpointError(
            f"checkpoint {path} was written for another model ({diff}): use the model"
            " config it was trained with, or a new run.name"
        )


def prepare_resume(run_dir: str, model_cfg: Any) -> list[str]:
    """Before a run (re)starts, on the driver: the checkpoint Ray Train will hand the
    workers must be intact and fit the configured model.

    Ray Train resumes from the newest checkpoint in its list (``RAY_SNAPSHOT``) and
    refuses to start when a listed folder is gone. So a folder deleted by hand is dropped
    from the list; a damaged newest one is moved aside as ``step=N.damaged`` and dropped,
    and the run resumes from the newest intact one. Returns a warning per change; raises
    :class:`CheckpointError`, changing nothing, when no listed checkpoint is intact or
    the one to resume from does not fit. Also removes what a killed save left in the
    staging folder (no worker of this run is alive now)."""
    shutil.rmtree(os.path.join(run_dir, STAGING_DIR), ignore_errors=True)
    snapshot_path = os.path.join(run_dir, RAY_SNAPSHOT)
    if not os.path.exists(snapshot_path):
        return []
    with open(snapshot_path) as f:
        snapshot = json.load(f)
    results = snapshot["checkpoint_results"]
    order = sorted(
        range(len(results)), key=lambda i: snapshot["checkpoint_report_indices"][i], reverse=True
    )
    resume: str | None = None
    gone: list[str] = []
    damaged: list[tuple[str, str]] = []
    for i in order:  # newest first
        name = results[i]["checkpoint_dir_name"]
        folder = os.path.join(run_dir, name)
        if not os.path.isdir(folder):
            gone.append(name)
        elif resume is None:
            why = damage(folder)
            if why:
                damaged.append((name, why))
            else:
                resume = name
    if resume is None and results:
        found = "; ".join([*(f"{n}: {why}" for n, why in damaged), *(f"{n}: gone" for n in gone)])
        raise CheckpointError(
            f"no intact checkpoint left in {run_dir} ({found}): resume needs one; start"
            f" over with a new run.name (or delete {run_dir})"
        )
    warnings = []
    if resume is not None:
        refuse_unsafe(os.path.join(run_dir, resume))
        check_model(os.path.join(run_dir, resume), model_cfg)
    for name, why in damaged:
        aside = _set_aside(os.path.join(run_dir, name))
        warnings.append(
            f"checkpoint {os.path.join(run_dir, name)} is damaged ({why}): moved to {aside};"
            f" resuming from {resume}"
        )
    warnings += [f"checkpoint {os.path.join(run_dir, n)} was deleted: dropped" for n in gone]
    if gone or damaged:
        _drop_from_snapshot(snapshot_path, snapshot, {*gone, *(n for n, _ in damaged)})
    return warnings


def _set_aside(folder: str) -> str:
    """Rename a damaged checkpoint out of the way (``step=N.damaged``, ``.damaged-2``...):
    a later save of step N gets a fresh folder, and nothing is deleted."""
    aside, n = f"{folder}.damaged", 1
    while os.path.exists(aside):
        n += 1
        aside = f"{folder}.damaged-{n}"
    os.rename(folder, aside)
    return aside


def _drop_from_snapshot(path: str, snapshot: dict[str, Any], names: set[str]) -> None:
    """Rewrite Ray Train's checkpoint list without ``names`` (its format as of Ray 2.60:
    the newest remaining one becomes the latest)."""
    keep = [
        (r, i)
        for r, i in zip(
            snapshot["checkpoint_results"], snapshot["checkpoint_report_indices"], strict=True
        )
        if r["checkpoint_dir_name"] not in names
    ]
    snapshot["checkpoint_results"] = [r for r, _ in keep]
    snapshot["checkpoint_report_indices"] = [i for _, i in keep]
    snapshot["latest_checkpoint_result"] = max(keep, key=lambda ri: ri[1])[0] if keep else None
    pending = [
        (r, spec)
        for r, spec in zip(
            snapshot["pending_training_results"], snapshot["pending_validation_specs"], strict=True
        )
        if r["checkpoint_dir_name"] not in names
    ]
    snapshot["pending_training_results"] = [r for r, _ in pending]
    snapshot["pending_validation_specs"] = [s for _, s in pending]
    for key in (
        "validated_checkpoint_dir_names",
        "timed_out_validation_checkpoint_dir_names",
        "failed_validation_checkpoint_dir_names",
    ):
        snapshot[key] = [n for n in snapshot.get(key, []) if n not in names]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(snapshot, f)
    os.replace(tmp, path)


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


def write_manifest(engine: Any, rank: int, world_size: int, path: str) -> None:
    """List every file in ``path`` (this rank's part only: its private staging folder)
    with its size and sha256; rank 0 adds the world size and the model's shapes."""
    files = {}
    for root, _, names in os.walk(path):
        for name in sorted(names):
            full = os.path.join(root, name)
            files[os.path.relpath(full, path)] = {
                "bytes": os.path.getsize(full),
                "sha256": _sha256(full),
            }
    manifest: dict[str, Any] = {"rank": rank, "world_size": world_size, "files": files}
    if rank == 0:
        manifest["model"] = _shapes(engine.module)
    with open(os.path.join(path, manifest_name(rank)), "w") as f:
        json.dump(manifest, f, indent=1)


def _sha256(path: str) -> str:
    h = hashlib.sha256()  # ~1 GB/s here: 0.1 s for a 100 MB checkpoint
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _shapes(module: torch.nn.Module) -> dict[str, list[int]]:
    """Every parameter's and buffer's full shape (ZeRO-3 keeps it in ``ds_shape``: the
    tensor itself is this rank's partition)."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return {name: list(getattr(t, "ds_shape", t.shape)) for name, t in tensors}


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
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_state(path: str) -> TrainerState:
    """Trainer state of a checkpoint folder (no engine needed: tests and reports use it)."""
    state = TrainerState()
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            state.load_state_dict(json.load(f))
    except (OSError, ValueError) as e:  # a checkpoint written before manifests existed
        raise CheckpointError(f"checkpoint {path}: {STATE_FILE} is unreadable ({e})") from None
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
    """Convert the DeepSpeed checkpoint in ``path`` to a universal one in a fresh folder
    next to it, under the run's staging folder (the checkpoint itself is never modified;
    the caller removes the folder)."""
    import argparse
    import io

    from deepspeed.checkpoint import ds_to_universal

    staging = os.path.join(os.path.dirname(os.path.abspath(path)), STAGING_DIR)
    os.makedirs(staging, exist_ok=True)
    out = tempfile.mkdtemp(prefix=f"universal-p{os.getpid()}-", dir=staging)
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


def restore(engine: Any, path: str, rank: int, universal: bool = False) -> None:
    """Load model, optimizer and scheduler state (and this rank's RNG) from a checkpoint
    folder; ``universal`` (an engine built with ``load_universal``) reshards it."""
    with _weights_only(path):
        if universal:
            converted = to_universal(path)
            try:
                load_path, _ = engine.load_checkpoint(converted, tag=DS_TAG)
            finally:
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
        try:
            _load_rng(rng)
        except ValueError as e:  # an object array: np.load refuses to unpickle it
            raise CheckpointError(
                f"checkpoint {path}: {os.path.basename(rng)} is not plain arrays ({e}):"
                " refused to load it"
            ) from None
