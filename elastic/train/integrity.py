"""Checkpoint integrity: the folder layout's names, the per-rank manifests (size and
sha256 of every file; rank 0 adds the model's shapes), the checks before a resume, and
the fallback from a damaged newest checkpoint to the newest intact one.

Before a run resumes, the driver checks the newest checkpoint Ray Train registered
against its manifests (:func:`prepare_resume`); a damaged one is moved aside
(``step=...damaged``) and dropped from Ray Train's list, and the run resumes from the
newest intact one. Nothing is unpickled: DeepSpeed's files are scanned for classes
beyond :data:`DEEPSPEED_GLOBALS` without running them (:func:`refuse_unsafe`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

import torch

from elastic.errors import CheckpointError, exception_text

DS_TAG = "model"
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


def manifest_name(rank: int) -> str:
    return f"manifest-rank{rank}.json"


def registered_steps(run_dir: str) -> list[int]:
    """Steps of the checkpoints Ray Train has registered (complete on every rank): the
    ones a restarted worker group may resume from."""
    try:
        with open(os.path.join(run_dir, RAY_SNAPSHOT)) as f:
            snapshot = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):  # none yet, or being replaced
        return []
    names = [r["checkpoint_dir_name"] for r in snapshot["checkpoint_results"]]
    return [int(n.split("=")[1]) for n in names]


def damage(path: str, hashes: bool = True) -> str | None:
    """What is wrong with the checkpoint folder ``path``, naming the file, or None when
    every file is as its rank wrote it (or the checkpoint predates manifests: nothing to
    compare with). ``hashes=False``: sizes only (a stat a file, no read)."""
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
    for rel, _, sha256 in listed if hashes else []:
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


@dataclass
class Resume:
    """Where a (re)started run resumes, as :func:`prepare_resume` found it."""

    path: str | None
    """The checkpoint folder (None: a new run)."""
    registered: bool
    """Ray Train hands it to the workers (it is the newest in its list); False: its
    list was missing or unreadable, and the workers take ``path`` from the driver."""
    warnings: list[str]


def prepare_resume(run_dir: str, model_cfg: Any) -> Resume:
    """Before a run (re)starts, on the driver: the checkpoint Ray Train will hand the
    workers must be intact and fit the configured model.

    Ray Train resumes from the newest checkpoint in its list (``RAY_SNAPSHOT``) and
    refuses to start when a listed folder is gone. So a folder deleted by hand is dropped
    from the list; a damaged newest one is moved aside as ``step=N.damaged`` and dropped,
    and the run resumes from the newest intact one. A list that is missing or unreadable
    (while checkpoint folders are there) would make Ray Train start the run from step 0,
    and its first worker group remove every checkpoint: the list is moved aside and the
    run resumes from the newest checkpoint folder whose manifests verify
    (:func:`_newest_verified`), handed to the workers by the driver. Raises
    :class:`CheckpointError`, changing nothing, when no checkpoint is intact or the one
    to resume from does not fit. Also removes what a killed save left in the staging
    folder (no worker of this run is alive now)."""
    shutil.rmtree(os.path.join(run_dir, STAGING_DIR), ignore_errors=True)
    snapshot_path = os.path.join(run_dir, RAY_SNAPSHOT)
    snapshot, unreadable = _read_snapshot(snapshot_path)
    if snapshot is None:
        return _resume_without_list(run_dir, model_cfg, unreadable)
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
        _check_fits(os.path.join(run_dir, resume), model_cfg)
    for name, why in damaged:
        aside = set_aside(os.path.join(run_dir, name))
        warnings.append(
            f"checkpoint {os.path.join(run_dir, name)} is damaged ({why}): moved to {aside};"
            f" resuming from {resume}"
        )
    warnings += [f"checkpoint {os.path.join(run_dir, n)} was deleted: dropped" for n in gone]
    if gone or damaged:
        _drop_from_snapshot(snapshot_path, snapshot, {*gone, *(n for n, _ in damaged)})
    return Resume(os.path.join(run_dir, resume) if resume else None, True, warnings)


def _read_snapshot(path: str) -> tuple[dict[str, Any] | None, str | None]:
    """Ray Train's checkpoint list, or (None, why it cannot be used; None: there is none)."""
    try:
        with open(path) as f:
            snapshot = json.load(f)
        names = [r["checkpoint_dir_name"] for r in snapshot["checkpoint_results"]]
        latest = snapshot["latest_checkpoint_result"]
        pending = [r["checkpoint_dir_name"] for r in snapshot["pending_training_results"]]
        # what Ray Train's loader asserts, or looks up without a check
        if len(snapshot["checkpoint_report_indices"]) != len(names) or len(pending) != len(
            snapshot["pending_validation_specs"]
        ):
            raise ValueError("its lists do not pair up")
        if not all(isinstance(n, str) for n in names):
            raise ValueError("a checkpoint without a folder name")
        for name in [*pending, *([latest["checkpoint_dir_name"]] if latest else [])]:
            if name not in names:
                raise ValueError(f"it names {name}, which is not in its list")
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return None, f"{type(e).__name__}: {exception_text(e, 120)}"
    return snapshot, None


