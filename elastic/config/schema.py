"""The run's typed configuration: one dataclass per config group.

Hydra composes YAML from ``conf/`` against these schemas (registered in its ConfigStore
by :func:`elastic.config.compose.register_schemas`), so a typo or a wrong type fails
while composing. Defaults live here and in ``conf/``. Each section checks its own keys
(its ``validate()``); :func:`elastic.config.validate.validate` runs them, the choices
(:func:`one_of`) and the checks that span sections. docs/config.md lists every key with
its default and choices (tests/test_docs.py holds it to these classes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from omegaconf import MISSING

from elastic.errors import ConfigError

CHOICES = "choices"
"""The field metadata that holds a key's fixed set of values (:func:`one_of`)."""


def one_of(choices: Any, default: str) -> Any:
    """A key whose value is one of the ``Literal`` type ``choices``, with this default.

    OmegaConf 2.3 refuses ``Literal`` annotations in structured configs, so the key is
    typed ``str`` and its choices ride on the field: validation (and its message) and
    the docs test read them from there (:func:`choices_of`), nowhere else."""
    values = get_args(choices)
    if default not in values:
        raise ValueError(f"default {default!r} is not one of {values}")
    return field(default=default, metadata={CHOICES: values})


def choices_of(f: dataclasses.Field[Any]) -> tuple[str, ...] | None:
    """The fixed set of values of the key ``f``, or None where it takes any value."""
    return f.metadata.get(CHOICES)


def allowed(key: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not valid: use one of {', '.join(choices)}")


def positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key}={value} is not valid: it must be {bound}")


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
    """Samples per optimizer step, summed over all workers: the same rows at every world
    size from 1 to this number (data.lanes), which need not divide it."""
    micro_batch_size: int | None = None
    """Largest forward batch per worker: a worker's slice of a step (the global batch
    over the world size, give or take a row) is cut into as many micro batches as the
    largest slice needs (gradient accumulation). null = the whole slice at once."""
    input_column: str = "x"
    target_column: str = "y"
    format: str = "array"
    """array: the input column holds arrays (fixed-size lists); image: encoded image
    bytes (PNG, JPEG, ...), decoded and resized in Ray Data's map_batches; contacts:
    bit-packed contact maps (datasets/protein), decoded to 0/1 vectors. A format's own
    settings are the keys data.<format>.* (e.g. data.image.size): see
    :func:`elastic.config.compose.train_schema`."""
    seed: int = 0
    """Seed of the data's randomness (every epoch's row order, augmentation)."""
    shuffle: bool = True
    """A new row order every epoch, fixed by data.seed and the epoch: the row groups in a
    shuffled order, the rows of each lane's windows permuted (data.shuffle_window_rows).
    false = the shards' own order every epoch."""
    lanes: int = 0
    """Canonical lanes the epoch's rows are dealt into (README "When a node dies or
    joins"): every global batch takes the same rows of every lane whatever the world
    size, so the lane count is part of the run's row order (set it to compare runs of
    different scaling.max_workers). A worker holds and reads about lanes / world size + 1
    lanes; a lane split between two workers is read by both. 0 = 8 x
    scaling.max_workers, at most data.global_batch_size."""
    shuffle_window_rows: int = 256
    """Rows of a lane permuted together (a seekable shuffle: a resume finds its rows from
    the Parquet footers). Memory: each worker holds, decoded, a window and a row group
    for each of its lanes. 1 = each lane's rows in shard order."""
    prefetch_mb: float = 128.0
    """Per-worker read-ahead buffer of decoded row groups; it also hides the start of the
    next epoch."""
    cache_mb: float = 512.0
    """When the whole train split, decoded, is at most this (MiB), each worker keeps
    every row group it decodes: it reads each one once per run, and later epochs come
    from memory. 0 streams every epoch."""
    synthetic: SyntheticDataConfig | None = None
    """Set for generated data: the dataset is written to ``path`` when it is missing."""

    def validate(self) -> None:
        """The format's own checks, and the lanes against the world sizes, are
        :func:`elastic.config.validate.validate`'s (they need the model and scaling)."""
        positive("data.global_batch_size", self.global_batch_size)
        positive("data.prefetch_mb", self.prefetch_mb)
        positive("data.cache_mb", self.cache_mb, allow_zero=True)
        positive("data.shuffle_window_rows", self.shuffle_window_rows)
        if self.micro_batch_size is not None:
            positive("data.micro_batch_size", self.micro_batch_size)
        if not str(self.path).strip():
            raise ConfigError("data.path is empty: set data.path=/dir/with/parquet/shards")


@dataclass
class OptimConfig:
    name: str = one_of(Literal["adamw", "adam", "sgd"], "adamw")
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = one_of(Literal["constant", "cosine"], "constant")
    """cosine decays to 0 over trainer.max_steps after the warmup."""

    def validate(self) -> None:
        positive("optim.lr", self.lr)
        positive("optim.weight_decay", self.weight_decay, allow_zero=True)
        positive("optim.eps", self.eps)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(
                f"optim.betas={list(self.betas)} is not valid: use two numbers in [0, 1), "
                "e.g. [0.9,0.999]"
            )
        positive("optim.warmup_steps", self.warmup_steps, allow_zero=True)


