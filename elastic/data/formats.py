"""Data formats: how the rows of one kind of dataset reach the model.

``data.format=NAME`` picks a registered :class:`DataFormat`; the core (config checks, the
Ray Data pipeline, the training loop) asks it and never names a format itself. The
built-in ``array`` format (an input column of fixed-size vectors) is defined here;
``image`` and ``contacts`` live with their datasets (:mod:`elastic.datasets.images`,
:mod:`elastic.datasets.protein`); a format of your own is a module that calls
:func:`register_format`, loaded as a plugin (:func:`load_plugins`, README "Bring your own
dataset or model").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from elastic.data.footers import footer, integer_ranges
from elastic.data.shards import ID_COLUMN, list_shards
from elastic.errors import ConfigError
from elastic.plugins import load_plugins
from elastic.registry import Registry
from elastic.tasks import task_of

if TYPE_CHECKING:
    from elastic.data.settings import DataConfig
    from elastic.models.base import ModelConfig

Decoder = Callable[..., dict[str, np.ndarray]]
"""(Arrow batch, input_column=, target_column=, **kwargs) -> {"sample_id", "x", "y"}."""
Finisher = Callable[[np.ndarray], np.ndarray]
"""A step's inputs as the decoder gave them -> the model's (:meth:`DataFormat.finisher`)."""


def column_to_numpy(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Arrow column -> numpy without per-row Python objects (fixed-size lists reshape)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_fixed_size_list(column.type):
        width = column.type.list_size
        flat = column.flatten()
        return column_to_numpy(flat).reshape(len(column), width)
    return column.to_numpy(zero_copy_only=False)


def decode_batch(batch: pa.Table, input_column: str, target_column: str) -> dict[str, np.ndarray]:
    """The ``array`` format's decoder: one Arrow batch of shard rows -> the arrays the
    model consumes."""
    return {
        ID_COLUMN: column_to_numpy(batch[ID_COLUMN]).astype(np.int64, copy=False),
        "x": column_to_numpy(batch[input_column]),
        "y": column_to_numpy(batch[target_column]),
    }


class DataFormat:
    """The ``array`` format, and the base of every other: override what differs.

    A format is one object per name; its methods get the run's ``DataConfig`` (and, where
    it matters, the model config), so one format serves any dataset of its kind."""

    name = "array"
    description = "an input column of fixed-size vectors (Parquet fixed_size_list)"
    settings: type | None = None
    """A dataclass of this format's own settings, or None. Its fields are the config keys
    ``data.<name>.<field>`` (e.g. ``data.image.size``), typed and defaulted by it, on every
    run; the format reads them with :meth:`settings_of`."""

    def settings_of(self, cfg: DataConfig) -> Any:
        """This format's settings in ``cfg`` (their defaults where ``cfg`` was built
        without them, e.g. a ``DataConfig`` made in code)."""
        assert self.settings is not None, f"format {self.name} declares no settings"
        found = getattr(cfg, self.name, None)
        return found if found is not None else self.settings()

    def extra_columns(self, cfg: DataConfig, schema: pa.Schema) -> list[str]:
        """Columns to read besides sample_id, the input and the target."""
        return []

    def decoder(self, cfg: DataConfig, shard: str) -> tuple[Decoder, dict[str, Any]]:
        """The function Ray Data's ``map_batches`` runs on each Arrow batch, and its keyword
        arguments beyond the columns (``shard``: any shard of the split)."""
        return decode_batch, {}

    def finisher(self, cfg: DataConfig, shard: str) -> Finisher | None:
        """What turns a step's inputs as the decoder gives them into the model's, run in
        the training worker on one step's rows (and on validation blocks); None: the
        decoder's are the model's. A decoder may so keep its rows compact through Ray
        Data, the object store and the worker's cache (``contacts``: packed bits, 1/32 of
        their float32 size), and leave the expansion to the step that trains them."""
        return None

    def input_width(self, cfg: DataConfig, files: list[str]) -> int | None:
        """The model input's width when the data fixes it (checked against the model
        before Ray starts), else None."""
        field_type = footer(files[0]).schema.field(cfg.input_column).type
        return field_type.list_size if pa.types.is_fixed_size_list(field_type) else None

    def input_shape(self, cfg: DataConfig, model: ModelConfig) -> tuple[int, ...] | None:
        """One row's input as the model takes it (after the finisher), where the format
        fixes it: checked against the decoded rows before Ray starts. None: whatever
        the decoder gives (the default, unless the model takes flat vectors of
        ``input_dim``)."""
        width = model.input_dim
        return (width,) if width else None

    def target_shape(
        self, cfg: DataConfig, model: ModelConfig
    ) -> tuple[tuple[int, ...], Any] | None:
        """One row's target shape and dtype as decoded, checked against the decoded rows
        before Ray starts (for a shape, only its number of values: a regression target of
        one value may be a scalar). The default is the task's
        (:meth:`elastic.tasks.Task.target_shape`): classification, one integer class
        label (shape ``()``, int64); multitask, ``[class, regressed values...]``;
        regression, ``output_dim`` floats. None: not checked."""
        return task_of(model).target_shape()

    def check(self, cfg: DataConfig, model: ModelConfig) -> None:
        """Config errors of this format with this model (raise ConfigError)."""
        if model.takes_images:
            raise ConfigError(
                f"model={model.name} takes images but data.format=array gives flat rows: set "
                "model.input_size (rows of model.in_channels x input_size^2 values) or use "
                "image data"
            )

    def check_target(self, cfg: DataConfig, model: ModelConfig, files: list[str]) -> None:
        """The target column against the model's task and outputs, from the shards'
        footers (types, and the labels' range from row-group statistics): a mismatch
        would otherwise fail at the first step, on every worker, on every retry."""
        task = task_of(model)
        if task.target_is_input:
            return
        col, where = cfg.target_column, f"column {cfg.target_column!r} in {cfg.path}"
        field_type = footer(files[0]).schema.field(col).type
        task.check_target_type(field_type, where)
        classes = task.classes()
        if not classes or pa.types.is_fixed_size_list(field_type):
            return  # labels inside lists have no statistics: the workers check each step's
        low, high = _integer_range(files, col)
        if low is not None and high is not None and (low < 0 or high >= classes):
            raise ConfigError(
                f"{where} holds class labels {low}..{high} but model.output_dim={task.outputs} "
                f"gives {task.label_range()}: {task.label_fix(high)}"
            )

    def missing_hint(self, cfg: DataConfig) -> str | None:
        """How to make a dataset of this format, for a data.path that does not exist."""
        return None

    def augment(
        self, x: np.ndarray, sample_id: np.ndarray, epoch: int, cfg: DataConfig
    ) -> np.ndarray:
        """Training-time augmentation of a step's inputs (must depend only on the data
        seed, the epoch and the sample ids: a resume replays it)."""
        return x


def _integer_range(files: list[str], column: str) -> tuple[int | None, int | None]:
    """Smallest and largest value of an integer column, from the row-group statistics;
    a shard without them has the column read, while the shards read so stay within
    :data:`~elastic.data.shards.CHECK_READ_ROWS` rows (else None, None: unchecked here;
    the workers check every step's labels)."""
    from elastic.data.footers import footer, read_integer_range
    from elastic.data.shards import CHECK_READ_ROWS

    low = high = None
    budget = CHECK_READ_ROWS
    for f, found in zip(files, integer_ranges(files, column), strict=True):
        if found is None:
            budget -= footer(f).num_rows
            if budget < 0:
                return None, None
            found = read_integer_range(f, column)
            if found is None:
                continue  # no rows (or only nulls): nothing to compare
        low = found[0] if low is None else min(low, found[0])
        high = found[1] if high is None else max(high, found[1])
    return low, high


FORMATS: Registry[DataFormat] = Registry("data format", "data.format")
FORMATS.add("array", DataFormat())


def register_format(fmt: DataFormat) -> DataFormat:
    """Make ``fmt`` the format of ``data.format=fmt.name`` (and, if it declares settings,
    the owner of the ``data.<name>.*`` keys: :func:`elastic.config.compose.train_schema`).
    A name already taken by another format is refused."""
    return FORMATS.add(fmt.name, fmt)


def data_format(name: str) -> DataFormat:
    """The registered format ``name``, or a ConfigError listing the known ones."""
    if name not in FORMATS:
        load_plugins()
    if name not in FORMATS:
        raise ConfigError(
            f"data.format={name!r} is not valid: use one of {', '.join(sorted(FORMATS))}, or "
            "register your own (a plugin: README 'Bring your own dataset, model or task')"
        )
    return FORMATS[name]


def input_width(cfg: DataConfig) -> int | None:
    """Width of the model's input vector when the data fixes it (its format decides, from
    every shard of both splits where that matters), else None."""
    files = list_shards(cfg.path) + (list_shards(cfg.val_path) if cfg.val_path else [])
    return data_format(cfg.format).input_width(cfg, files)
