"""A few rows through the whole path before Ray starts: decoder, finisher, augmentation,
model and loss, on the driver.

A format's decoder and a model family are a user's own code (plugins, README "Bring
your own dataset or model"). A decoder that returns another shape than the model takes,
or labels the task cannot use, would fail only inside the workers, on every worker and
on every retry. :func:`probe` runs the first rows of the training split through what a
step runs, and ends the run in one line naming the function, the shapes and the fix.

What it finds is also what the workers need to know of a batch they get no rows for (a
rank whose share of a step or of the validation split is empty): the decoded rows'
shapes and dtypes, as :class:`Probe.empty`. So an empty share has the decoder's own
shapes, whatever a format declares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from elastic.config.schema import TrainConfig
from elastic.data.formats import DataFormat, data_format
from elastic.data.pipeline import FIX_FORMAT, decoder, finisher, read_columns
from elastic.data.shards import ID_COLUMN
from elastic.errors import (
    ConfigError,
    DataError,
    exception_text,
    transient,
    user_code,
    user_code_site,
)
from elastic.tasks import task_of

PROBE_ROWS = 4
"""Rows of the first shard run through the decoder, the model and the loss."""
MODEL_BYTES = 512 * 2**20
"""A model whose parameters take at most this is built and run on the driver's CPU; a
larger one runs on the meta device (shapes only, no memory)."""


@dataclass
class Probe:
    """What the first rows showed."""

    empty: dict[str, np.ndarray]
    """A batch of no rows with the decoded shapes and dtypes (the model's input after
    the finisher): what a worker with no rows of a step trains on."""


def shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) if shape else "a scalar"


def first_rows(cfg: TrainConfig, files: list[str], rows: int = PROBE_ROWS) -> pa.Table | None:
    """Up to ``rows`` rows of the first shard that has any, with the columns a run reads."""
    for f in files:
        shard = pq.ParquetFile(f)
        columns = read_columns(cfg.data, shard.schema_arrow)
        for batch in shard.iter_batches(batch_size=rows, columns=columns):
            if batch.num_rows:
                return pa.Table.from_batches([batch])
    return None


_probed: dict[tuple[Any, ...], Probe] = {}


def probe(cfg: TrainConfig, files: list[str]) -> Probe:
    """Decode the first rows of ``files`` (the training split) as the workers will, and
    run them through the model and the loss; a :class:`ConfigError` or a
    :class:`~elastic.errors.UserCodeError` (one line) when anything does not fit.

    Once a process for the same data, data settings and model: the entry point's check
    of the command line and the driver both ask."""
    from elastic.data.footers import file_key

    key = (file_key(files[0]), len(files), repr(vars(cfg.data)), repr(cfg.model))
    if key not in _probed:
        _probed[key] = _probe(cfg, files)
    return _probed[key]


def _probe(cfg: TrainConfig, files: list[str]) -> Probe:
    fmt = data_format(cfg.data.format)
    table = first_rows(cfg, files)
    if table is None:
        raise ConfigError(f"data.path={cfg.data.path} holds no rows: prepare the dataset there")
    decode, kwargs = decoder(cfg.data, files[0])
    who = decode.what
    try:
        ids, x, y = _decoded(decode(table, **kwargs), table.num_rows, who)
        x = np.asarray(finisher(cfg.data, files[0])(x))
    except DataError as e:  # a row that does not decode: the same line the workers give
        raise ConfigError(f"{e} (data.path={cfg.data.path}; one of its first rows)") from e
    with user_code(f"data.format={fmt.name}'s augment()", "fix the format's augment()"):
        augmented = np.asarray(fmt.augment(x, ids, 0, cfg.data))
    if augmented.shape != x.shape:
        raise ConfigError(
            f"data.format={fmt.name}'s augment() turns inputs of shape {shape_text(x.shape)} "
            f"into {shape_text(augmented.shape)}: it must keep the shape"
        )
    _check_declared(fmt, cfg, x, y)
    _check_targets(cfg, y, ids, who)
    _check_model(cfg, augmented, y)
    return Probe(empty={ID_COLUMN: ids[:0], "x": x[:0], "y": y[:0]})


def _decoded(out: Any, rows: int, who: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The decoder's contract: a dict of numpy arrays ``sample_id`` (integers), ``x``
    (numbers) and ``y``, one entry per row."""
    keys = (ID_COLUMN, "x", "y")
    if not isinstance(out, dict) or any(k not in out for k in keys):
        got = sorted(out) if isinstance(out, dict) else type(out).__name__
        raise ConfigError(
            f"{who} returns {got}, not a dict with keys sample_id, x, y: {FIX_FORMAT}"
        )
    arrays = []
    for k in keys:
        v = out[k]
        if not isinstance(v, np.ndarray):
            raise ConfigError(f"{who} returns {k} as {type(v).__name__}, not a numpy array")
        if v.ndim == 0 or len(v) != rows:
            got = "a scalar" if v.ndim == 0 else f"{len(v)} entries"
            raise ConfigError(
                f"{who} returns {k} with {got} for {rows} rows: one entry per row (first axis)"
            )
        arrays.append(v)
    ids, x, y = arrays
    if ids.dtype.kind not in "iu" or ids.ndim != 1:
        raise ConfigError(
            f"{who} returns sample_id of dtype {ids.dtype} and shape {shape_text(ids.shape)}:"
            " one integer per row (the column's int64 values)"
        )
    for k, v in (("x", x), ("y", y)):
        if v.dtype.kind not in "biuf":
            raise ConfigError(
                f"{who} returns {k} of dtype {v.dtype}: numbers (bool, int or float arrays),"
                " one row per entry of the first axis"
            )
    return ids, x, y


