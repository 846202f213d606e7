"""Worker side: this rank's row groups, read through Ray Data ahead of training.

Every global batch is fixed by the plan (:mod:`elastic.data.order`); a rank knows from
the Parquet footers which row groups its slices need and in which order, from any step
on. :class:`PlannedReader` reads exactly those (Ray Data read tasks of ~8 MB of
consecutive row groups, decoded by the format's decoder) in a
background thread, into a buffer bounded by ``data.prefetch_mb``, and goes on to the
next epoch's groups as soon as the current epoch's are read, so an epoch's start overlaps
with the tail of the one before. It reads at most one epoch ahead of training.

A split whose decoded rows fit ``data.cache_mb`` is kept: every row group is decoded once
per worker and later epochs take what this worker already holds from memory, reading
only the groups it has not met yet.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from elastic.config.schema import DataConfig
from elastic.data.order import GROUP_COLUMNS, EpochPlan, Group, Layout, SliceAssembler, Split
from elastic.data.stream import StepBatch
from elastic.errors import DataError

Columns = dict[str, np.ndarray]


def lanes_of(cfg: DataConfig) -> int:
    """The run's lane count: ``data.lanes``, or the global batch (one row a lane a step)."""
    return cfg.lanes or cfg.global_batch_size


def epoch_plan(cfg: DataConfig, layout: Layout, epoch: int) -> EpochPlan:
    """The plan of epoch ``epoch`` of a run with data settings ``cfg``."""
    return EpochPlan(
        layout,
        seed=cfg.seed,
        epoch=epoch,
        global_batch=cfg.global_batch_size,
        lanes=lanes_of(cfg),
        window=cfg.shuffle_window_rows,
        shuffle=cfg.shuffle,
    )


def data_record(cfg: DataConfig, files: list[str], layout: Layout) -> dict[str, Any]:
    """What fixes every global batch of a run: the split's files and row groups, and the
    plan's settings. Kept in each checkpoint; a resume compares it with the data now
    (:func:`data_changes`, :func:`setting_changes`)."""
    return {
        "files": [os.path.basename(f) for f in files],
        "row_groups": [list(r) for r in layout.rows],
        "global_batch_size": cfg.global_batch_size,
        "lanes": lanes_of(cfg),
        "window": cfg.shuffle_window_rows,
        "seed": cfg.seed,
        "shuffle": cfg.shuffle,
    }


SETTING_KEYS = {
    "global_batch_size": "data.global_batch_size",
    "lanes": "data.lanes",
    "window": "data.shuffle_window_rows",
    "seed": "data.seed",
    "shuffle": "data.shuffle",
}


def data_changes(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """The first way the split in ``now`` differs from the one in ``saved`` (two
    :func:`data_record` results), in words, or None when it is the same data."""
    before = dict(zip(saved["files"], saved["row_groups"], strict=True))
    after = dict(zip(now["files"], now["row_groups"], strict=True))
    gone = [f for f in before if f not in after]
    new = [f for f in after if f not in before]
    for names, what in ((gone, "is gone"), (new, "is new")):
        if names:
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            return f"shard {names[0]} {what}{more}"
    for name, groups in before.items():
        if list(after[name]) != list(groups):
            return (
                f"shard {name} holds {sum(after[name])} rows in {len(after[name])} row "
                f"group(s), {sum(groups)} in {len(groups)} when the checkpoint was written"
            )
    return None


def setting_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The plan settings that differ, as ``key=now (was saved)``."""
    return [
        f"{key}={now[name]} (was {saved[name]})"
        for name, key in SETTING_KEYS.items()
        if saved.get(name) != now[name]
    ]


_EPOCH_END = object()
_DONE = object()


class _RayStream:
    """A Ray Data iterator of decoded blocks, iterated by a thread of its own from now on
    (Ray Data starts its execution at the first ``next``), ``depth`` blocks ahead; its
    failure is raised to the reader. :meth:`pieces` cuts the blocks into their row
    groups' runs (by the GROUP_COLUMNS tags), in order. Once closed, both ends give up
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

    def pieces(self) -> Iterator[tuple[Group, Columns]]:
        while not self._stop.is_set():
            try:
                block = self._out.get(timeout=0.5)
            except queue.Empty:
                continue
            if block is _DONE:
                return
            if isinstance(block, BaseException):
                raise block
            f, g = block[GROUP_COLUMNS[0]], block[GROUP_COLUMNS[1]]
            cuts = np.flatnonzero((f[1:] != f[:-1]) | (g[1:] != g[:-1])) + 1
            for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(f)], strict=True):
                columns = {k: v[a:b] for k, v in block.items() if k not in GROUP_COLUMNS}
                yield (int(f[a]), int(g[a])), columns


