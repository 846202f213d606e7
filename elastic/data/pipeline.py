"""Shards -> Ray Data: a rank's read of the row groups its slices need
(:func:`planned_dataset`, one read task a group, decoded in ``map_batches`` by the
format's decoder from :mod:`elastic.data.formats`), and the cache decision."""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from elastic.data.assemble import GROUP_COLUMNS
from elastic.data.footers import footer
from elastic.data.formats import Finisher, data_format
from elastic.data.settings import DataConfig
from elastic.data.shards import ID_COLUMN, Split
from elastic.errors import user_code


def read_columns(cfg: DataConfig, schema: pa.Schema) -> list[str]:
    """The columns a run reads from shards of ``schema``."""
    columns = [ID_COLUMN, cfg.input_column, cfg.target_column]
    return columns + data_format(cfg.format).extra_columns(cfg, schema)


def decoded_bytes(cfg: DataConfig, split: Split) -> int:
    """What ``split`` takes in memory decoded (what a cache holds: several times its
    Parquet size for compressed images; contact maps stay packed until a step unpacks
    them, :func:`finisher`): the decoder's output for the first rows of a shard, per row,
    times the split's rows."""
    return int(decoded_row_bytes(cfg, split.files) * split.rows)


def decoded_row_bytes(cfg: DataConfig, files: list[str]) -> float:
    """Bytes of a decoded row: the decoder's output for the first (up to 16) rows of the
    first shard of ``files`` that has rows, per row (0.0 when none has)."""
    decode, kwargs = decoder(cfg, files[0])
    for f in files:
        pf = pq.ParquetFile(f)
        for batch in pf.iter_batches(batch_size=16, columns=read_columns(cfg, pf.schema_arrow)):
            if batch.num_rows:
                out = decode(pa.Table.from_batches([batch]), **kwargs)
                return sum(v.nbytes for v in out.values()) / batch.num_rows
    return 0.0


def fits_cache(cfg: DataConfig, split: Split) -> bool:
    """Whether ``split``, decoded, fits ``data.cache_mb``: then each worker keeps every
    row group it decodes and reads each one once per run (a rank's share of an epoch
    changes from epoch to epoch, so a worker may meet every group)."""
    return decoded_bytes(cfg, split) <= cfg.cache_mb * 1024 * 1024


def decoder(cfg: DataConfig, shard: str) -> tuple[Any, dict[str, Any]]:
    """The function that turns an Arrow batch of ``cfg``'s shards into model arrays, and
    its keyword arguments (``shard``: any shard of the split; its format decides). What
    it raises is a :class:`~elastic.errors.UserCodeError` naming it: a decoder fails the
    same way on every retry."""
    decode, kwargs = data_format(cfg.format).decoder(cfg, shard)
    guarded = FormatCode(decode, f"data.format={cfg.format}'s decoder")
    return guarded, {"input_column": cfg.input_column, "target_column": cfg.target_column, **kwargs}


def finisher(cfg: DataConfig, shard: str) -> Finisher:
    """What turns a step's decoded inputs into the model's, in the training worker (the
    format's :meth:`~elastic.data.formats.DataFormat.finisher`, its errors named as the
    decoder's are; the identity where the format has none)."""
    finish = data_format(cfg.format).finisher(cfg, shard)
    if finish is None:
        return _as_decoded
    return FormatCode(finish, f"data.format={cfg.format}'s finisher")


def _as_decoded(x: np.ndarray) -> np.ndarray:
    return x


FIX_FORMAT = "fix it (docs/extending.md says what a decoder returns)"


class FormatCode:
    """A format's decoder or finisher (a plugin's code, or a built-in's): called as it
    is; an exception it raises becomes a :class:`~elastic.errors.UserCodeError` naming
    the function, the exception, its line and the batch's sample ids. Picklable: Ray
    Data ships it to its tasks."""

    def __init__(self, fn: Any, what: str) -> None:
        self.fn = fn
        inner = getattr(fn, "func", fn)  # a functools.partial
        self.what = f"{what} ({getattr(inner, '__qualname__', type(inner).__name__)})"

    def __call__(self, batch: Any, **kwargs: Any) -> Any:
        try:
            return self.fn(batch, **kwargs)
        except Exception:
            with user_code(self.what + _ids_of(batch), FIX_FORMAT):  # named, one line
                raise


def _ids_of(batch: Any) -> str:
    """ " on sample_id LOW..HIGH" of an Arrow batch, for the message (else "")."""
    try:
        ids = batch[ID_COLUMN]
        low, high = pc.min_max(ids).values()
        return f" on sample_id {low.as_py()}..{high.as_py()}"
    except Exception:
        return ""


