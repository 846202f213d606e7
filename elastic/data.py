"""Parquet shards -> Ray Data -> per-worker step batches.

Driver side: :func:`check_dataset` validates the shard directory before Ray starts;
:func:`build_datasets` reads it with ``ray.data.read_parquet`` and decodes in
``map_batches``. Worker side: :class:`StepStream` turns the worker's streaming split into
one batch per optimizer step, in lock step with the other workers, so that workers whose
share of the epoch runs out early still take part in every collective.
"""

from __future__ import annotations

import hashlib
import os
import queue
import re
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from elastic.accounting import bitmap_contains
from elastic.config import DataConfig
from elastic.errors import ConfigError, run_error
from elastic.errors import DataError as DataError  # re-exported

ID_COLUMN = "sample_id"


def data_error(exc: BaseException) -> str | None:
    """The one-line message of a run-ending error in ``exc``'s chain (see elastic.errors)."""
    return run_error(exc)


def list_shards(path: str, key: str = "data.path") -> list[str]:
    """The sorted ``.parquet`` files of a directory, or a ConfigError naming the key."""
    if not os.path.exists(path):
        raise ConfigError(f"{key}={path} does not exist: point {key} at a directory of shards")
    if not os.path.isdir(path):
        raise ConfigError(f"{key}={path} is not a directory: point it at a directory of shards")
    files = sorted(
        os.path.join(path, f)
        for f in os.listdir(path)
        if f.endswith(".parquet") and not f.startswith(".")
    )
    if not files:
        raise ConfigError(
            f"{key}={path} holds no .parquet files: prepare the dataset there or fix the path"
        )
    return files


def locate_samples(path: str, ids: np.ndarray) -> dict[int, str]:
    """The shard file (name) that holds each of ``ids``: the Parquet footers' sample_id
    statistics narrow it to row groups, which are then read. For error messages only
    (a row that broke training): one directory's footers, never on the hot path."""
    wanted = {int(i) for i in ids}
    found: dict[int, str] = {}
    for file in list_shards(path):
        meta = pq.ParquetFile(file).metadata
        col = meta.schema.to_arrow_schema().get_field_index(ID_COLUMN)
        for g in range(meta.num_row_groups):
            stats = meta.row_group(g).column(col).statistics if col >= 0 else None
            if (
                stats is not None
                and stats.has_min_max
                and not any(stats.min <= i <= stats.max for i in wanted)
            ):
                continue
            ids_here = pq.ParquetFile(file).read_row_group(g, columns=[ID_COLUMN])[ID_COLUMN]
            for i in set(ids_here.to_pylist()) & wanted:
                found[i] = os.path.basename(file)
        if len(found) == len(wanted):
            break
    return found


def damaged_shard(exc: BaseException, dirs: list[str | None]) -> str | None:
    """One line naming a shard that cannot be read, when ``exc`` (from reading the data)
    came from one: decided by reading the shard again here, in full, so a transient I/O
    error (gone on a re-read) is still retried like any other failure. A page that does
    not decode fails the same way on every retry: Ray Data retried it, then Ray Train
    restarted the worker group on it 11 times without naming the file."""
    chain: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is not None and all(e is not c for c in chain):
            chain.append(e)
            todo += [e.__cause__, e.__context__]
    text = "\n".join(str(e) for e in chain)
    if "parquet" not in text.lower() and "arrow" not in text.lower():
        return None
    named = re.findall(r"Failed to read fragment (\S+?\.parquet)", text)
    files = list(dict.fromkeys(named)) or [
        f for d in dirs if d and os.path.isdir(d) for f in list_shards(d)
    ]
    for file in files:
        try:
            shard = pq.ParquetFile(file)
            for g in range(shard.metadata.num_row_groups):
                shard.read_row_group(g)
        except Exception as e:  # what pyarrow says is the message
            why = " ".join(str(e).split())[:200]
            return (
                f"shard {file} cannot be read ({why}): write it again (re-run the dataset's "
                "converter) or move it out of the dataset directory"
            )
    return None


def in_val(key: str, val_fraction: float, seed: int) -> bool:
    """Stable split: whether ``key`` (a file's path, a sample group) is held out depends
    only on the key and the seed, never on what else the dataset holds."""
    h = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(h[:8], "little") / 2**64 < val_fraction


