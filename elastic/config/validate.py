"""DictConfig from Hydra -> a validated :class:`~elastic.config.schema.TrainConfig`.

:func:`to_typed` runs once, on the driver. After it no code sees Hydra or OmegaConf, and
every mistake a user can make in a config has already failed here with one line that
names the key and the fix (:class:`~elastic.errors.ConfigError`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from elastic.config.schema import RETIRED_KEYS, DataConfig, TrainConfig
from elastic.data.formats import data_format
from elastic.errors import ConfigError
from elastic.fields import allowed, choices_of
from elastic.models import MODEL_SCHEMAS
from elastic.tasks import task_of

__all__ = ["resolve_paths", "to_typed", "validate"]


def to_typed(cfg: DictConfig) -> TrainConfig:
    """DictConfig from Hydra -> validated :class:`TrainConfig` (raises ConfigError)."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"config key {missing[0]} has no value: set it, e.g. {missing[0]}=...")
    _reject_unknown_keys(cfg)
    full = OmegaConf.to_object(cfg)
    _reject_non_finite(full)  # every format's settings too
    typed = _library_classes(full)
    sc = typed.scaling
    if sc.workers is not None:
        if sc.workers < 1:
            raise ConfigError(f"scaling.workers={sc.workers} is not valid: it must be >= 1")
        sc.min_workers = sc.max_workers = sc.workers
    validate(typed)
    return typed


def _library_classes(typed: Any) -> TrainConfig:
    """The config as the library's own classes, carrying only its format's settings.

    Hydra built it from the schema of :func:`elastic.config.compose.train_schema`, whose
    classes hold the settings of every registered format, plugins' too. A run sends its
    config to every worker; if it held another plugin's settings, each worker would have
    to import that plugin to unpickle a config that does not use it (a process that had
    loaded a plugin then failed every later run). So the run carries a plain
    :class:`DataConfig` with its own format's settings, if any, as ``data.<format>``."""
    assert isinstance(typed, TrainConfig)
    data = typed.data
    base = {f.name for f in dataclasses.fields(DataConfig)}
    plain = DataConfig(**{name: getattr(data, name) for name in base})
    if data.format in {f.name for f in dataclasses.fields(data)} - base:
        setattr(plain, data.format, getattr(data, data.format))
    out = TrainConfig(**{f.name: getattr(typed, f.name) for f in dataclasses.fields(TrainConfig)})
    out.data = plain
    return out


def _reject_unknown_keys(node: DictConfig, prefix: str = "") -> None:
    """A key that no schema declares. Hydra's ``+key=value`` adds keys even to a typed
    config, and converting to the dataclasses then drops them without a word: a typo
    such as ``+strategy.zero_stag=2`` would train with the default."""
    schema = OmegaConf.get_type(node)
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        return  # a plain dict (no schema): nothing to compare with
    names = {f.name for f in dataclasses.fields(schema)}
    for key in node:
        full = f"{prefix}{key!s}"
        if key not in names and full in RETIRED_KEYS:
            raise ConfigError(f"config key {full} is retired: {RETIRED_KEYS[full]}")
        if key not in names:
            raise ConfigError(
                f"unknown config key {full}: no such key in {schema.__name__} (a typo? a key "
                "added with '+' must exist); check its spelling against the keys in docs/config.md"
            )
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none():
            _reject_unknown_keys(child, f"{full}.")


def _reject_non_finite(obj: Any, key: str = "") -> None:
    """nan and inf are never a usable setting (optim.lr=inf trained 200 steps at loss nan
    and reported "finished"): every float of every schema, in lists too."""
    import math

    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            _reject_non_finite(getattr(obj, f.name), f"{key}.{f.name}" if key else f.name)
        return
    for v in obj if isinstance(obj, (list, tuple)) else [obj]:
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{key}={obj} is not valid: it must be a finite number")


def validate(cfg: TrainConfig) -> None:
    """Reject every value the run could not use, naming the key and the fix: each
    section's fixed choices, its own checks (its ``validate()``), then what spans
    sections."""
    if type(cfg.model) not in MODEL_SCHEMAS.values():
        raise ConfigError("model is not set: choose one with model=NAME (see conf/model/)")
    for section in dataclasses.fields(cfg):
        if section.name != "model":  # a model family checks its own keys
            _check_choices(getattr(cfg, section.name), f"{section.name}.")
    cfg.strategy.validate()
    cfg.scaling.validate()
    cfg.data.validate()
    data_format(cfg.data.format).check(cfg.data, cfg.model)
    _check_lanes(cfg)
    cfg.trainer.validate()
    if cfg.optim.schedule == "cosine" and cfg.trainer.max_steps == 0:
        raise ConfigError(
            "optim.schedule=cosine decays over trainer.max_steps, which is 0: "
            "set trainer.max_steps (the cosine's length) or optim.schedule=constant"
        )
    cfg.optim.validate()
    if cfg.metrics.target is not None:
        _check_target(cfg)
    cfg.checkpoint.validate()
    cfg.run.validate()
    cfg.cluster.validate()
    _check_cluster_fits(cfg)
    cfg.stragglers.validate()
    _check_live(cfg)
    task = task_of(cfg.model)  # a registered task
    cfg.model.validate()  # the family's own keys first (its message names them)
    task.check_model()  # then what the task needs of the model (classes, outputs)