def planned_dataset(
    cfg: DataConfig,
    files: list[str],
    reads: list[tuple[int, int]],
    remote_args: dict[str, Any] | None = None,
) -> Any:
    """A rank's read of the row groups ``reads`` ((file index, group) into ``files``, in
    that order: :meth:`elastic.data.order.EpochPlan.reads`), decoded by the format's
    decoder in Ray Data, each block tagged with the group it holds
    (:data:`elastic.data.assemble.GROUP_COLUMNS`). A read task reads consecutive row groups
    of the list, up to :data:`TASK_BYTES` of them (each task and block costs the
    streaming executor's scheduling, on the training worker's cores); the blocks come
    out in the plan's order, a group possibly split between blocks. The tasks go where
    Ray's default puts them: the submitting worker's node while it has a free CPU, else
    another (pinning them to the worker's node, even softly, queues them behind the
    training worker that holds its CPUs). ``remote_args``: Ray options of its tasks."""
    import ray.data
    from ray.data import ExecutionOptions

    columns = read_columns(cfg, footer(files[0]).schema)
    source = _row_group_source(files, reads, columns, decoded_row_bytes(cfg, files))
    remote_args = remote_args or {}
    ds = ray.data.read_datasource(
        source, override_num_blocks=max(1, source.tasks), ray_remote_args=remote_args
    )
    ds.context.execution_options = ExecutionOptions(preserve_order=True)
    decode, kwargs = decoder(cfg, files[0])

    def tagged(batch: pa.Table, **kw: Any) -> dict[str, Any]:
        out = decode(batch.drop_columns(list(GROUP_COLUMNS)), **kw)
        for name in GROUP_COLUMNS:
            out[name] = batch[name].to_numpy()
        return out

    return ds.map_batches(
        tagged, batch_format="pyarrow", zero_copy_batch=True, fn_kwargs=kwargs, **remote_args
    )


TASK_BYTES = 32 * 2**20
"""A read task's row groups: consecutive ones of a rank's list, up to this many bytes
(uncompressed from the footers, or decoded where that is more; at least one group).
Each task costs the streaming executor ~30 ms of the consuming worker's CPU, whatever
its size (measured on 2 cores: a rank's 32 MB of synthetic rows read at 29k rows/s in
2 MB tasks, 78k in 8 MB ones, 87-136k in 32 MB ones)."""
FIRST_TASK_BYTES = 4 * 2**20
"""The first task's size; each next one twice the last, up to :data:`TASK_BYTES` (the
first rows come soon after an execution starts)."""


def _row_group_source(
    files: list[str], reads: list[tuple[int, int]], columns: list[str], row_bytes: float = 0.0
) -> Any:
    """A Ray Data datasource of the row groups ``reads``, in order, a read task each run
    of consecutive groups, the first about :data:`FIRST_TASK_BYTES`, each next twice the
    last up to :data:`TASK_BYTES`, a group counted by its Parquet size or its rows decoded
    (``row_bytes`` each), whichever is more: a task's groups come as one block, decoded
    (contact maps grow ~30x)."""
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    runs: list[list[tuple[int, int, int]]] = []
    size, cap = 0.0, FIRST_TASK_BYTES // 2
    for i, (f, g) in enumerate(reads):
        meta = footer(files[f])
        nbytes = max(meta.group_bytes[g], meta.rows[g] * row_bytes)
        if not runs or size + nbytes > cap:
            runs.append([])
            size, cap = 0.0, min(2 * cap, TASK_BYTES)
        runs[-1].append((i, f, g))
        size += nbytes

    def read(run: list[tuple[int, int, int]]) -> list[pa.Table]:
        tables: list[pa.Table] = []
        shards: dict[int, pq.ParquetFile] = {}
        for i, f, g in run:
            shard = shards.get(f) or shards.setdefault(f, pq.ParquetFile(files[f]))
            table = shard.read_row_group(g, columns=columns)
            for name, value in zip(GROUP_COLUMNS, (f, g, i), strict=True):
                table = table.append_column(name, pa.array([value] * table.num_rows, pa.int32()))
            tables.append(table)
        return [pa.concat_tables(tables)]

    class RowGroups(Datasource):
        tasks = len(runs)

        def estimate_inmemory_data_size(self) -> int | None:
            return None

        def get_read_tasks(
            self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
        ) -> list[ReadTask]:
            out = []
            for run in runs:
                metas = [(footer(files[f]), g) for _, f, g in run]
                out.append(
                    ReadTask(
                        functools.partial(read, run),
                        BlockMetadata(
                            num_rows=sum(m.rows[g] for m, g in metas),
                            size_bytes=sum(m.group_bytes[g] for m, g in metas),
                            input_files=tuple(sorted({files[f] for _, f, _ in run})),
                            exec_stats=None,
                        ),
                    )
                )
            return out

    return RowGroups()


