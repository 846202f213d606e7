"""Worker side: a step's batch (:class:`StepBatch`), and the validation split.

:func:`val_blocks` reads a worker's share of the validation split itself, with no Ray
Data pipeline; :class:`StepStream` cuts it into batches in lock step with the other
workers, so a worker whose share runs out early still takes part in every collective.
Training batches come from :class:`elastic.data.reader.PlannedReader`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from elastic.data.pipeline import decoder, finisher, read_columns
from elastic.data.settings import DataConfig
from elastic.data.shards import ID_COLUMN


def val_blocks(
    cfg: DataConfig, files: list[str], rank: int, world: int
) -> Iterator[dict[str, np.ndarray]]:
    """This worker's share of the validation split, read and decoded here (the inputs as
    the model takes them: :func:`~elastic.data.pipeline.finisher`): row group i of
    the split (its files in order, each file's row groups in order) is rank
    ``i % world``'s, so every validation row is evaluated once at any world size.

    No Ray Data pipeline: Ray Train would start a split coordinator actor for it at every
    worker group start, which cost a small run ~10 s of its start on 2 cores (measured
    with and without ``data.val_path``), for a split read once per validation."""
    if not files:
        return
    import pyarrow.parquet as pq

    decode, kwargs = decoder(cfg, files[0])
    finish = finisher(cfg, files[0])
    index = 0
    for path in files:
        shard = pq.ParquetFile(path)
        columns = read_columns(cfg, shard.schema_arrow)
        for group in range(shard.num_row_groups):
            if index % world == rank:
                table = shard.read_row_group(group, columns=columns)
                if table.num_rows:
                    block = decode(table, **kwargs)
                    yield {**block, "x": finish(block["x"])}
            index += 1


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
    """This worker's share of a split, cut into batches, in lock step.

    Each batch takes up to ``rows_per_step`` rows from this worker's blocks and
    all-reduces the row count, so every worker runs the same number of batches (an empty
    one where its share has run out). It ends when a batch finds no rows anywhere.
    """

    def __init__(
        self,
        blocks: Iterator[dict[str, np.ndarray]],
        rows_per_step: int,
        count_all_reduce: Any,
        empty: dict[str, np.ndarray] | None = None,
    ) -> None:
        self._batches = blocks
        self._rows_per_step = rows_per_step
        self._count_all_reduce = count_all_reduce
        self._pending: deque[dict[str, np.ndarray]] = deque()
        self._pending_rows = 0
        self._exhausted = False
        # shapes for an empty batch, should this worker's share be empty from the start
        self._empty = empty

    def _take_local(self) -> dict[str, np.ndarray]:
        """Up to rows_per_step rows from the head of the buffered blocks."""
        while self._pending_rows < self._rows_per_step and not self._exhausted:
            try:
                batch = next(self._batches)
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