def _check_declared(fmt: DataFormat, cfg: TrainConfig, x: np.ndarray, y: np.ndarray) -> None:
    """What the format declares (``input_shape``, ``target_shape``) against the rows."""
    with user_code(f"data.format={fmt.name}'s input_shape()", "fix the format"):
        declared = fmt.input_shape(cfg.data, cfg.model)
    if declared is not None and tuple(declared) != x.shape[1:]:
        raise ConfigError(
            f"data.format={fmt.name} decodes inputs of shape {shape_text(x.shape[1:])} a row, "
            f"but its input_shape() says {shape_text(tuple(declared))} for model="
            f"{cfg.model.name}: make the decoder (or finisher) return rows of "
            f"{shape_text(tuple(declared))}, or input_shape() say what the model takes"
        )
    with user_code(f"data.format={fmt.name}'s target_shape()", "fix the format"):
        target = fmt.target_shape(cfg.data, cfg.model)
    if target is None or task_of(cfg.model).target_is_input:
        return
    shape, _ = target  # the dtype: class labels are checked by value (_check_targets)
    if int(np.prod(shape)) != int(np.prod(y.shape[1:])):
        raise ConfigError(
            f"data.format={fmt.name} decodes targets of shape {shape_text(y.shape[1:])} a row, "
            f"but its target_shape() says {shape_text(tuple(shape))} for model="
            f"{cfg.model.name} (task={cfg.model.task}): make them agree"
        )


def _check_targets(cfg: TrainConfig, y: np.ndarray, ids: np.ndarray, who: str) -> None:
    """The rows' targets against the task: its own checks (classification: one class
    label a row), class labels within the model's classes."""
    model, task = cfg.model, task_of(cfg.model)
    task.check_rows(y, who)
    bad = task.bad_labels(y)
    if bad.any():
        label = y.reshape(len(y), -1)[bad, 0][0]
        raise ConfigError(
            f"{who} returns class label {label!r} for sample_id {ids[bad][0]} in "
            f"data.path={cfg.data.path}, but model={model.name} has {task.label_range()}: "
            "fix the labels or model.output_dim"
        )


def _check_model(cfg: TrainConfig, x: np.ndarray, y: np.ndarray) -> None:
    """The model's forward pass on the rows, and the task's loss on its outputs."""
    import torch

    model_cfg = cfg.model
    fix = "fix the model family's build()"
    with user_code(f"model={model_cfg.name}'s build()", fix):
        model, device = _small_model(model_cfg)
    inputs = torch.tensor(x, dtype=torch.float32, device=device)  # a copy
    model.eval()
    try:
        with torch.no_grad():
            output = model(inputs).float()
    except Exception as e:
        if transient(e) or (device == "meta" and isinstance(e, NotImplementedError)):
            return  # out of memory here, or an operator without meta shapes: not checkable
        raise ConfigError(
            f"model={model_cfg.name} cannot take the decoded inputs: its forward pass on "
            f"{len(x)} rows of shape {shape_text(x.shape[1:])} (data.format="
            f"{cfg.data.format}) raised {type(e).__name__}: {exception_text(e)} "
            f"({user_code_site(e)}): make the decoder return what the model takes"
        ) from None
    if device == "meta":
        return
    task = task_of(model_cfg)
    target = inputs if task.target_is_input else torch.tensor(y)
    try:
        losses = task.losses(output, target)
        if tuple(losses.shape) != (len(x),):
            raise ValueError(f"one loss a row expected, got shape {tuple(losses.shape)}")
    except Exception as e:
        raise ConfigError(
            f"model={model_cfg.name}'s outputs (shape {shape_text(tuple(output.shape[1:]))} a "
            f"row) and the decoded targets (shape {shape_text(y.shape[1:])}, {y.dtype}) do "
            f"not fit task={model_cfg.task} ({type(e).__name__}: {exception_text(e)}): set "
            "model.output_dim to the targets' size, or decode the targets the task takes"
        ) from None


def _small_model(model_cfg: Any) -> tuple[Any, str]:
    """The model built on the CPU when its parameters fit :data:`MODEL_BYTES`, else on
    the meta device."""
    import torch

    try:
        with torch.device("meta"):
            shapes = model_cfg.build()
        size = sum(p.numel() * p.element_size() for p in shapes.parameters())
    except Exception:  # a build that needs real tensors: build it for real
        size = 0
    if size > MODEL_BYTES:
        with torch.device("meta"):
            return model_cfg.build(), "meta"
    return model_cfg.build(), "cpu"
