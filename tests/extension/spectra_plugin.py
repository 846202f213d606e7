"""A user's own dataset format and model family, kept outside the library, as README
"Bring your own dataset or model" walks through: 1-D diffraction spectra stored as raw
little-endian float16 bytes (a format that needs its own decoding) and a 1-D
convolutional network. Loaded as a plugin: ``ELASTIC_PLUGINS=spectra_plugin`` with this
folder on ``PYTHONPATH``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from torch import nn

from elastic.data.formats import DataFormat, register_format
from elastic.errors import ConfigError
from elastic.models import register_model

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
        "y": batch[target_column].to_numpy(),
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
class SpectrumCNNConfig:
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


def write_spectra(
    out: str, rows: int, length: int, seed: int, first_id: int = 0, shards: int = 4
) -> None:
    """A toy dataset: one peak per spectrum; its position (third of the range) is the
    class. ``shards`` files of consecutive sample ids, a row group each."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, rows)
    grid = np.arange(length)
    centre = (labels + rng.uniform(0.2, 0.8, rows)) * length / 3
    spectra = np.exp(-0.5 * ((grid - centre[:, None]) / 3.0) ** 2)
    spectra += rng.uniform(0, 0.2, spectra.shape)
    table = pa.table(
        {
            "sample_id": np.arange(first_id, first_id + rows, dtype=np.int64),
            "spectrum": pa.array([s.astype("<f2").tobytes() for s in spectra], pa.binary()),
            "label": labels.astype(np.int64),
        }
    ).replace_schema_metadata({LENGTH_KEY: str(length).encode()})
    import os

    os.makedirs(out, exist_ok=True)
    for i, part in enumerate(np.array_split(np.arange(rows), shards)):
        pq.write_table(table.take(part), f"{out}/part-{i:05d}.parquet")
