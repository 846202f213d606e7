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

from elastic.config.schema import (
    PLACEMENT_STRATEGIES,
    RETIRED_KEYS,
    STRAGGLER_POLICIES,
    DataConfig,
    TrainConfig,
)
from elastic.data.formats import data_format
from elastic.errors import ConfigError
from elastic.models import MODEL_SCHEMAS


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
                "added with '+' must exist); check its spelling against the README's config keys"
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


def _allowed(key: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not valid: use one of {', '.join(choices)}")


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key}={value} is not valid: it must be {bound}")


def validate(cfg: TrainConfig) -> None:
    """Reject every value the run could not use, naming the key and the fix."""
    s, sc, d, t, o = cfg.strategy, cfg.scaling, cfg.data, cfg.trainer, cfg.optim
    if s.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(
            f"strategy.zero_stage={s.zero_stage} is not valid: use 0, 1, 2 or 3 (DeepSpeed ZeRO)"
        )
    _allowed("strategy.precision", s.precision, ("fp32", "bf16"))
    _positive("strategy.gradient_clipping", s.gradient_clipping, allow_zero=True)
    if sc.min_workers < 1:
        raise ConfigError(f"scaling.min_workers={sc.min_workers} is not valid: it must be >= 1")
    if sc.min_workers > sc.max_workers:
        raise ConfigError(
            f"scaling.min_workers={sc.min_workers} > scaling.max_workers={sc.max_workers}: "
            "set min_workers <= max_workers (to sweep fixed world sizes: -m scaling.workers=1,2)"
        )
    _positive("scaling.cpus_per_worker", sc.cpus_per_worker)
    _positive("data.global_batch_size", d.global_batch_size)
    data_format(d.format).check(d, cfg.model)
    _positive("data.prefetch_mb", d.prefetch_mb)
    _positive("data.cache_mb", d.cache_mb, allow_zero=True)
    _positive("data.shuffle_window_rows", d.shuffle_window_rows)
    if d.micro_batch_size is not None:
        _positive("data.micro_batch_size", d.micro_batch_size)
    _check_lanes(cfg)
    _allowed("scaling.placement_strategy", sc.placement_strategy, PLACEMENT_STRATEGIES)
    if sc.max_failures < -1:
        raise ConfigError(f"scaling.max_failures={sc.max_failures}: use -1 (no limit) or >= 0")
    _positive("scaling.placement_timeout_s", sc.placement_timeout_s, allow_zero=True)
    for key in (
        "resize_interval_s",
        "start_timeout_s",
        "health_check_interval_s",
        "worker_health_check_timeout_s",
        "drain_poll_interval_s",
        "node_refresh_s",
    ):
        _positive(f"scaling.{key}", getattr(sc, key))
    if not str(d.path).strip():
        raise ConfigError("data.path is empty: set data.path=/dir/with/parquet/shards")
    _positive("trainer.max_steps", t.max_steps, allow_zero=True)
    _positive("trainer.max_epochs", t.max_epochs, allow_zero=True)
    if t.max_steps == 0 and t.max_epochs == 0:
        raise ConfigError(
            "trainer.max_steps=0 and trainer.max_epochs=0 would never stop: set one of them > 0"
        )
    if o.schedule == "cosine" and t.max_steps == 0:
        raise ConfigError(
            "optim.schedule=cosine decays over trainer.max_steps, which is 0: "
            "set trainer.max_steps (the cosine's length) or optim.schedule=constant"
        )
    _positive("trainer.log_every_steps", t.log_every_steps)
    _positive("trainer.val_every_steps", t.val_every_steps, allow_zero=True)
    _positive("trainer.stop_at_step", t.stop_at_step, allow_zero=True)
    _allowed("optim.name", o.name, ("adamw", "adam", "sgd"))
    _allowed("optim.schedule", o.schedule, ("constant", "cosine"))
    _positive("optim.lr", o.lr)
    _positive("optim.weight_decay", o.weight_decay, allow_zero=True)
    _positive("optim.eps", o.eps)
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise ConfigError(
            f"optim.betas={list(o.betas)} is not valid: use two numbers in [0, 1), e.g. [0.9,0.999]"
        )
    _positive("optim.warmup_steps", o.warmup_steps, allow_zero=True)
    _allowed("trainer.progress", t.progress, ("auto", "bar", "plain", "off"))
    _positive("trainer.progress_every_s", t.progress_every_s)
    if cfg.metrics.target is not None:
        _check_target(cfg)
    _positive("checkpoint.every_steps", cfg.checkpoint.every_steps, allow_zero=True)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    _allowed("logger.kind", cfg.logger.kind, ("wandb", "none"))
    _allowed("logger.mode", cfg.logger.mode, ("auto", "online", "offline"))
    name = cfg.run.name
    if (
        not name.strip()
        or name in (".", "..")
        or any(c in name for c in "/\\")
        or not name.isprintable()
        or len(name.encode()) > RUN_NAME_BYTES
    ):
        # the run's folder is storage_path/name: ".." would write (and clean stale
        # checkpoints) in the folder that holds every other run; a newline or a name
        # past the filesystem's 255 bytes (with a sweep's "-N") fails far later
        shown = name if len(name) <= 40 else f"{name[:37]}..."
        raise ConfigError(
            f"run.name={shown!r} is not valid: use a plain folder name of at most "
            f"{RUN_NAME_BYTES} bytes, printable (no newline or tab), no '/', not '.' or '..'"
        )
    _check_cluster(cfg)
    _check_stragglers(cfg)
    if type(cfg.model) not in MODEL_SCHEMAS.values():
        raise ConfigError("model is not set: choose one with model=NAME (see conf/model/)")
    cfg.model.validate()


