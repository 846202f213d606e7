"""Worker side: the worker's streaming split -> one batch per optimizer step.

:class:`EpochPrefetcher` reads ahead (and caches a split that fits), :func:`shuffled`
mixes rows per (seed, epoch, rank), and :class:`StepStream` cuts per-step batches in lock
step with the other workers, so workers whose share of the epoch runs out early still
take part in every collective. :func:`val_blocks` reads a worker's share of the
validation split itself, with no Ray Data pipeline.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from elastic.config.schema import DataConfig
from elastic.data.ids import bitmap_contains
from elastic.data.pipeline import decoder, read_columns
from elastic.data.shards import ID_COLUMN


def shard_blocks(shard: Any, prefetch_batches: int = 2) -> Iterator[dict[str, np.ndarray]]:
    """One pass over a worker's split as whole blocks (``batch_size=None``): cutting
    blocks into steps ourselves is a numpy view per step, where Ray's re-batching would
    copy and do bookkeeping for every step."""
    return iter(
        shard.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=prefetch_batches)
    )


def val_blocks(
    cfg: DataConfig, files: list[str], rank: int, world: int
) -> Iterator[dict[str, np.ndarray]]:
    """This worker's share of the validation split, read and decoded here: row group i of
    the split (its files in order, each file's row groups in order) is rank
    ``i % world``'s, so every validation row is evaluated once at any world size.

    No Ray Data pipeline: Ray Train would start a split coordinator actor for it at every
    worker group start, which cost a small run ~10 s of its start on 2 cores (measured
    with and without ``data.val_path``), for a split read once per validation."""
    if not files:
        return
    import pyarrow.parquet as pq

    decode, kwargs = decoder(cfg, files[0])
    index = 0
    for path in files:
        shard = pq.ParquetFile(path)
        columns = read_columns(cfg, shard.schema_arrow)
        for group in range(shard.num_row_groups):
            if index % world == rank:
                table = shard.read_row_group(group, columns=columns)
                if table.num_rows:
                    yield decode(table, **kwargs)
            index += 1


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