# the only files a converter writes into a split directory
SHARD_NAME = re.compile(r"part-\d{5}\.parquet")


class OutputError(ValueError):
    """A converter's output directory that cannot be written (a file, or a directory
    holding Parquet files the converter did not write)."""


def check_split_dir(out: str | os.PathLike) -> str:
    """``out`` if a converter may write its split there: a directory (or a path to create)
    holding no ``.parquet`` file besides its own ``part-NNNNN.parquet``. Another Parquet
    file would be read as part of the dataset, and must not be deleted either."""
    d = os.fspath(out)
    existing = next(a for a in (Path(d), *Path(d).parents) if a.exists())
    if not existing.is_dir():
        raise OutputError(f"{existing} is a file, not a directory: give an output directory")
    if existing == Path(d):
        foreign = sorted(
            f
            for f in os.listdir(d)
            if f.endswith(".parquet") and not f.startswith(".") and not SHARD_NAME.fullmatch(f)
        )
        if foreign:
            raise OutputError(
                f"{d} holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}, "
                "not written by this converter: write to an empty directory or move them away"
            )
    return d


def write_split(table: pa.Table, out: str | os.PathLike, shards: int, seed: int) -> None:
    """A converter's split: ``table``'s rows in a seeded random order (inputs often come
    sorted by class or time; unmixed, a step would see one kind of sample) as up to
    ``shards`` files ``out/part-NNNNN.parquet``, replacing the split's old shards (and
    nothing else: see :func:`check_split_dir`). Each file is written under a temp name and
    renamed: a half-written shard never looks valid."""
    d = check_split_dir(out)
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create {d} ({e.strerror}): give a writable directory") from None
    for old in os.listdir(d):
        if SHARD_NAME.fullmatch(old):
            os.remove(os.path.join(d, old))
    mixed = table.take(np.random.default_rng(seed).permutation(table.num_rows))
    bounds = np.linspace(0, table.num_rows, max(1, min(shards, table.num_rows)) + 1).astype(int)
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        final = os.path.join(d, f"part-{i:05d}.parquet")
        tmp = os.path.join(d, f".part-{i:05d}.parquet.tmp")
        pq.write_table(mixed.slice(lo, hi - lo), tmp)
        os.replace(tmp, final)


@dataclass(frozen=True)
class Split:
    """A checked split: its shard files, rows, and uncompressed bytes (from the footers)."""

    files: list[str]
    rows: int
    bytes: int


def check_dataset(cfg: DataConfig) -> dict[str, Split]:
    """Every shard opens and has the columns the run needs; returns the splits.

    Reads only Parquet footers, so it is cheap even for thousands of shards.
    """
    required = (ID_COLUMN, cfg.input_column, cfg.target_column)
    checked = {}
    splits = [("train", "data.path", cfg.path)]
    if cfg.val_path:
        splits.append(("val", "data.val_path", cfg.val_path))
    first_types: dict[str, pa.DataType] | None = None
    first_file = ""
    for split, key, path in splits:
        rows = size = 0
        files = list_shards(path, key)
        for f in files:
            try:
                meta = pq.read_metadata(f)
            except (pa.ArrowInvalid, OSError) as e:
                raise ConfigError(
                    f"{f} is not a readable Parquet file ({str(e).splitlines()[0]}): "
                    "regenerate or remove it"
                ) from None
            schema = meta.schema.to_arrow_schema()
            for col in required:
                if col not in schema.names:
                    raise ConfigError(
                        f"{f} has no column {col!r} (columns: {', '.join(schema.names)}): "
                        f"regenerate the shard or set data.input_column/data.target_column"
                    )
            types = {col: schema.field(col).type for col in required}
            if first_types is None:
                first_types, first_file = types, f
            for col, typ in types.items():
                if typ != first_types[col]:
                    raise ConfigError(
                        f"{f} has column {col!r} of type {typ}, {first_file} of type "
                        f"{first_types[col]}: every shard of a dataset needs the same schema"
                    )
            rows += meta.num_rows
            size += sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        checked[split] = Split(files, rows, size)
    return checked


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
    """One Arrow batch of shard rows -> the arrays the model consumes."""
    return {
        ID_COLUMN: column_to_numpy(batch[ID_COLUMN]).astype(np.int64, copy=False),
        "x": column_to_numpy(batch[input_column]),
        "y": column_to_numpy(batch[target_column]),
    }