def warm_up(
    cfg: DataConfig, files: list[str], group: tuple[int, int], processes: int = 1
) -> WarmUp:
    """Starts :class:`WarmUp` (``processes`` processes for the worker group's reads of
    ``files``, then a Ray Data read of row group ``group``) in a thread of the driver."""
    thread = WarmUp(cfg, files, group, processes)
    thread.start()
    return thread


class WarmUp(threading.Thread):
    """Starts ``processes`` worker processes for the worker group's Ray Data reads on this
    node, then one small Ray Data read of row group ``group`` (file index, group) through
    the workers' own path (read task, decoder), while Ray Train starts the worker group:
    a process takes seconds to start and import the decoder (~5 s each on 2 busy
    cores), which the workers' first epoch would wait for (and every worker group after
    a restart, in new processes).

    The processes are of the workers' runtime env (the job's with Ray Train's additions:
    :func:`~elastic.cluster.ray_internals.train_worker_env_vars`), since Ray gives a task
    only a process of its own runtime env; an idle one lives 30 s on elastic's Ray nodes
    (:data:`elastic.cluster.bootstrap.WORKER_POOL`), long enough for a worker group's start.
    A failure here is left to the workers' real read to report."""

    def __init__(
        self, cfg: DataConfig, files: list[str], group: tuple[int, int], processes: int
    ) -> None:
        super().__init__(name="elastic-data-warm-up", daemon=True)
        self.cfg, self.files, self.group, self.processes = cfg, files, group, processes
        self.pids: list[int] = []
        """The processes it started or found (their ids), once it is done."""

    def run(self) -> None:
        import ray

        from elastic.cluster.ray_internals import train_worker_env_vars

        with contextlib.suppress(Exception):
            env = {"env_vars": train_worker_env_vars()}
            # each task holds its process until all have one: one process each
            hold = ray.remote(num_cpus=0, runtime_env=env)(_import_decoder)
            held = [hold.remote(self.cfg, self.files[0], 0.5) for _ in range(self.processes)]
            self.pids = ray.get(held)
            planned_dataset(self.cfg, self.files, [self.group], {"runtime_env": env}).take_batch(1)


def _import_decoder(cfg: DataConfig, shard: str, hold_s: float) -> int:
    """In a task: import what a read task runs (Ray Data's side of it, ~3 s on 2 busy
    cores, and the format's decoder), hold the process ``hold_s`` seconds, and say which
    process it was."""
    import os
    import time

    import ray.data  # noqa: F401

    decoder(cfg, shard)
    time.sleep(hold_s)
    return os.getpid()


_DONE = object()


class RayStream:
    """A Ray Data iterator of decoded blocks, iterated by a thread of its own from now on
    (Ray Data starts its execution at the first ``next``), ``depth`` blocks ahead; its
    failure is raised to the reader. :meth:`pieces` cuts the blocks into their row
    groups' reads (by the GROUP_COLUMNS tags), in order. Once closed, both ends give up
    within half a second and the iterator is closed (Ray Data then ends its
    execution)."""

    def __init__(self, items: Any, depth: int = 2) -> None:
        self._items, self._stop = items, threading.Event()
        self._out: queue.Queue[Any] = queue.Queue(maxsize=depth)
        threading.Thread(target=self._run, name="elastic-ray-data", daemon=True).start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._out.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        items = self._items
        try:
            for item in items:
                if not self._put(item):
                    break
            else:
                self._put(_DONE)
        except BaseException as e:
            self._put(e)
        finally:
            if callable(close := getattr(items, "close", None)):
                close()

    def close(self) -> None:
        self._stop.set()

    def pieces(self) -> Iterator[tuple[tuple[int, int], dict[str, np.ndarray]]]:
        while not self._stop.is_set():
            try:
                block = self._out.get(timeout=0.5)
            except queue.Empty:
                continue
            if block is _DONE:
                return
            if isinstance(block, BaseException):
                raise block
            f, g, i = (block[name] for name in GROUP_COLUMNS)
            cuts = np.flatnonzero(i[1:] != i[:-1]) + 1
            for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(f)], strict=True):
                columns = {k: v[a:b] for k, v in block.items() if k not in GROUP_COLUMNS}
                yield (int(f[a]), int(g[a])), columns
