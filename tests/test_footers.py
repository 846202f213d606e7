"""Shard footers read once a process (elastic.data.footers), checked against pyarrow
reading the same files, and against files that change or break between two reads."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elastic.config.schema import DataConfig
from elastic.data.footers import footers, integer_range, integer_ranges
from elastic.data.order import Layout
from elastic.data.shards import check_dataset
from elastic.datasets.synthetic import write_shards
from elastic.errors import ConfigError


def test_a_footer_holds_what_pyarrow_reads_from_the_file(tmp_path):
    files = write_shards(str(tmp_path / "d"), 1000, 3, 8, 2, seed=0, row_group_rows=128)
    for f, got in zip(files, footers(files), strict=True):
        shard = pq.ParquetFile(f)
        meta = shard.metadata
        assert got.rows == tuple(meta.row_group(g).num_rows for g in range(meta.num_row_groups))
        assert got.group_bytes == tuple(
            meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)
        )
        assert got.schema.equals(shard.schema_arrow, check_metadata=True)
        ids = shard.read(columns=["sample_id"])["sample_id"].to_numpy()
        assert integer_range(f, "sample_id") == (int(ids.min()), int(ids.max()))
        assert integer_range(f, "no_such_column") is None


def test_a_shard_rewritten_after_a_check_is_read_again(tmp_path):
    """The driver checks the data after the config checks did: a shard rewritten in
    between is seen as it is now, not as it was."""
    path = str(tmp_path / "d")
    files = write_shards(path, 600, 2, 8, 2, seed=0, row_group_rows=100)
    cfg = DataConfig(path=path, global_batch_size=8)
    before = check_dataset(cfg)["train"]
    table = pq.read_table(files[1])
    os.remove(files[1])
    pq.write_table(table.slice(0, 50), files[1], row_group_size=25)  # fewer rows, groups
    after = check_dataset(cfg)["train"]
    assert before.row_groups[1] == (100, 100, 100) and after.row_groups[1] == (25, 25)
    assert after.rows == 350
    assert Layout.of_files(files).rows[1] == (25, 25)


def test_the_first_unreadable_shard_is_named(tmp_path):
    path = tmp_path / "d"
    write_shards(str(path), 2000, 40, 8, 2, seed=0)
    for bad in ("part-00007.parquet", "part-00031.parquet"):
        (path / bad).write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match=r"part-00007\.parquet is not a readable Parquet"):
        check_dataset(DataConfig(path=str(path), global_batch_size=8))


def test_labels_without_statistics_are_left_unchecked(tmp_path):
    """A shard written without statistics gives no label range (the check is skipped
    rather than every row read), as before the footers were kept."""
    path = tmp_path / "d"
    os.makedirs(path)
    table = pa.table({"sample_id": pa.array(np.arange(10), pa.int64()),
                      "y": pa.array(np.arange(10) % 3, pa.int64())})  # fmt: skip
    pq.write_table(table, path / "a.parquet", write_statistics=False)
    assert integer_ranges([str(path / "a.parquet")], "y") == [None]
