"""Shards -> Ray Data (driver side): read, decode in ``map_batches``, and the cache and
block-size decisions. Each format's decoder comes from :mod:`elastic.data.formats`.
:func:`planned_dataset` is a rank's own read of chosen row groups (the world-size
independent plan of :mod:`elastic.data.order`; not yet used by the loop)."""

from __future__ import annotations

import functools
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from elastic.config.schema import DataConfig
from elastic.data.formats import data_format
from elastic.data.shards import ID_COLUMN, Split


def read_columns(cfg: DataConfig, schema: pa.Schema) -> list[str]:
    """The columns a run reads from shards of ``schema``."""
    columns = [ID_COLUMN, cfg.input_column, cfg.target_column]
    return columns + data_format(cfg.format).extra_columns(cfg, schema)


def decoded_bytes(cfg: DataConfig, split: Split) -> int:
    """What ``split`` takes in memory decoded (what a cache holds, several times its
    Parquet size for packed contact maps or compressed images): the decoder's output for
    the first rows of a shard, per row, times the split's rows."""
    decode, kwargs = decoder(cfg, split.files[0])
    for f in split.files:
        pf = pq.ParquetFile(f)
        for batch in pf.iter_batches(batch_size=16, columns=read_columns(cfg, pf.schema_arrow)):
            if batch.num_rows:
                out = decode(pa.Table.from_batches([batch]), **kwargs)
                per_row = sum(v.nbytes for v in out.values()) / batch.num_rows
                return int(per_row * split.rows)
    return 0  # no rows at all


def fits_cache(cfg: DataConfig, split: Split, min_workers: int) -> bool:
    """Whether each worker's share of ``split``, decoded, fits ``data.cache_mb`` at any
    world size."""
    return decoded_bytes(cfg, split) <= cfg.cache_mb * 1024 * 1024 * min_workers


