"""The run's typed configuration: one dataclass per config group.

Hydra composes YAML from ``conf/`` against these schemas (registered in its ConfigStore
by :func:`elastic.config.compose.register_schemas`), so a typo or a wrong type fails
while composing. Defaults live here and in ``conf/``; validation is in
:mod:`elastic.config.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


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
    zero_stage: int = 2
    """DeepSpeed ZeRO stage 0-3 (0: plain data parallelism)."""
    precision: str = "fp32"
    """fp32 | bf16"""
    gradient_clipping: float = 0.0
    overlap_reduce: bool = True
    """fp32 ZeRO-0: true, elastic's gradient all-reduce, started bucket by bucket during
    the backward pass (elastic/train/reduce.py; the same result up to fp32 rounding,
    0.969x the step time with DeepSpeed's on 2 cores: docs/performance.md#step-overhead);
    false, DeepSpeed's, after it (needed where a parameter takes two gradients in one
    backward pass, e.g. reentrant activation checkpointing, or layers are frozen or
    unfrozen during the run: refused in one line otherwise). Other stages, bf16,
    mixture-of-experts and sparse embeddings keep DeepSpeed's whatever this says."""


RETIRED_KEYS = {
    # key: what became of it (named when a config or command line still sets it)
    "data.shuffle_files": "it is data.shuffle now",
    "data.shuffle_buffer_rows": "it is data.shuffle_window_rows now (rows permuted together "
    "in each lane)",
    "data.block_size_mb": "it is gone: Ray Data reads one row group a block",
    "scaling.batch_policy": "it is gone: every world size up to data.global_batch_size trains "
    "the same global batch, whether or not it divides it",
}

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

    def ray_env(self) -> dict[str, str]:
        """Ray Train's recovery knobs, as the environment its controller reads."""
        return {
            "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(self.start_timeout_s),
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(self.health_check_interval_s),
            "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S": str(self.worker_health_check_timeout_s),
            "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": str(self.drain_poll_interval_s),
        }


STRAGGLER_POLICIES = ("report", "rebalance", "evict")


@dataclass
class StragglersConfig:
    threshold: float = 1.3
    """A rank whose compute time per step (forward + local backward + optimizer, no
    collective wait) is over this x the median of the other ranks' ..."""
    window: int = 3
    """... for this many log intervals in a row is a straggler (an event, a console
    line, a W&B alert)."""
    policy: str = "report"
    """report: detect and report. rebalance: each rank's share of every step's rows
    follows its measured speed, re-evaluated every window (the step's rows and the
    gradient stay the same). evict: checkpoint, keep the straggler's node out of the run
    for cooldown_s and go on without it (while scaling.min_workers allows)."""
    cooldown_s: float = 600.0
    """evict: how long an evicted node is not taken back."""
    max_evictions: int = 2
    """evict: at most this many evictions a run (each restarts the worker group, which
    Ray Train counts as a failure: scaling.max_failures is raised by this much)."""


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
    accept_changed_data: bool = False
    """Resume although the training data changed since the checkpoint (a resume compares
    every shard's name, rows and footer with the checkpoint's record, and stops on a
    change): true trains on the data as it is now. Shards added, removed or resized are
    taken only at an epoch's end (the epoch in progress is planned on its rows)."""


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
    """Empty: start an embedded local Ray cluster. Else the head's explicit address
    (``host:port`` of its GCS, as the bootstrap exports it)."""
    connect_timeout_s: float = 60.0
    """How long an explicit ``address`` may take to answer before the run ends, in one
    line (Ray itself retries for minutes without a word)."""
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
    stragglers: StragglersConfig = field(default_factory=StragglersConfig)
