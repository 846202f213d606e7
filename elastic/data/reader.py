"""Worker side: this rank's row groups, read through Ray Data ahead of training.

Every global batch is fixed by the plan (:mod:`elastic.data.order`); a rank knows from
the Parquet footers which row groups its slices need and in which order, from any step
on. :class:`PlannedReader` reads exactly those (Ray Data read tasks of consecutive
row groups, 4 MB growing to 32 MB, decoded by the format's decoder; one execution for
up to :data:`CHAIN_EPOCHS` epochs) in a background thread, into a buffer bounded by
``data.prefetch_mb``, and goes on to the next epoch's groups as soon as the current
epoch's are read, so an epoch's start overlaps with the tail of the one before. It
reads at most one epoch ahead of training (Ray Data holds up to two blocks more).

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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from elastic.data.assemble import SliceAssembler
from elastic.data.footers import footer
from elastic.data.order import EpochPlan, Group, Layout, Split
from elastic.data.pipeline import finisher
from elastic.data.settings import DataConfig
from elastic.data.stream import StepBatch
from elastic.errors import DataError

if TYPE_CHECKING:  # the module imports Ray Data's side lazily
    from elastic.data.pipeline import RayStream

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
        # each shard's content, as its footer states it (sizes, offsets, statistics)
        "footers": [footer(f).digest[:16] for f in files],
        "global_batch_size": cfg.global_batch_size,
        "lanes": lanes_of(cfg),
        "window": cfg.shuffle_window_rows,
        "seed": cfg.seed,
        "shuffle": cfg.shuffle,
    }


def slice_ids(
    cfg: DataConfig,
    files: list[str],
    layout: Layout,
    epoch: int,
    steps: range,
    ranks: list[int],
    world: Split,
) -> np.ndarray:
    """The sample ids of ranks ``ranks``' slices of steps ``steps`` (0-based in epoch
    ``epoch``) at split ``world``, read from the shards (the ``sample_id`` column of the
    row groups they fall in)."""
    import pyarrow.parquet as pq

    plan = epoch_plan(cfg, layout, epoch)
    rows = [r for k in steps for rank in ranks for r in plan.slice(k, rank, world)]
    columns: dict[Group, np.ndarray] = {}
    out = np.empty(len(rows), np.int64)
    for i, (f, g, r) in enumerate(rows):
        if (f, g) not in columns:
            table = pq.ParquetFile(files[f]).read_row_group(g, columns=["sample_id"])
            columns[(f, g)] = table["sample_id"].to_numpy()
        out[i] = columns[(f, g)][r]
    return out


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
    return layout_changes(saved, now) or content_changes(saved, now)


def layout_changes(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """The first shard added, removed or of other row groups (what the plan of an epoch
    is made from), in words; None when the names and rows are as they were."""
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


def content_changes(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """The first shard whose content differs (its footer: other values, or another
    file of the same name and rows), in words; None when every footer is the same, or
    the checkpoint predates footer digests."""
    if "footers" not in saved:
        return None
    before = dict(zip(saved["files"], saved["footers"], strict=True))
    after = dict(zip(now["files"], now["footers"], strict=True))
    changed = [name for name, digest in before.items() if after.get(name, digest) != digest]
    if not changed:
        return None
    more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
    return (
        f"shard {changed[0]}{more} holds other data than when the checkpoint was written "
        "(same name and rows, another footer: other values, or another file)"
    )


def setting_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The plan settings that differ, as ``key=now (was saved)``."""
    return [
        f"{key}={now[name]} (was {saved[name]})"
        for name, key in SETTING_KEYS.items()
        if saved.get(name) != now[name]
    ]


_EPOCH_END = object()
CHAIN_EPOCHS = 4
"""Epochs a reader reads through one Ray Data execution."""