def read_columns(cfg: DataConfig, schema: pa.Schema) -> list[str]:
    """The columns a run reads from shards of ``schema``."""
    columns = [ID_COLUMN, cfg.input_column, cfg.target_column]
    if cfg.format == "image" and "path" in schema.names:
        columns.append("path")  # the source image's name, for a decode error
    return columns


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
    its keyword arguments (``shard``: any shard of the split, for the contact width)."""
    kwargs: dict[str, Any] = {"input_column": cfg.input_column, "target_column": cfg.target_column}
    if cfg.format == "image":
        from elastic.images import decode_images

        return decode_images, {**kwargs, "size": cfg.image_size, "channels": cfg.image_channels}
    if cfg.format == "contacts":
        from elastic.protein import contact_width, decode_contacts

        return decode_contacts, {**kwargs, "width": contact_width(shard)}
    return decode_batch, kwargs


def build_datasets(cfg: DataConfig, splits: dict[str, Split], max_workers: int) -> dict[str, Any]:
    """Lazy Ray datasets for the splits :func:`check_dataset` returned (train, maybe val)."""
    import ray.data
    from ray.data import FileShuffleConfig

    def load(split: Split, shuffle_files: bool) -> ray.data.Dataset:
        # Ray 2.60's new Parquet reader spends 2-3 s in a ListFiles task at the start of
        # every epoch, even for files listed explicitly; the previous reader starts in
        # ~0.15 s (measured here). We already list and check the shards ourselves.
        ctx = ray.data.DataContext.get_current()
        use_v2, ctx.use_datasource_v2 = ctx.use_datasource_v2, False
        columns = read_columns(cfg, pq.read_schema(split.files[0]))
        # train, data.shuffle_files: a file order fixed by (data.seed, Ray Data's
        # execution index), which data_config() sets to the epoch an execution reads
        shuffle = FileShuffleConfig(seed=cfg.seed) if shuffle_files else None
        try:
            ds = ray.data.read_parquet(split.files, columns=columns, shuffle=shuffle)
        finally:
            ctx.use_datasource_v2 = use_v2
        ds.context.target_max_block_size = block_bytes(split.bytes, cfg.block_size_mb, max_workers)
        decode, kwargs = decoder(cfg, split.files[0])
        return ds.map_batches(
            decode, batch_format="pyarrow", zero_copy_batch=True, fn_kwargs=kwargs
        )

    return {
        name: load(split, cfg.shuffle_files and name == "train") for name, split in splits.items()
    }


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
                ds = ds.copy(ds, _deep_copy=True)  # its own context: train and val differ
                ds.context.execution_options = self._resolve_execution_options(name)
                if name == "train" and first_epoch is not None:
                    # FileShuffleConfig seeds each execution by (seed, execution index)
                    ds.context._execution_idx = int(first_epoch())
                for i, split in enumerate(ds.streaming_split(world_size, equal=False)):
                    output[i][name] = split
            return output

    return LosslessDataConfig(execution_options=ExecutionOptions(preserve_order=True))


def shard_blocks(shard: Any, prefetch_batches: int = 2) -> Iterator[dict[str, np.ndarray]]:
    """One pass over a worker's split as whole blocks (``batch_size=None``): cutting
    blocks into steps ourselves is a numpy view per step, where Ray's re-batching would
    copy and do bookkeeping for every step."""
    return iter(
        shard.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=prefetch_batches)
    )


def shuffled(
    blocks: Iterator[dict[str, np.ndarray]], buffer_rows: int, seed: int, epoch: int, rank: int
) -> Iterator[dict[str, np.ndarray]]:
    """A worker's blocks with their rows mixed through a buffer of ``buffer_rows`` rows,
    in an order fixed by (``seed``, ``epoch``, ``rank``) and the blocks that came in:
    the same blocks give the same order (a resume at the same world size replays it, and
    drops the trained rows after this), the next epoch another. 0 = unchanged.

    The buffer fills to ``buffer_rows``, its rows are permuted and the first half leaves
    as one block; the rest waits for the next blocks. The tail leaves permuted."""
    if buffer_rows <= 0:
        yield from blocks
        return
    rng = np.random.default_rng([seed, epoch, rank, 0x5EED])
    pending: list[dict[str, np.ndarray]] = []
    rows = 0
    for block in blocks:
        n = len(block[ID_COLUMN])
        if not n:
            continue
        pending.append(block)
        rows += n
        if rows < buffer_rows:
            continue
        merged = {k: np.concatenate([b[k] for b in pending]) for k in pending[0]}
        order = rng.permutation(rows)
        out, keep = order[: rows // 2], order[rows // 2 :]
        yield {k: v[out] for k, v in merged.items()}
        pending, rows = [{k: v[keep] for k, v in merged.items()}], len(keep)
    if rows:
        merged = {k: np.concatenate([b[k] for b in pending]) for k in pending[0]}
        order = rng.permutation(rows)
        yield {k: v[order] for k, v in merged.items()}


_EPOCH_END = object()


class EpochPrefetcher:
    """Reads a worker's split ahead, across epoch boundaries, into a bounded buffer.

    Ray Data starts each epoch's pipeline only when every worker has asked for it, and
    the start takes seconds (listing and opening shards, starting tasks). A background
    thread reads this worker's share into a queue bounded by ``max_bytes`` and asks for
    the next epoch as soon as the current one is read, so that start overlaps with
    training on the buffered tail of the current epoch instead of stalling it. It reads
    at most one epoch ahead of training: further read-ahead only takes CPU from training.

    ``cache=True`` (every worker must agree: Ray Data starts an epoch only when all splits
    ask for it) reads the split once and keeps a copy of its blocks: every later epoch
    comes from memory and reads nothing. With ``block_order=(seed, rank)`` the epochs
    after epoch 0 take the cached blocks in an order fixed by (seed, epoch, rank), as a
    shuffled file order would; without, in the order read.
    """

    def __init__(
        self,
        shard: Any,
        max_bytes: int,
        epochs: int | None = None,
        cache: bool = False,
        block_order: tuple[int, int] | None = None,
    ) -> None:
        self._shard = shard
        self._block_order = block_order if cache else None
        self._epochs = 1 if cache else epochs  # None: as many as the trainer asks for
        self._cache: list[dict[str, np.ndarray]] | None = [] if cache else None
        self._cached = False  # the whole first epoch is in _cache
        self._queue: queue.Queue[Any] = queue.Queue()
        self._max_bytes = max_bytes
        self._bytes = 0
        self._cond = threading.Condition()
        self._stop = False
        self._consuming = -1  # the epoch training is in (index of the epoch() call)
        self._thread = threading.Thread(target=self._run, name="elastic-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            read = 0
            while not self._stop and (self._epochs is None or read < self._epochs):
                with self._cond:
                    while read > self._consuming + 1 and not self._stop:
                        self._cond.wait(timeout=1.0)
                read += 1
                for block in shard_blocks(self._shard):
                    size = sum(v.nbytes for v in block.values())
                    with self._cond:
                        # always admit one block, so a block larger than the cap still flows
                        while self._bytes and self._bytes + size > self._max_bytes:
                            if self._stop:
                                return
                            self._cond.wait(timeout=1.0)
                        self._bytes += size
                    if self._cache is not None:
                        # a private copy: holding Ray's views would pin object-store memory
                        block = {k: np.array(v) for k, v in block.items()}
                        self._cache.append(block)
                    self._queue.put((block, size))
                self._queue.put(_EPOCH_END)
        except BaseException as e:  # surface the reader's failure in the training thread
            self._queue.put(e)

    def epoch(self, index: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """This worker's blocks of the next epoch (the run's epoch ``index``), in order."""
        if self._block_order is not None and index > 0:
            if not self._cached:  # a resume past epoch 0: the whole share, then reorder
                for _ in self._read_epoch():
                    pass
            seed, rank = self._block_order
            blocks = self._cache or []
            order = np.random.default_rng([seed, index, rank, 0xB10C]).permutation(len(blocks))
            yield from (blocks[i] for i in order)
        elif self._cached:
            yield from self._cache or ()
        else:
            yield from self._read_epoch()

    def _read_epoch(self) -> Iterator[dict[str, np.ndarray]]:
        with self._cond:
            self._consuming += 1
            self._cond.notify_all()
        while True:
            item = self._queue.get()
            if item is _EPOCH_END:
                self._cached = self._cache is not None
                return
            if isinstance(item, BaseException):
                raise item
            block, size = item
            with self._cond:
                self._bytes -= size
                self._cond.notify_all()
            yield block

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()


@dataclass
class StepBatch:
    """This worker's rows for one optimizer step, and the step's row count on all workers."""

    sample_id: np.ndarray
    x: np.ndarray
    y: np.ndarray
    global_rows: int

    @property
    def rows(self) -> int:
        return int(self.sample_id.shape[0])


class StepStream:
    """This worker's share of one epoch, cut into per-step batches, in lock step.

    Each step takes up to ``rows_per_step`` rows from this worker's split and all-reduces
    the row count, so every worker runs the same number of steps (an empty batch where its
    share has run out) and the loss can be weighted by the true global row count. The
    epoch ends when a step finds no rows anywhere.

    Resume: ``skip_ids`` (a packed bitmap over ``sample_id``) drops the rows the epoch
    has already trained, at any world size.
    """

    def __init__(
        self,
        blocks: Iterator[dict[str, np.ndarray]],
        rows_per_step: int,
        count_all_reduce: Any,
        skip_ids: np.ndarray | None = None,
        empty: dict[str, np.ndarray] | None = None,
    ) -> None:
        self._batches = blocks
        self._rows_per_step = rows_per_step
        self._count_all_reduce = count_all_reduce
        self._skip_ids = skip_ids
        self._pending: deque[dict[str, np.ndarray]] = deque()
        self._pending_rows = 0
        self._exhausted = False
        # shapes for an empty batch, should this worker's share be empty from the start
        self._empty = empty

    def _filter(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._skip_ids is not None and len(batch[ID_COLUMN]):
            seen = bitmap_contains(self._skip_ids, batch[ID_COLUMN])
            if seen.any():
                batch = {k: v[~seen] for k, v in batch.items()}
        return batch

    def _take_local(self) -> dict[str, np.ndarray]:
        """Up to rows_per_step rows from the head of the buffered blocks."""
        while self._pending_rows < self._rows_per_step and not self._exhausted:
            try:
                batch = self._filter(next(self._batches))
            except StopIteration:
                self._exhausted = True
                break
            self._empty = {k: v[:0] for k, v in batch.items()}
            if len(batch[ID_COLUMN]):
                self._pending.append(batch)
                self._pending_rows += len(batch[ID_COLUMN])
        if not self._pending:
            return self._empty if self._empty is not None else {}
        pieces, need = [], self._rows_per_step
        while need and self._pending:
            head = self._pending[0]
            rows = len(head[ID_COLUMN])
            if rows <= need:
                pieces.append(self._pending.popleft())
                need -= rows
            else:
                pieces.append({k: v[:need] for k, v in head.items()})
                self._pending[0] = {k: v[need:] for k, v in head.items()}
                need = 0
        self._pending_rows -= self._rows_per_step - need
        if len(pieces) == 1:
            return pieces[0]  # a view into the block: no copy
        # a step that straddles two blocks is the only copy
        return {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}

    def __iter__(self) -> Iterator[StepBatch]:
        while True:
            local = self._take_local()
            rows = len(local[ID_COLUMN]) if local else 0
            global_rows = self._count_all_reduce(rows)
            if global_rows == 0:
                return
            if not local:
                raise RuntimeError("no batch shapes known for an empty batch: pass empty=")
            yield StepBatch(local[ID_COLUMN], local["x"], local["y"], global_rows)


def input_width(cfg: DataConfig) -> int | None:
    """Width of the model's input vector when the data fixes it: a fixed-size list
    column, or contact maps (the same number of bits in every shard of both splits, else
    a ConfigError naming the odd shard). None for other encodings."""
    if cfg.format == "contacts":
        from elastic.protein import contact_width

        files = list_shards(cfg.path) + (list_shards(cfg.val_path) if cfg.val_path else [])
        widths = [contact_width(f) for f in files]
        for f, width in zip(files, widths, strict=True):
            if width is None:
                raise ConfigError(
                    f"{f} is not a contact-map shard (no elastic.contact_bits metadata): "
                    "write it with datasets/protein/prepare.py or set data.format"
                )
            if width != widths[0]:
                raise ConfigError(
                    f"{f} holds contact maps of {width} bits, {files[0]} of {widths[0]}: "
                    "proteins of different residue counts cannot share a dataset"
                )
        return widths[0]
    field_type = pq.read_schema(list_shards(cfg.path)[0]).field(cfg.input_column).type
    return field_type.list_size if pa.types.is_fixed_size_list(field_type) else None
