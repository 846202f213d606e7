"""Typed, validated run configuration.

Hydra composes YAML from ``conf/``; :func:`to_typed` turns that DictConfig into the
dataclasses below once, on the driver. After that no code sees Hydra or OmegaConf, and
every mistake a user can make in a config has already failed here with one line that
names the key and the fix (:class:`ConfigError`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

# re-exported: most callers import ConfigError from here
from elastic.errors import ConfigError as ConfigError
from elastic.models import MODEL_SCHEMAS


@dataclass
class SyntheticDataConfig:
    """How to generate the synthetic dataset when ``data.path`` does not exist yet."""

    rows: int = 4096
    val_rows: int = 512
    shards: int = 8
    input_dim: int = 64
    output_dim: int = 1
    seed: int = 0


@dataclass
class DataConfig:
    path: str = MISSING
    """Directory of training Parquet shards."""
    val_path: str | None = None
    """Directory of validation Parquet shards; null = no validation."""
    global_batch_size: int = 64
    """Samples per optimizer step, summed over all workers; kept at every world size."""
    micro_batch_size: int | None = None
    """Per-worker forward batch; the per-worker share (global / world size) must be a
    multiple of it, the rest is gradient accumulation. null = the whole share at once."""
    input_column: str = "x"
    target_column: str = "y"
    format: str = "array"
    """array: the input column holds arrays (fixed-size lists); image: encoded image
    bytes (PNG, JPEG, ...), decoded and resized in Ray Data's map_batches; contacts:
    bit-packed contact maps (datasets/protein), decoded to 0/1 vectors."""
    image_size: int = 32
    """image: decoded images are resized to image_size x image_size."""
    image_channels: int = 1
    """image: 1 (grayscale) or 3 (RGB)."""
    augment_shift: int = 0
    """image: shift each training image by up to this many pixels, by an offset fixed by
    data.seed, the epoch and the sample_id (the same on any worker, after a resume too);
    0 = no augmentation."""
    seed: int = 0
    """Seed of the data's randomness (row order, augmentation)."""
    shuffle_files: bool = True
    """Read the train split's shards in an order fixed by data.seed and the epoch, new
    every epoch (so the workers' shares change too); epochs replayed from the worker
    cache (data.cache_mb) take its blocks in an order fixed by data.seed, the epoch and
    the rank. false = shard order every epoch."""
    shuffle_buffer_rows: int = 1024
    """Each worker mixes its rows through a buffer of this many decoded rows, in an order
    fixed by data.seed, the epoch and the worker's rank (a resume at the same world size
    replays it exactly); a new order every epoch. Memory: rows x decoded row size. 0 =
    rows in shard order (converters already write rows in a seeded random order)."""
    block_size_mb: float = 1.0
    """Largest Ray Data block. Blocks are the unit the workers' splits are dealt in, so
    small blocks keep the workers' shares even (Ray reads small shards as one block);
    small datasets get smaller blocks still, at least 8 per worker."""
    prefetch_mb: float = 128.0
    """Per-worker read-ahead buffer; it also hides the start of the next epoch."""
    cache_mb: float = 512.0
    """Keep each worker's decoded share of the train split in memory after the first
    epoch when the split's uncompressed size over ``scaling.min_workers`` is at most this
    (MiB): later epochs then read nothing. 0 streams every epoch."""
    synthetic: SyntheticDataConfig | None = None
    """Set for generated data: the dataset is written to ``path`` when it is missing."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "constant"
    """constant | cosine (cosine decays to 0 over trainer.max_steps after warmup)."""


@dataclass
class StrategyConfig:
    zero_stage: int = 0
    precision: str = "fp32"
    """fp32 | bf16"""
    gradient_clipping: float = 0.0


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class ScalingConfig:
    min_workers: int = 2
    max_workers: int = 2
    """min < max is elastic: Ray Train runs as many workers as the cluster holds, shrinks
    when a node dies and grows when one joins (restarting from the latest checkpoint)."""
    workers: int | None = None
    """Set: a fixed world size, min_workers = max_workers = workers (for a scaling
    sweep: ``-m scaling.workers=1,2,4``)."""
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    placement_strategy: str = "PACK"
    """How workers are placed on nodes (Ray placement group strategy): PACK fills a node
    first, SPREAD puts them on as many nodes as it can (one worker per node on a batch
    allocation), STRICT_PACK / STRICT_SPREAD insist."""
    batch_policy: str = "strict"
    """strict: every world size in min..max must split data.global_batch_size (a config
    error lists those that do); adjust: a world size that cannot gets the nearest global
    batch it can split, with the learning rate scaled linearly (logged as an event)."""
    max_failures: int = 10
    """Worker/node failures to recover from (Ray's FailureConfig); -1 = no limit.
    Preemptions (node drains) are not counted against it."""
    resize_interval_s: float = 10.0
    """How often a healthy elastic run checks whether more workers fit (Ray default 60)."""
    start_timeout_s: float = 5.0
    """Give up on starting a worker group after this long and retry at the size the
    cluster now holds (Ray default 60: a dead node's workers are waited for that long)."""
    health_check_interval_s: float = 1.0
    """Controller polls of the workers (Ray default 2)."""
    worker_health_check_timeout_s: float = 60.0
    """A worker whose health check hangs this long is dead (Ray default 600)."""
    node_refresh_s: float = 2.0
    """How often the node view Ray Train sizes elastic groups from is refreshed (Ray Data's
    autoscaling coordinator; Ray default 20): a dead node stops being asked for, and a
    new node is used, within this."""
    drain_poll_interval_s: float = 1.0
    """How often Ray Train looks for drained (preempted) nodes (Ray default 5); a drain
    makes the run checkpoint at once."""

    def ray_env(self) -> dict[str, str]:
        """Ray Train's recovery knobs, as the environment its controller reads."""
        return {
            "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(self.start_timeout_s),
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(self.health_check_interval_s),
            "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S": str(self.worker_health_check_timeout_s),
            "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": str(self.drain_poll_interval_s),
        }


@dataclass
class TrainerConfig:
    max_steps: int = 100
    """0 = no step limit (then max_epochs bounds the run)."""
    max_epochs: int = 1
    """0 = no epoch limit (then max_steps bounds the run)."""
    log_every_steps: int = 10
    val_every_steps: int = 0
    """0 = validate only at the end."""
    seed: int = 0
    stop_at_step: int = 0
    """>0: checkpoint and stop after this step, resumable later (a fixed slice of a run)."""
    progress: str = "auto"
    """The driver's progress display: auto (a live bar on a terminal, else a plain line
    with the ETA every progress_every_s) | bar | plain | off."""
    progress_every_s: float = 30.0


@dataclass
class MetricsConfig:
    target: str | None = None
    """A goal on a logged metric, e.g. ``val/accuracy>=0.9`` or ``val/loss<=0.05``:
    summary.json's time_to_target_s is the run's time until it was first met (null if
    never). A val/ goal needs data.val_path and trainer.val_every_steps > 0."""


@dataclass
class CheckpointConfig:
    every_steps: int = 50
    """0 = only at the end."""
    keep: int = 2


@dataclass
class RunConfig:
    name: str = MISSING
    storage_path: str = "runs"
    experiment: str = ""
    """Filled from ``+experiment=NAME`` by the entry point."""
    output_dir: str = ""
    """Hydra's output directory (summary.json goes there); filled by the entry point."""


@dataclass
class LoggerConfig:
    kind: str = "wandb"
    """wandb | none"""
    project: str = "elastic"
    entity: str | None = None
    mode: str = "auto"
    """auto (online when a W&B key is configured, else offline) | online | offline"""


@dataclass
class ClusterConfig:
    address: str = ""
    """Empty: start an embedded local Ray cluster. Else the head's explicit address."""
    num_cpus: int | None = None
    """CPUs for the embedded cluster (null = all of this machine's)."""
    object_store_memory_mb: int = 512


@dataclass
class TrainConfig:
    model: Any = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)


def register_schemas() -> None:
    """Register the schemas so ``conf/`` YAML is type-checked while Hydra composes it."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for name, schema in MODEL_SCHEMAS.items():
        cs.store(group="schema/model", name=name, node=schema)


def to_typed(cfg: DictConfig) -> TrainConfig:
    """DictConfig from Hydra -> validated :class:`TrainConfig` (raises ConfigError)."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"config key {missing[0]} has no value: set it, e.g. {missing[0]}=...")
    _reject_unknown_keys(cfg)
    typed = OmegaConf.to_object(cfg)
    assert isinstance(typed, TrainConfig)
    _reject_non_finite(typed)
    sc = typed.scaling
    if sc.workers is not None:
        if sc.workers < 1:
            raise ConfigError(f"scaling.workers={sc.workers} is not valid: it must be >= 1")
        sc.min_workers = sc.max_workers = sc.workers
    validate(typed)
    return typed


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


def _check_images(d: DataConfig, model: Any) -> None:
    if d.image_size < 4:
        raise ConfigError(f"data.image_size={d.image_size} is not valid: it must be >= 4")
    if d.image_channels not in (1, 3):
        raise ConfigError(
            f"data.image_channels={d.image_channels} is not valid: use 1 (grayscale) or 3 (RGB)"
        )
    if not 0 <= d.augment_shift < d.image_size // 2:
        raise ConfigError(
            f"data.augment_shift={d.augment_shift} is not valid: use 0..{d.image_size // 2 - 1}"
        )
    channels = getattr(model, "in_channels", None)
    if channels is None:
        raise ConfigError(
            f"data.format=image needs an image model, not model={getattr(model, 'name', '?')}: "
            "use model=resnet or model=vit"
        )
    if channels != d.image_channels:
        raise ConfigError(
            f"model.in_channels={channels} but data.image_channels={d.image_channels}: "
            "make them equal"
        )
    side = getattr(model, "image_size", None)  # models whose shape depends on the side
    if side is not None and not model.input_size and side != d.image_size:
        raise ConfigError(
            f"model.image_size={side} but data.image_size={d.image_size}: make them equal"
        )


def _allowed(key: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not valid: use one of {', '.join(choices)}")


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key}={value} is not valid: it must be {bound}")


def valid_world_sizes(cfg: TrainConfig) -> list[int]:
    """World sizes in min..max that split the global batch into whole micro batches."""
    from elastic.batch import BatchPlan

    sizes = range(cfg.scaling.min_workers, cfg.scaling.max_workers + 1)
    ok = []
    for w in sizes:
        try:
            BatchPlan.for_world(cfg.data.global_batch_size, w, cfg.data.micro_batch_size)
        except ValueError:
            continue
        ok.append(w)
    return ok


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
    _allowed("data.format", d.format, ("array", "image", "contacts"))
    if d.format == "image":
        _check_images(d, cfg.model)
    if d.format == "array" and getattr(cfg.model, "input_size", None) == 0:
        raise ConfigError(
            f"model={cfg.model.name} takes images but data.format=array gives flat rows: set "
            "model.input_size (rows of model.in_channels x input_size^2 values) or use image data"
        )
    _positive("data.block_size_mb", d.block_size_mb)
    _positive("data.prefetch_mb", d.prefetch_mb)
    _positive("data.cache_mb", d.cache_mb, allow_zero=True)
    _positive("data.shuffle_buffer_rows", d.shuffle_buffer_rows, allow_zero=True)
    if d.micro_batch_size is not None:
        _positive("data.micro_batch_size", d.micro_batch_size)
    _allowed("scaling.batch_policy", sc.batch_policy, ("strict", "adjust"))
    _allowed("scaling.placement_strategy", sc.placement_strategy, PLACEMENT_STRATEGIES)
    if sc.max_failures < -1:
        raise ConfigError(f"scaling.max_failures={sc.max_failures}: use -1 (no limit) or >= 0")
    for key in (
        "resize_interval_s",
        "start_timeout_s",
        "health_check_interval_s",
        "worker_health_check_timeout_s",
        "drain_poll_interval_s",
        "node_refresh_s",
    ):
        _positive(f"scaling.{key}", getattr(sc, key))
    sizes = range(sc.min_workers, sc.max_workers + 1)
    ok = valid_world_sizes(cfg)
    bad = [w for w in sizes if w not in ok]
    if bad and sc.batch_policy == "strict":
        works = f"it does at {', '.join(map(str, ok))}" if ok else "it does at none of them"
        raise ConfigError(
            f"data.global_batch_size={d.global_batch_size} does not split into whole micro "
            f"batches (micro_batch_size={d.micro_batch_size}) at world size "
            f"{', '.join(map(str, bad))} of {sc.min_workers}..{sc.max_workers} ({works}): "
            f"use a multiple of {_lcm_hint(cfg)}, narrow the scaling range, or set "
            "scaling.batch_policy=adjust"
        )
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
    if not name.strip() or name in (".", "..") or any(c in name for c in "/\\\0"):
        # the run's folder is storage_path/name: ".." would write (and clean stale
        # checkpoints) in the folder that holds every other run
        raise ConfigError(
            f"run.name={name!r} is not valid: use a plain folder name (no '/', not '.' or '..')"
        )
    _check_cluster(cfg)
    if type(cfg.model) not in MODEL_SCHEMAS.values():
        raise ConfigError("model is not set: choose one with model=NAME (see conf/model/)")
    cfg.model.validate()


# Ray refuses a smaller object store (ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES)
OBJECT_STORE_MINIMUM_MB = 75


def _check_cluster(cfg: TrainConfig) -> None:
    """What the embedded cluster is given must be able to run the job: Ray would
    otherwise ask its autoscaler for CPUs no node has, every 35 s, forever."""
    c, sc = cfg.cluster, cfg.scaling
    if c.object_store_memory_mb < OBJECT_STORE_MINIMUM_MB:
        raise ConfigError(
            f"cluster.object_store_memory_mb={c.object_store_memory_mb} is not valid: Ray "
            f"needs at least {OBJECT_STORE_MINIMUM_MB}"
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


def _check_target(cfg: TrainConfig) -> None:
    from elastic.metrics import parse_target

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


def _lcm_hint(cfg: TrainConfig) -> int:
    import math

    micro = cfg.data.micro_batch_size or 1
    lcm = 1
    for w in range(cfg.scaling.min_workers, cfg.scaling.max_workers + 1):
        lcm = math.lcm(lcm, w * micro)
    return lcm


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
    run = dataclasses.replace(cfg.run, storage_path=absolute(cfg.run.storage_path))
    return dataclasses.replace(cfg, data=data, run=run)
