"""The ``data.*`` section of the config: what the data package reads (the config
package composes it into the whole, :class:`elastic.config.schema.TrainConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from elastic.errors import ConfigError
from elastic.fields import positive


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