class PlannedReader:
    """Reads rank ``rank``'s row groups from (``first_epoch``, ``first_step``) on, for
    ``epochs`` epochs in all (None: until closed); :meth:`epoch` turns them into this
    rank's per-step batches. Epochs must be asked for in order."""

    def __init__(
        self,
        cfg: DataConfig,
        files: list[str],
        layout: Layout,
        rank: int,
        world: Split,
        first_epoch: int = 0,
        first_step: int = 0,
        epochs: int | None = None,
        cache: bool = False,
        empty: Columns | None = None,
        cache_from: dict[Group, Columns] | None = None,
    ) -> None:
        """``world``: the world size, or each rank's share of every step (a rebalanced
        split); ``cache_from``: row groups another reader of this rank decoded."""
        self.cfg, self.files, self.layout = cfg, files, layout
        # a step's batch where this rank has no rows (the epoch's tail): its shapes
        self._empty = empty or {
            "sample_id": np.zeros(0, np.int64),
            "x": np.zeros((0, 1), np.float32),
            "y": np.zeros((0, 1), np.float32),
        }
        self.rank, self.world = rank, world
        self._next = (first_epoch, first_step)  # what epoch() is asked for next
        self._end = None if epochs is None else first_epoch + epochs
        self._cache: dict[Group, Columns] | None = None
        if cache:
            self._cache = {} if cache_from is None else cache_from
        self._queue: queue.Queue[Any] = queue.Queue()
        self._max_bytes = int(cfg.prefetch_mb * 1024 * 1024)
        self._bytes = 0
        self._cond = threading.Condition()
        self._stop = False
        self._stream_now: _RayStream | None = None  # the epoch's; closed with the reader
        self._consuming = first_epoch - 1  # the epoch training is in
        self.started = time.perf_counter()
        # start -> every row group of the first step read and decoded here
        self.first_batch_ready_s: float | None = None
        self._thread = threading.Thread(target=self._run, name="elastic-reader", daemon=True)
        self._thread.start()

    # -- the reading thread -----------------------------------------------------------
    def _run(self) -> None:
        try:
            epoch, step = self._next
            while not self._stop and (self._end is None or epoch < self._end):
                with self._cond:
                    while epoch > self._consuming + 1 and not self._stop:
                        self._cond.wait(timeout=1.0)
                plan = epoch_plan(self.cfg, self.layout, epoch)
                first: set[Group] = set()
                if self.first_batch_ready_s is None and step < plan.steps:
                    k, _ = plan.locate(plan.slice_positions(step, self.rank, self.world))
                    first = {plan.group(int(i)) for i in set(k.tolist())}
                self._read_epoch(plan.reads(self.rank, self.world, step), first)
                self._queue.put(_EPOCH_END)
                epoch, step = epoch + 1, 0
        except BaseException as e:  # surface the reader's failure in the training thread
            if not self._stop:  # once closed, a read cut short is no failure
                self._queue.put(e)

    def _read_epoch(self, reads: list[Group], first: set[Group]) -> None:
        """Read ``reads`` in order, from this worker's cache where it holds them; note
        when the groups of ``first`` (the first step's, at the group's start) are in.

        Those few are read here, with pyarrow and the same decoder, while Ray Data's
        execution for the rest starts: a worker group's first Ray Data execution starts
        its task processes, ~5 s here on a fresh cluster and ~1 s on a warm one (the
        training loop would wait that long at every restart). (Reading more here until
        Ray Data's first block came was tried: Ray Data then read those groups as well,
        and on 2 cores the later epochs took 2-6x as long.)"""
        cache = self._cache
        fresh = [fg for fg in reads if cache is None or fg not in cache]
        local = {fg for fg in fresh if fg in first}
        stream = self._stream([fg for fg in fresh if fg not in local])
        try:
            self._read_groups(reads, first, local, stream)
        finally:  # its execution ends with the epoch's reads (or the reader)
            if stream is not None:
                stream.close()

    def _read_groups(
        self, reads: list[Group], first: set[Group], local: set[Group], stream: _RayStream | None
    ) -> None:
        cache = self._cache
        pieces = stream.pieces() if stream is not None else iter(())
        for fg in reads:
            first.discard(fg)
            if cache is not None and fg in cache:
                self._put(fg, cache[fg], 0)
                continue
            columns = self._read_here(fg) if fg in local else self._assemble(pieces, fg)
            if not first and self.first_batch_ready_s is None:
                self.first_batch_ready_s = time.perf_counter() - self.started
            if cache is not None:
                cache[fg] = columns
            self._put(fg, columns, sum(v.nbytes for v in columns.values()))
            if self._stop:
                return

    def _read_here(self, fg: Group) -> Columns:
        """Row group ``fg`` read and decoded in this process."""
        import pyarrow.parquet as pq

        from elastic.data.pipeline import decoder, read_columns

        f, g = fg
        try:
            shard = pq.ParquetFile(self.files[f])
            table = shard.read_row_group(g, columns=read_columns(self.cfg, shard.schema_arrow))
        except Exception as e:  # damaged_shard() reads it again to tell a damaged page
            raise OSError(f"reading shard {self.files[f]} (parquet): {e}") from e
        if table.num_rows != self.layout.rows[f][g]:
            raise self._changed(f, g, table.num_rows, self.layout.rows[f][g])
        decode, kwargs = decoder(self.cfg, self.files[0])
        return {k: np.array(v) for k, v in decode(table, **kwargs).items()}

    def _put(self, fg: Group, columns: Columns, size: int) -> None:
        with self._cond:
            # always admit one group, so a group larger than the cap still flows
            while self._bytes and self._bytes + size > self._max_bytes and not self._stop:
                self._cond.wait(timeout=1.0)
            self._bytes += size
        self._queue.put((fg, columns, size))

    def _stream(self, reads: list[Group]) -> _RayStream | None:
        if not reads:
            return None
        import logging

        import ray.data

        from elastic.data.pipeline import planned_dataset

        # a worker starts a Ray Data execution every epoch: keep its log to what matters
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = ctx.print_on_execution_start = False
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        ds = planned_dataset(self.cfg, self.files, reads)
        batches = ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=2)
        self._stream_now = _RayStream(batches)
        return self._stream_now

    def _assemble(self, pieces: Iterator[tuple[Group, Columns]], fg: Group) -> Columns:
        """Row group ``fg`` whole, from the next piece(s) of the blocks (a large group
        may come in several), as a private copy: holding Ray's views would pin
        object-store memory."""
        f, g = fg
        expected = self.layout.rows[f][g]
        parts: list[Columns] = []
        have = 0
        while have < expected:
            piece = next(pieces, None)
            if piece is None:
                raise self._changed(f, g, have, expected)
            tag, columns = piece
            if tag != fg:
                raise RuntimeError(f"row group {tag} came where {fg} was planned: reads disagree")
            parts.append(columns)
            have += len(next(iter(columns.values())))
        if have != expected:
            raise self._changed(f, g, have, expected)
        if len(parts) == 1:
            return {k: np.array(v) for k, v in parts[0].items()}
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def _changed(self, f: int, g: int, have: int, expected: int) -> DataError:
        return DataError(
            f"shard {self.files[f]} changed while the run was reading it (row group {g}: "
            f"{have} rows read, {expected} when the run started): restore the shard, then "
            "run the same command to resume"
        )

    # -- the training thread ----------------------------------------------------------
    def epoch(self, epoch: int, from_step: int = 0) -> Iterator[StepBatch]:
        """This rank's batches of epoch ``epoch`` from step ``from_step`` (in the epoch)
        to its end; every rank gets the same number of batches (empty ones at the tail)."""
        if (epoch, from_step) != self._next:
            raise RuntimeError(f"epoch {epoch} from step {from_step} asked; reading {self._next}")
        self._next = (epoch + 1, 0)
        with self._cond:
            self._consuming = epoch
            self._cond.notify_all()
        plan = epoch_plan(self.cfg, self.layout, epoch)
        assembler = SliceAssembler(plan, self.rank, self.world, from_step)
        groups = self._groups()
        for step, batch in assembler.steps(groups):
            b = batch or self._empty
            yield StepBatch(b["sample_id"], b["x"], b["y"], plan.global_rows(step))
        for _ in groups:  # groups read only for rows trained before a resume: to the end
            pass

    def _groups(self) -> Iterator[tuple[int, int, Columns]]:
        while True:
            item = self._queue.get()
            if item is _EPOCH_END:
                return
            if isinstance(item, BaseException):
                raise item
            (f, g), columns, size = item
            with self._cond:
                self._bytes -= size
                self._cond.notify_all()
            yield f, g, columns

    def resplit(self, world: Split, epoch: int, step: int) -> PlannedReader:
        """This reader from step ``step`` of epoch ``epoch`` on with another split of
        every step's rows (the decoded row groups it caches are kept); it is closed."""
        self.close()
        return PlannedReader(
            self.cfg,
            self.files,
            self.layout,
            self.rank,
            world,
            first_epoch=epoch,
            first_step=step,
            epochs=None if self._end is None else self._end - epoch,
            cache=self._cache is not None,
            empty=self._empty,
            cache_from=self._cache,
        )

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._stream_now is not None:
            self._stream_now.close()
