"""A user's own dataset format, model family and task, kept outside the library, as
README "Bring your own dataset, model or task" walks through: 1-D diffraction spectra stored
as raw little-endian float16 bytes (a format that needs its own decoding), a 1-D
convolutional network, and a multi-label task (which regions of a spectrum hold a
peak). Loaded as a plugin: ``ELASTIC_PLUGINS=spectra_plugin`` with this folder on
``PYTHONPATH``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

from elastic.data.formats import DataFormat, column_to_numpy, register_format
from elastic.errors import ConfigError
from elastic.models import ModelConfig, register_model
from elastic.tasks import Task, register_task

LENGTH_KEY = b"spectrum.length"  # Parquet schema metadata: points per spectrum


def decode_spectra(
    batch: pa.Table, input_column: str, target_column: str, length: int, peak: float
) -> dict[str, np.ndarray]:
    """float16 bytes -> float32 [N, length], each spectrum scaled to a maximum of
    ``peak`` (0: as stored)."""
    raw = batch[input_column].combine_chunks()
    x = np.frombuffer(b"".join(raw.to_pylist()), "<f2").reshape(len(raw), length)
    x = x.astype(np.float32)
    if peak:
        x *= peak / np.maximum(x.max(axis=1, keepdims=True), 1e-6)
    return {
        "sample_id": batch["sample_id"].to_numpy().astype(np.int64),
        "x": x,
        "y": column_to_numpy(batch[target_column]),  # labels, or lists of 0/1 (peaks)
    }


@dataclass
class SpectrumSettings:
    """The format's own keys: ``data.spectrum.*``."""

    peak: float = 1.0
    """Scale each spectrum to this maximum (0: as stored)."""


class SpectrumFormat(DataFormat):
    name = "spectrum"
    description = "1-D spectra as raw little-endian float16 bytes"
    settings = SpectrumSettings

    def decoder(self, cfg: Any, shard: str) -> tuple[Any, dict[str, Any]]:
        peak = self.settings_of(cfg).peak
        return decode_spectra, {"length": self.input_width(cfg, [shard]), "peak": peak}

    def check(self, cfg: Any, model: Any) -> None:
        super().check(cfg, model)
        peak = self.settings_of(cfg).peak
        if peak < 0:
            raise ConfigError(f"data.spectrum.peak={peak} is not valid: use 0 or more")

    def input_width(self, cfg: Any, files: list[str]) -> int | None:
        meta = pq.read_schema(files[0]).metadata or {}
        if LENGTH_KEY not in meta:
            raise ConfigError(f"{files[0]} has no {LENGTH_KEY.decode()} metadata")
        return int(meta[LENGTH_KEY])


register_format(SpectrumFormat())


@register_model
@dataclass
class SpectrumCNNConfig(ModelConfig):
    """model=spectrum_cnn: 1-D convolutions over a spectrum, then a linear head."""

    name: str = "spectrum_cnn"
    input_dim: int = 128
    channels: list[int] = field(default_factory=lambda: [8, 16])
    output_dim: int = 3
    task: str = "classification"

    def validate(self) -> None:
        if self.input_dim < 8 or not self.channels:
            raise ConfigError("model.input_dim must be >= 8 and model.channels non-empty")

    def build(self) -> nn.Module:
        layers: list[nn.Module] = [nn.Unflatten(1, (1, self.input_dim))]
        c_in = 1
        for c in self.channels:
            layers += [nn.Conv1d(c_in, c, 5, padding=2), nn.GELU(), nn.MaxPool1d(2)]
            c_in = c
        length = self.input_dim // 2 ** len(self.channels)
        layers += [nn.Flatten(), nn.Linear(c_in * length, self.output_dim)]
        return nn.Sequential(*layers)


@register_task
class Peaks(Task):
    """``model.task=peaks``: which of the model's ``output_dim`` regions hold a peak,
    several a row (multi-label): the target is ``output_dim`` values, each 0 or 1; the
    loss, binary cross entropy per label, averaged; the metrics, the share of rows with
    every label right and the share of labels right."""

    name = "peaks"
    description = "output_dim 0/1 labels a row; loss: binary cross entropy a label"

    def target_shape(self) -> tuple[tuple[int, ...], Any]:
        return (self.outputs,), np.float32

    def check_target_type(self, field_type: pa.DataType, where: str) -> None:
        if not (pa.types.is_fixed_size_list(field_type) and field_type.list_size == self.outputs):
            raise ConfigError(
                f"model.task=peaks needs {self.outputs} values of 0 or 1 a row, but {where} "
                f"holds {field_type}: set model.output_dim to the labels a row"
            )

    def check_rows(self, y: np.ndarray, who: str) -> None:
        if not np.isin(y, (0, 1)).all():
            raise ConfigError(f"{who} returns peaks labels other than 0 and 1: fix the data")

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        target = target.to(output.dtype)
        bce = nn.functional.binary_cross_entropy_with_logits(output, target, reduction="none")
        return bce.mean(dim=1)

    def sums(self) -> int:
        return 2  # rows with every label right, labels right (a row's share)

    def add_sums(self, sums: torch.Tensor, output: torch.Tensor, target: torch.Tensor) -> None:
        right = (output > 0) == (target > 0.5)
        sums[0] += right.all(dim=1).sum()
        sums[1] += right.double().mean(dim=1).sum()

    def read_sums(self, sums: torch.Tensor, rows: float) -> dict[str, float]:
        return {"exact_match": float(sums[0]) / rows, "label_accuracy": float(sums[1]) / rows}


def write_spectra(
    out: str, rows: int, length: int, seed: int, first_id: int = 0, shards: int = 4
) -> None:
    """A toy dataset: a tall peak per spectrum, whose position (third of the range) is
    the class (``label``), and in each other third a peak of half its height with
    probability 0.4; ``peaks`` says which thirds hold a peak (0/1 each, the ``peaks``
    task's target). ``shards`` files of consecutive sample ids, a row group each."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, rows)
    grid = np.arange(length)
    centre = (labels + rng.uniform(0.2, 0.8, rows)) * length / 3
    spectra = np.exp(-0.5 * ((grid - centre[:, None]) / 3.0) ** 2)
    spectra += rng.uniform(0, 0.2, spectra.shape)
    more = np.random.default_rng(seed + 1000)
    peaks = more.random((rows, 3)) < 0.4
    peaks[np.arange(rows), labels] = True
    for third in range(3):
        rows_with = peaks[:, third] & (labels != third)
        small = (third + more.uniform(0.2, 0.8, rows)) * length / 3
        spectra += 0.5 * rows_with[:, None] * np.exp(-0.5 * ((grid - small[:, None]) / 3.0) ** 2)
    table = pa.table(
        {
            "sample_id": np.arange(first_id, first_id + rows, dtype=np.int64),
            "spectrum": pa.array([s.astype("<f2").tobytes() for s in spectra], pa.binary()),
            "label": labels.astype(np.int64),
            "peaks": pa.FixedSizeListArray.from_arrays(
                pa.array(peaks.astype(np.float32).ravel()), 3
            ),
        }
    ).replace_schema_metadata({LENGTH_KEY: str(length).encode()})
    import os

    os.makedirs(out, exist_ok=True)
    for i, part in enumerate(np.array_split(np.arange(rows), shards)):
        pq.write_table(table.take(part), f"{out}/part-{i:05d}.parquet")
