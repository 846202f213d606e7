"""Synthetic regression data with the schema every dataset here shares.

Rows carry a stable ``sample_id``, an input vector ``x`` and a target ``y`` computed by a
fixed random teacher network, so a small model can learn it and a loss that goes down
means something. Everything is deterministic from the seed.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA_VERSION = "1"


def _fixed_list(values: np.ndarray) -> pa.FixedSizeListArray:
    n, width = values.shape
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1).astype(np.float32)), width)


def _teacher(input_dim: int, output_dim: int, seed: int):
    rng = np.random.default_rng(seed + 7919)
    hidden = 32
    w1 = rng.standard_normal((input_dim, hidden)) / np.sqrt(input_dim)
    w2 = rng.standard_normal((hidden, output_dim)) / np.sqrt(hidden)
    return lambda x: np.tanh(x @ w1) @ w2


def write_shards(
    out_dir: str,
    rows: int,
    shards: int,
    input_dim: int,
    output_dim: int,
    seed: int,
    first_id: int = 0,
    row_group_rows: int = 1024,
) -> list[str]:
    """Write ``rows`` rows as ``shards`` Parquet files into a new directory ``out_dir``.

    The directory appears only when complete (written under a temp name, then renamed),
    so an interrupted run never leaves a dataset that looks valid; re-running finishes it.
    """
    if os.path.isdir(out_dir):
        raise FileExistsError(f"{out_dir} already exists: remove it or choose another path")
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(out_dir) + "-", dir=parent)
    teacher = _teacher(input_dim, output_dim, seed)
    rng = np.random.default_rng(seed + first_id)
    bounds = np.linspace(0, rows, shards + 1).astype(int)
    metadata = {
        b"elastic.dataset": b"synthetic",
        b"elastic.schema_version": SCHEMA_VERSION.encode(),
        b"elastic.input_dim": str(input_dim).encode(),
        b"elastic.output_dim": str(output_dim).encode(),
    }
    try:
        for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            x = rng.standard_normal((hi - lo, input_dim)).astype(np.float32)
            y = teacher(x) + 0.01 * rng.standard_normal((hi - lo, output_dim))
            table = pa.table(
                {
                    "sample_id": pa.array(np.arange(first_id + lo, first_id + hi), pa.int64()),
                    "x": _fixed_list(x),
                    "y": _fixed_list(y),
                }
            ).replace_schema_metadata(metadata)
            pq.write_table(
                table, os.path.join(tmp_dir, f"part-{i:05d}.parquet"), row_group_size=row_group_rows
            )
        os.rename(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return sorted(os.path.join(out_dir, f) for f in os.listdir(out_dir))


def generate(
    path: str,
    val_path: str | None,
    rows: int,
    val_rows: int,
    shards: int,
    input_dim: int,
    output_dim: int,
    seed: int,
) -> None:
    """Write the train split to ``path`` and the validation split to ``val_path``.

    Validation ids follow the training ids, so ``sample_id`` is unique across both.
    """
    if not os.path.isdir(path):
        write_shards(path, rows, shards, input_dim, output_dim, seed)
    if val_path and not os.path.isdir(val_path):
        val_shards = max(1, min(shards, val_rows // 256))
        write_shards(val_path, val_rows, val_shards, input_dim, output_dim, seed, first_id=rows)