def step_folders(run_dir: str) -> list[tuple[int, str]]:
    """(step, folder name) of every ``step=N`` folder in the run, newest first."""
    found = []
    for name in os.listdir(run_dir) if os.path.isdir(run_dir) else []:
        step = name.removeprefix("step=")
        if step != name and step.isdigit() and os.path.isdir(os.path.join(run_dir, name)):
            found.append((int(step), name))
    return sorted(found, reverse=True)


def _newest_verified(run_dir: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest checkpoint folder that has its manifests and verifies against them,
    and (folder, why) of each newer one that does not."""
    newer: list[tuple[str, str]] = []
    for _, name in step_folders(run_dir):
        why = unverified(os.path.join(run_dir, name))
        if why is None:
            return name, newer
        newer.append((name, why))
    return None, newer


def unverified(folder: str, hashes: bool = True) -> str | None:
    """Why the checkpoint folder is not known to be complete and as written (it has no
    manifests, or :func:`damage`), else None."""
    if not any(MANIFEST_RE.fullmatch(n) for n in os.listdir(folder)):
        return "no manifests: not known to be complete"
    return damage(folder, hashes)


def _resume_without_list(run_dir: str, model_cfg: Any, unreadable: str | None) -> Resume:
    """No usable Ray Train list: the newest verified checkpoint folder, if any. Folders
    newer than it (or all, when none verifies: a run killed while its first checkpoint
    was written has one half-written and no list yet) are moved aside, never deleted,
    and a list that cannot be read too; the run then starts afresh or resumes."""
    resume, newer = _newest_verified(run_dir)
    listed = f"unreadable ({unreadable})" if unreadable else "missing"
    if resume is not None:  # before anything is moved: a refusal changes nothing
        _check_fits(os.path.join(run_dir, resume), model_cfg)
    warnings = []
    if unreadable:
        aside = set_aside(os.path.join(run_dir, RAY_SNAPSHOT))
        warnings.append(f"Ray Train's checkpoint list in {run_dir} is {listed}: moved to {aside}")
    for name, why in newer:
        aside = set_aside(os.path.join(run_dir, name))
        warnings.append(f"checkpoint {os.path.join(run_dir, name)} ({why}) moved to {aside}")
    if resume is None:
        if newer:
            warnings.append(f"no checkpoint in {run_dir} verifies: the run starts from step 0")
        return Resume(None, True, warnings)
    warnings.insert(
        0,
        f"Ray Train's checkpoint list in {run_dir} is {listed}: resuming from the newest "
        f"checkpoint whose manifests verify, {resume} (no checkpoint is deleted; the older "
        "ones no longer count in checkpoint.keep: delete them when you no longer need them)",
    )
    return Resume(os.path.join(run_dir, resume), False, warnings)


def _check_fits(path: str, model_cfg: Any) -> None:
    refuse_unsafe(path)
    check_model(path, model_cfg)


def set_aside(folder: str, why: str = "damaged") -> str:
    """Rename a folder (or file) out of the way as ``NAME.why`` (``.why-2``...): a later
    save of its step gets a fresh folder, and nothing is deleted."""
    aside, n = f"{folder}.{why}", 1
    while os.path.exists(aside):
        n += 1
        aside = f"{folder}.{why}-{n}"
    os.rename(folder, aside)
    return aside


def _drop_from_snapshot(path: str, snapshot: dict[str, Any], names: set[str]) -> None:
    """Rewrite Ray Train's checkpoint list without ``names`` (its format as of Ray 2.60:
    the newest remaining one becomes the latest)."""

    def without(results_key: str, paired_key: str) -> list[tuple[Any, Any]]:
        """The (result, paired value) pairs of two parallel lists, minus ``names``."""
        pairs = zip(snapshot[results_key], snapshot[paired_key], strict=True)
        kept = [(r, v) for r, v in pairs if r["checkpoint_dir_name"] not in names]
        snapshot[results_key], snapshot[paired_key] = [r for r, _ in kept], [v for _, v in kept]
        return kept

    kept = without("checkpoint_results", "checkpoint_report_indices")
    snapshot["latest_checkpoint_result"] = max(kept, key=lambda ri: ri[1])[0] if kept else None
    without("pending_training_results", "pending_validation_specs")
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
