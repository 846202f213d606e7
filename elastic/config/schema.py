"""The run's typed configuration: one dataclass per config group.

Hydra composes YAML from ``conf/`` against these schemas (registered in its ConfigStore
by :func:`elastic.config.compose.register_schemas`), so a typo or a wrong type fails
while composing. Defaults live here and in ``conf/``. Each section checks its own keys
(its ``validate()``); :func:`elastic.config.validate.validate` runs them, the choices
(:func:`one_of`) and the checks that span sections. docs/config.md lists every key with
its default and choices (tests/test_docs.py holds it to these classes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from omegaconf import MISSING

from elastic.cluster.settings import ClusterConfig, ScalingConfig
from elastic.data.settings import DataConfig
from elastic.errors import ConfigError
from elastic.fields import one_of, positive
from elastic.observe.settings import LoggerConfig


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