def _check_live(cfg: TrainConfig) -> None:
    """Live recovery's limits for now: each worker a replica group of its own, whose
    gradients elastic's own all-reduce averages (fp32 ZeRO-0)."""
    if not cfg.scaling.live:
        return
    st = cfg.strategy
    for key, value, need in (
        ("strategy.zero_stage", st.zero_stage, 0),
        ("strategy.precision", st.precision, "fp32"),
        ("strategy.overlap_reduce", st.overlap_reduce, True),
    ):
        if value != need:
            raise ConfigError(
                f"scaling.live=true needs {key}={str(need).lower()} for now (each worker a "
                f"replica group of its own), not {str(value).lower()}: set {key}="
                f"{str(need).lower()} or scaling.live=false"
            )
    if cfg.stragglers.policy != "report":
        raise ConfigError(
            f"scaling.live=true with stragglers.policy={cfg.stragglers.policy}: not yet "
            "(a newcomer lacks the figures the others decide by); use "
            "stragglers.policy=report, or scaling.live=false"
        )


def _check_choices(section: Any, prefix: str) -> None:
    """Every key with a fixed set of values (:func:`~elastic.fields.one_of`) holds
    one of them, in nested sections (data.synthetic) too."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        choices = choices_of(f)
        if choices is not None:
            allowed(f"{prefix}{f.name}", value, choices)
        elif dataclasses.is_dataclass(value):
            _check_choices(value, f"{prefix}{f.name}.")


LANES_PER_WORKER = 8
"""data.lanes=0: this many lanes per worker at scaling.max_workers. A lane split between
two workers is read by both, so the ranks together read at most (lanes + N - 1) / lanes
of the data (<= 1.125 here), and a worker holds about lanes / N + 1 lanes."""


def _check_lanes(cfg: TrainConfig) -> None:
    """Every world size in range must have rows to train, and the lanes must fit the
    global batch; ``data.lanes=0`` becomes the run's lane count here, once, so every
    worker and every checkpoint sees the number the row order was made with."""
    d, sc = cfg.data, cfg.scaling
    if sc.max_workers > d.global_batch_size:
        raise ConfigError(
            f"scaling.max_workers={sc.max_workers} > data.global_batch_size="
            f"{d.global_batch_size}: a worker would have no rows to train; raise the global "
            "batch or lower scaling.max_workers"
        )
    if d.lanes == 0:
        d.lanes = min(d.global_batch_size, LANES_PER_WORKER * sc.max_workers)
    if not 1 <= d.lanes <= d.global_batch_size:
        raise ConfigError(
            f"data.lanes={d.lanes} is not valid: use 1..data.global_batch_size "
            f"({d.global_batch_size}), or 0 for the default"
        )


def _check_cluster_fits(cfg: TrainConfig) -> None:
    """What the embedded cluster is given must be able to run the job: Ray would
    otherwise ask its autoscaler for CPUs no node has, every 35 s, forever."""
    c, sc = cfg.cluster, cfg.scaling
    if c.num_cpus is None or c.address:
        return
    import math

    # the workers, plus one CPU for Ray Data's read and decode tasks
    needed = math.ceil(sc.min_workers * sc.cpus_per_worker - 1e-9) + 1
    if c.num_cpus < needed:
        raise ConfigError(
            f"cluster.num_cpus={c.num_cpus} cannot run scaling.min_workers={sc.min_workers} "
            f"x scaling.cpus_per_worker={sc.cpus_per_worker} plus one CPU for reading data: "
            f"set cluster.num_cpus >= {needed} (or null: all of this machine's)"
        )


def _check_target(cfg: TrainConfig) -> None:
    from elastic.observe.metrics import parse_target

    target = parse_target(cfg.metrics.target or "")
    if target.key.startswith("val/"):
        if not cfg.data.val_path:
            raise ConfigError(
                f"metrics.target={target} needs a validation split: set data.val_path"
            )
        if not cfg.trainer.val_every_steps:
            raise ConfigError(
                f"metrics.target={target} is checked at validations, which run only at the "
                "end with trainer.val_every_steps=0: set trainer.val_every_steps (e.g. 50)"
            )


def resolve_paths(cfg: TrainConfig, base_dir: str) -> TrainConfig:
    """Make every path absolute (relative ones are relative to ``base_dir``, the user's cwd)."""

    def absolute(p: str) -> str:
        p = os.path.expanduser(p)
        return p if os.path.isabs(p) else os.path.normpath(os.path.join(base_dir, p))

    data = dataclasses.replace(
        cfg.data,
        path=absolute(cfg.data.path),
        val_path=absolute(cfg.data.val_path) if cfg.data.val_path else None,
    )
    # replace() copies fields only: keep the format's settings (data.<format>), which
    # to_typed attaches as an attribute; losing them ran image data at the default size
    fields = {f.name for f in dataclasses.fields(cfg.data)}
    data.__dict__.update({k: v for k, v in vars(cfg.data).items() if k not in fields})
    run = dataclasses.replace(cfg.run, storage_path=absolute(cfg.run.storage_path))
    return dataclasses.replace(cfg, data=data, run=run)