def block_bytes(split_bytes: int, block_size_mb: float, max_workers: int) -> int:
    """Block size cap: ``block_size_mb``, or less so there are >= 8 blocks per worker."""
    return max(16 * 1024, min(int(block_size_mb * 1024 * 1024), split_bytes // (8 * max_workers)))


def decoder(cfg: DataConfig, shard: str) -> tuple[Any, dict[str, Any]]:
    """The function that turns an Arrow batch of ``cfg``'s shards into model arrays, and
    its keyword arguments (``shard``: any shard of the split; its format decides)."""
    decode, kwargs = data_format(cfg.format).decoder(cfg, shard)
    return decode, {"input_column": cfg.input_column, "target_column": cfg.target_column, **kwargs}


def build_datasets(cfg: DataConfig, train: Split, max_workers: int) -> dict[str, Any]:
    """The lazy Ray dataset of the train split, as Ray Train's ``datasets``. The
    validation split is not one: each worker reads its share itself
    (:func:`elastic.data.stream.val_blocks`)."""
    import ray.data
    from ray.data import FileShuffleConfig

    # Ray 2.60's new Parquet reader spends 2-3 s in a ListFiles task at the start of
    # every epoch, even for files listed explicitly; the previous reader starts in
    # ~0.15 s (measured here). We already list and check the shards ourselves.
    ctx = ray.data.DataContext.get_current()
    use_v2, ctx.use_datasource_v2 = ctx.use_datasource_v2, False
    columns = read_columns(cfg, pq.read_schema(train.files[0]))
    # data.shuffle_files: a file order fixed by (data.seed, Ray Data's execution index),
    # which data_config() sets to the epoch an execution reads
    shuffle = FileShuffleConfig(seed=cfg.seed) if cfg.shuffle_files else None
    try:
        ds = ray.data.read_parquet(train.files, columns=columns, shuffle=shuffle)
    finally:
        ctx.use_datasource_v2 = use_v2
    ds.context.target_max_block_size = block_bytes(train.bytes, cfg.block_size_mb, max_workers)
    decode, kwargs = decoder(cfg, train.files[0])
    train_ds = ds.map_batches(
        decode, batch_format="pyarrow", zero_copy_batch=True, fn_kwargs=kwargs
    )
    return {"train": train_ds}


def data_config(first_epoch: Any = None) -> Any:
    """Ray Train DataConfig: deterministic, lossless splits.

    ``preserve_order`` makes each worker's share and order the same run to run (which
    makes resume at the same world size exact). ``equal=False`` because Ray's equal
    split drops up to world_size - 1 rows per epoch, and we train every row:
    :class:`StepStream` keeps workers in lock step when their shares differ.

    ``first_epoch``: a callable giving the epoch the worker group starts in (rank 0 says,
    before it asks for its shard). The train split's first execution then counts as that
    epoch, so a shuffled file order is the epoch's, after a resume too. None: 0.
    """
    from ray.data import ExecutionOptions
    from ray.train import DataConfig as RayDataConfig

    class LosslessDataConfig(RayDataConfig):
        def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
            output: list[dict[str, Any]] = [{} for _ in range(world_size)]
            for name, ds in datasets.items():
                ds = ds.copy(ds, _deep_copy=True)  # its own context
                ds.context.execution_options = self._resolve_execution_options(name)
                if name == "train" and first_epoch is not None:
                    # FileShuffleConfig seeds each execution by (seed, execution index)
                    ds.context._execution_idx = int(first_epoch())
                for i, split in enumerate(ds.streaming_split(world_size, equal=False)):
                    output[i][name] = split
            return output

    return LosslessDataConfig(execution_options=ExecutionOptions(preserve_order=True))


def planned_dataset(cfg: DataConfig, files: list[str], reads: list[tuple[int, int]]) -> Any:
    """A rank's read of the row groups ``reads`` ((file index, group) into ``files``, in
    that order: :meth:`elastic.data.order.EpochPlan.reads`), decoded by the format's
    decoder in Ray Data, each block tagged with the group it holds
    (:data:`elastic.data.order.GROUP_COLUMNS`) for :class:`~elastic.data.order.SliceAssembler`.
    One read task a row group; the blocks come out in the plan's order."""
    import ray.data
    from ray.data import ExecutionOptions

    from elastic.data.order import GROUP_COLUMNS

    columns = read_columns(cfg, pq.read_schema(files[0]))
    source = _row_group_source(files, reads, columns)
    ds = ray.data.read_datasource(source, override_num_blocks=max(1, len(reads)))
    ds.context.execution_options = ExecutionOptions(preserve_order=True)
    decode, kwargs = decoder(cfg, files[0])

    def tagged(batch: pa.Table, **kw: Any) -> dict[str, Any]:
        out = decode(batch.drop_columns(list(GROUP_COLUMNS)), **kw)
        for name in GROUP_COLUMNS:
            out[name] = batch[name].to_numpy()
        return out

    return ds.map_batches(tagged, batch_format="pyarrow", zero_copy_batch=True, fn_kwargs=kwargs)


def _row_group_source(files: list[str], reads: list[tuple[int, int]], columns: list[str]) -> Any:
    """A Ray Data datasource of the row groups ``reads``, one read task each, in order."""
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    from elastic.data.order import GROUP_COLUMNS

    def read(path: str, f: int, g: int) -> list[pa.Table]:
        table = pq.ParquetFile(path).read_row_group(g, columns=columns)
        n = table.num_rows
        table = table.append_column(GROUP_COLUMNS[0], pa.array([f] * n, pa.int32()))
        return [table.append_column(GROUP_COLUMNS[1], pa.array([g] * n, pa.int32()))]

    class RowGroups(Datasource):
        def estimate_inmemory_data_size(self) -> int | None:
            return None

        def get_read_tasks(
            self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
        ) -> list[ReadTask]:
            tasks = []
            footers = {f: pq.read_metadata(files[f]) for f in {f for f, _ in reads}}
            for f, g in reads:
                meta = footers[f].row_group(g)
                tasks.append(
                    ReadTask(
                        functools.partial(read, files[f], f, g),
                        BlockMetadata(
                            num_rows=meta.num_rows,
                            size_bytes=meta.total_byte_size,
                            input_files=(files[f],),
                            exec_stats=None,
                        ),
                    )
                )
            return tasks

    return RowGroups()