RUN_NAME_BYTES = 200
"""run.name's longest: a folder name (most filesystems take 255 bytes), with room for a
sweep's ``-N`` and the files Ray writes beside it."""

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


# Ray refuses a smaller object store (ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES)
OBJECT_STORE_MINIMUM_MB = 75


def _check_stragglers(cfg: TrainConfig) -> None:
    st = cfg.stragglers
    if not st.threshold > 1:
        raise ConfigError(
            f"stragglers.threshold={st.threshold} is not valid: it must be > 1 (a rank "
            "this many times slower than the others' median, e.g. 1.3)"
        )
    if st.window < 1:
        raise ConfigError(
            f"stragglers.window={st.window} is not valid: it must be >= 1 (log intervals)"
        )
    _allowed("stragglers.policy", st.policy, STRAGGLER_POLICIES)
    _positive("stragglers.cooldown_s", st.cooldown_s, allow_zero=True)
    _positive("stragglers.max_evictions", st.max_evictions, allow_zero=True)
    if st.policy == "evict" and st.max_evictions == 0:
        raise ConfigError(
            "stragglers.policy=evict with stragglers.max_evictions=0 evicts nothing: "
            "allow at least one, or use stragglers.policy=report"
        )


def _check_cluster(cfg: TrainConfig) -> None:
    """What the embedded cluster is given must be able to run the job: Ray would
    otherwise ask its autoscaler for CPUs no node has, every 35 s, forever."""
    c, sc = cfg.cluster, cfg.scaling
    if c.object_store_memory_mb < OBJECT_STORE_MINIMUM_MB:
        raise ConfigError(
            f"cluster.object_store_memory_mb={c.object_store_memory_mb} is not valid: Ray "
            f"needs at least {OBJECT_STORE_MINIMUM_MB}"
        )
    _positive("cluster.connect_timeout_s", c.connect_timeout_s)
    if c.address and not host_port(c.address):
        raise ConfigError(
            f"cluster.address={c.address!r} is not valid: use HOST:PORT of the head's GCS "
            "(e.g. 10.0.0.1:6379), or leave it empty for an embedded local cluster"
        )
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


def host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of ``HOST:PORT`` (``ray://`` allowed, IPv6 in brackets), else None."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


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