@dataclass
class _EpochReads:
    """One epoch of a reader's chain: every group it needs in order (``reads``), those
    of its first step (``first``), those read in the worker (``local``) and those
    streamed through Ray Data (``streamed``, in order)."""

    epoch: int
    reads: list[Group]
    first: set[Group]
    local: set[Group]
    streamed: list[Group]


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
        # a step's inputs as the model takes them, from the decoder's (its format's)
        self._finish = finisher(cfg, files[0])
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
        self._stream_now: RayStream | None = None  # the chain's; closed with the reader
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
                parts = self._plan_chain(epoch, step)
                self._read_chain(parts)
                epoch, step = parts[-1].epoch + 1, 0
        except BaseException as e:  # surface the reader's failure in the training thread
            if not self._stop:  # once closed, a read cut short is no failure
                self._queue.put(e)

    def _plan_chain(self, epoch: int, step: int) -> list[_EpochReads]:
        """What to read of up to :data:`CHAIN_EPOCHS` epochs from (``epoch``, ``step``):
        one Ray Data execution reads them all (an execution's start costs ~0.1 s and the
        epoch's first rows waited for it: ~0.25 s of a rank's 0.3-0.4 s epoch of the
        synthetic bench data). Where the split is cached, an epoch streams only the groups
        no earlier epoch read."""
        held = set() if self._cache is None else set(self._cache)
        last = epoch + CHAIN_EPOCHS if self._end is None else min(self._end, epoch + CHAIN_EPOCHS)
        parts = []
        for e in range(epoch, last):
            plan = epoch_plan(self.cfg, self.layout, e)
            from_step = step if e == epoch else 0
            reads = plan.reads(self.rank, self.world, from_step)
            first: set[Group] = set()
            if e == epoch and self.first_batch_ready_s is None and from_step < plan.steps:
                k, _ = plan.locate(plan.slice_positions(from_step, self.rank, self.world))
                first = {plan.group(int(i)) for i in set(k.tolist())}
            fresh = [fg for fg in reads if fg not in held]
            if self._cache is not None:
                held.update(fresh)
            streamed = [fg for fg in fresh if fg not in first]
            parts.append(_EpochReads(e, reads, first, set(fresh) & first, streamed))
        return parts

    def _read_chain(self, parts: list[_EpochReads]) -> None:
        """Read the epochs ``parts`` in order through one Ray Data execution (their
        streamed groups), each epoch once training is in the one before."""
        stream = self._stream([fg for part in parts for fg in part.streamed])
        pieces = stream.pieces() if stream is not None else iter(())
        try:
            for part in parts:
                with self._cond:
                    while part.epoch > self._consuming + 1 and not self._stop:
                        self._cond.wait(timeout=1.0)
                if self._stop:
                    return
                self._read_groups(part, pieces)
                self._queue.put(_EPOCH_END)
        finally:  # its execution ends with the chain's reads (or the reader)
            if stream is not None:
                stream.close()

    def _read_groups(self, part: _EpochReads, pieces: Iterator[tuple[Group, Columns]]) -> None:
        """Read ``part.reads`` in order: from this worker's cache where the plan found a
        group there (``part`` neither streams it nor reads it here; what the plan chose
        decides, not what the cache holds by now), from the stream ``pieces``, or here;
        note when the groups of ``part.first`` (the first step's, at the group's start)
        are in.

        Those of ``part.local`` (the first step's) are read here, with pyarrow and the same
        decoder, while Ray Data's execution for the rest starts: a worker group's first
        Ray Data execution starts its task processes, ~5 s here on a fresh cluster and
        ~1 s on a warm one (the training loop would wait that long at every restart).
        (Reading more here until Ray Data's first block came was tried: Ray Data then
        read those groups as well, and on 2 cores the later epochs took 2-6x as long.)"""
        cache, first, local = self._cache, part.first, part.local
        streamed = set(part.streamed)
        for fg in part.reads:
            first.discard(fg)
            if cache is not None and fg not in local and fg not in streamed:
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

    def _stream(self, reads: list[Group]) -> RayStream | None:
        """A Ray Data stream of ``reads`` (None: nothing to read)."""
        if not reads:
            return None
        import logging

        import ray.data

        from elastic.data.pipeline import RayStream, planned_dataset

        # a worker starts a Ray Data execution every few epochs: keep its log to what matters
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = ctx.print_on_execution_start = False
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        ds = planned_dataset(self.cfg, self.files, reads)
        batches = ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=2)
        self._stream_now = RayStream(batches)
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
            # no rows of this step here: the model's shapes, empty; else its inputs finished
            b = {**batch, "x": self._finish(batch["x"])} if batch else self._empty
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

    def resplit(
        self, world: Split, epoch: int, step: int, rank: int | None = None
    ) -> PlannedReader:
        """This reader from step ``step`` of epoch ``epoch`` on with another split of
        every step's rows (the decoded row groups it caches are kept), and ``rank``'s
        slices where given (a live run's new quorum); it is closed."""
        self.close()
        return PlannedReader(
            self.cfg,
            self.files,
            self.layout,
            self.rank if rank is None else rank,
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