@dataclass
class StrategyConfig:
    zero_stage: int = 2
    """DeepSpeed ZeRO stage 0-3 (0: plain data parallelism)."""
    precision: str = one_of(Literal["fp32", "bf16"], "fp32")
    gradient_clipping: float = 0.0
    overlap_reduce: bool = True
    """fp32 ZeRO-0: true, elastic's gradient all-reduce, started bucket by bucket during
    the backward pass (elastic/train/reduce.py; the same result up to fp32 rounding,
    0.969x the step time with DeepSpeed's on 2 cores: docs/performance.md#step-overhead);
    false, DeepSpeed's, after it (needed where a parameter takes two gradients in one
    backward pass, e.g. reentrant activation checkpointing, or layers are frozen or
    unfrozen during the run: refused in one line otherwise). Other stages, bf16,
    mixture-of-experts and sparse embeddings keep DeepSpeed's whatever this says."""

    def validate(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(
                f"strategy.zero_stage={self.zero_stage} is not valid: use 0, 1, 2 or 3 "
                "(DeepSpeed ZeRO)"
            )
        positive("strategy.gradient_clipping", self.gradient_clipping, allow_zero=True)


RETIRED_KEYS = {
    # key: what became of it (named when a config or command line still sets it)
    "data.shuffle_files": "it is data.shuffle now",
    "data.shuffle_buffer_rows": "it is data.shuffle_window_rows now (rows permuted together "
    "in each lane)",
    "data.block_size_mb": "it is gone: Ray Data reads one row group a block",
    "scaling.batch_policy": "it is gone: every world size up to data.global_batch_size trains "
    "the same global batch, whether or not it divides it",
}


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
    placement_strategy: str = one_of(
        Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"], "PACK"
    )
    """How workers are placed on nodes (Ray placement group strategy): PACK fills a node
    first, SPREAD puts them on as many nodes as it can (one worker per node on a batch
    allocation), STRICT_PACK / STRICT_SPREAD insist."""
    max_failures: int = 10
    """Worker/node failures to recover from (Ray's FailureConfig); -1 = no limit.
    Preemptions (node drains) are not counted against it."""
    resize_interval_s: float = 10.0
    """How often a healthy elastic run checks whether more workers fit (Ray default 60)."""
    start_timeout_s: float = 5.0
    """Give up on starting a worker group after this long and retry at the size the
    cluster now holds (Ray default 60: a dead node's workers are waited for that long)."""
    placement_timeout_s: float = 600.0
    """End the run (one line, naming what the nodes offer) when no worker group has been
    up for this long while one is being started: nodes gone below scaling.min_workers,
    or a placement the cluster cannot give (Ray Train would retry forever). 0 = wait
    as long as it takes (for nodes that are yet to join)."""
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

    def validate(self) -> None:
        """scaling.workers is resolved (and checked) before, by
        :func:`elastic.config.validate.to_typed`."""
        if self.min_workers < 1:
            raise ConfigError(
                f"scaling.min_workers={self.min_workers} is not valid: it must be >= 1"
            )
        if self.min_workers > self.max_workers:
            raise ConfigError(
                f"scaling.min_workers={self.min_workers} > scaling.max_workers="
                f"{self.max_workers}: set min_workers <= max_workers (to sweep fixed world "
                "sizes: -m scaling.workers=1,2)"
            )
        positive("scaling.cpus_per_worker", self.cpus_per_worker)
        if self.max_failures < -1:
            raise ConfigError(
                f"scaling.max_failures={self.max_failures}: use -1 (no limit) or >= 0"
            )
        positive("scaling.placement_timeout_s", self.placement_timeout_s, allow_zero=True)
        for key in (
            "resize_interval_s",
            "start_timeout_s",
            "health_check_interval_s",
            "worker_health_check_timeout_s",
            "drain_poll_interval_s",
            "node_refresh_s",
        ):
            positive(f"scaling.{key}", getattr(self, key))

    def ray_env(self) -> dict[str, str]:
        """Ray Train's recovery knobs, as the environment its controller reads."""
        return {
            "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(self.start_timeout_s),
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(self.health_check_interval_s),
            "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S": str(self.worker_health_check_timeout_s),
            "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": str(self.drain_poll_interval_s),
        }


@dataclass
class StragglersConfig:
    threshold: float = 1.3
    """A rank whose compute time per step (forward + local backward + optimizer, no
    collective wait) is over this x the median of the other ranks' ..."""
    window: int = 3
    """... for this many log intervals in a row is a straggler (an event, a console
    line, a W&B alert)."""
    policy: str = one_of(Literal["report", "rebalance", "evict"], "report")
    """report: detect and report. rebalance: each rank's share of every step's rows
    follows its measured speed, re-evaluated every window (the step's rows and the
    gradient stay the same). evict: checkpoint, keep the straggler's node out of the run
    for cooldown_s and go on without it (while scaling.min_workers allows)."""
    cooldown_s: float = 600.0
    """evict: how long an evicted node is not taken back."""
    max_evictions: int = 2
    """evict: at most this many evictions a run (each restarts the worker group, which
    Ray Train counts as a failure: scaling.max_failures is raised by this much)."""

    def validate(self) -> None:
        if not self.threshold > 1:
            raise ConfigError(
                f"stragglers.threshold={self.threshold} is not valid: it must be > 1 (a rank "
                "this many times slower than the others' median, e.g. 1.3)"
            )
        if self.window < 1:
            raise ConfigError(
                f"stragglers.window={self.window} is not valid: it must be >= 1 (log intervals)"
            )
        positive("stragglers.cooldown_s", self.cooldown_s, allow_zero=True)
        positive("stragglers.max_evictions", self.max_evictions, allow_zero=True)
        if self.policy == "evict" and self.max_evictions == 0:
            raise ConfigError(
                "stragglers.policy=evict with stragglers.max_evictions=0 evicts nothing: "
                "allow at least one, or use stragglers.policy=report"
            )


@dataclass
class TrainerConfig:
    max_steps: int = 100
    """0 = no step limit (then max_epochs bounds the run)."""
    max_epochs: int = 0
    """0 = no epoch limit (then max_steps bounds the run)."""
    log_every_steps: int = 10
    val_every_steps: int = 0
    """0 = validate only at the end."""
    seed: int = 0
    stop_at_step: int = 0
    """>0: checkpoint and stop after this step, resumable later (a fixed slice of a run)."""
    progress: str = one_of(Literal["auto", "bar", "plain", "off"], "auto")
    """The driver's progress display: auto, a live bar on a terminal, else a plain line
    with the ETA every progress_every_s."""
    progress_every_s: float = 30.0

    def validate(self) -> None:
        positive("trainer.max_steps", self.max_steps, allow_zero=True)
        positive("trainer.max_epochs", self.max_epochs, allow_zero=True)
        if self.max_steps == 0 and self.max_epochs == 0:
            raise ConfigError(
                "trainer.max_steps=0 and trainer.max_epochs=0 would never stop: set one of them > 0"
            )
        positive("trainer.log_every_steps", self.log_every_steps)
        positive("trainer.val_every_steps", self.val_every_steps, allow_zero=True)
        positive("trainer.stop_at_step", self.stop_at_step, allow_zero=True)
        positive("trainer.progress_every_s", self.progress_every_s)


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
    accept_changed_data: bool = False
    """Resume although the training data changed since the checkpoint (a resume compares
    every shard's name, rows and footer with the checkpoint's record, and stops on a
    change): true trains on the data as it is now. Shards added, removed or resized are
    taken only at an epoch's end (the epoch in progress is planned on its rows)."""

    def validate(self) -> None:
        positive("checkpoint.every_steps", self.every_steps, allow_zero=True)
        positive("checkpoint.keep", self.keep)


RUN_NAME_BYTES = 200
"""run.name's longest: a folder name (most filesystems take 255 bytes), with room for a
sweep's ``-N`` and the files Ray writes beside it."""


@dataclass
class RunConfig:
    name: str = MISSING
    storage_path: str = "runs"
    experiment: str = ""
    """Filled from ``+experiment=NAME`` by the entry point."""
    output_dir: str = ""
    """Hydra's output directory (summary.json goes there); filled by the entry point."""

    def validate(self) -> None:
        name = self.name
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


@dataclass
class LoggerConfig:
    kind: str = one_of(Literal["wandb", "none"], "wandb")
    project: str = "elastic"
    entity: str | None = None
    mode: str = one_of(Literal["auto", "online", "offline"], "auto")
    """auto: online when a W&B key is configured, else offline."""


# Ray refuses a smaller object store (ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES)
OBJECT_STORE_MINIMUM_MB = 75


@dataclass
class ClusterConfig:
    address: str = ""
    """Empty: start an embedded local Ray cluster. Else the head's explicit address
    (``host:port`` of its GCS, as the bootstrap exports it)."""
    connect_timeout_s: float = 60.0
    """How long an explicit ``address`` may take to answer before the run ends, in one
    line (Ray itself retries for minutes without a word)."""
    num_cpus: int | None = None
    """CPUs for the embedded cluster (null = all of this machine's)."""
    object_store_memory_mb: int = 512

    def validate(self) -> None:
        """Whether the embedded cluster can hold the workers is
        :func:`elastic.config.validate.validate`'s (it needs scaling)."""
        if self.object_store_memory_mb < OBJECT_STORE_MINIMUM_MB:
            raise ConfigError(
                f"cluster.object_store_memory_mb={self.object_store_memory_mb} is not valid: "
                f"Ray needs at least {OBJECT_STORE_MINIMUM_MB}"
            )
        positive("cluster.connect_timeout_s", self.connect_timeout_s)
        if self.address and not host_port(self.address):
            raise ConfigError(
                f"cluster.address={self.address!r} is not valid: use HOST:PORT of the head's "
                "GCS (e.g. 10.0.0.1:6379), or leave it empty for an embedded local cluster"
            )


def host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of ``HOST:PORT`` (``ray://`` allowed, IPv6 in brackets), else None."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


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
    stragglers: StragglersConfig = field(default_factory=StragglersConfig)
