"""Worker side: decoded row groups in, this rank's slice of every global batch out.

:class:`SliceAssembler` takes the row groups a rank reads (whole, in the order of
:meth:`elastic.data.order.EpochPlan.reads`) and cuts each step's slice out of them. It
works a *chunk* of steps at a time: one lookup and one gather per row group and column
for the whole chunk, each step's batch then a view of it (per step, the gather cost
~0.3 ms at 64 rows a step, as much as the rest of a small model's data path). Chunks
start at one step (a resumed group's first batch waits for no more than its own rows)
and double up to :data:`CHUNK_STEPS` steps or :data:`CHUNK_BYTES`, whichever is less.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from elastic.data.order import EpochPlan, Group, Split

GROUP_COLUMNS = ("__file", "__group", "__read")
"""A decoded block's tags: the row group its rows come from, and that read's index in
the execution's list (one execution reads several epochs: a group read at one epoch's
end and again at the next one's start, in one block, stays two reads)."""
CHUNK_STEPS = 64
"""Most steps gathered together."""
CHUNK_BYTES = 4 * 2**20
"""Most bytes gathered together (a chunk's batches are held until its last is trained)."""

Columns = dict[str, np.ndarray]


class SliceAssembler:
    """Decoded row groups in, this rank's slice of each global batch out.

    Groups arrive whole, as ``(file, group, columns)``, in the order of
    :meth:`EpochPlan.reads`. :meth:`steps` yields ``(step, batch)`` from ``from_step`` to
    the end of the epoch, each batch the rows of :meth:`EpochPlan.slice` in that order
    (``{}`` where this rank has none at that step: the epoch's tail), and drops a group
    once this rank has trained all of its rows that it owns."""

    def __init__(self, plan: EpochPlan, rank: int, world: Split, from_step: int = 0) -> None:
        self.plan, self.rank, self.world, self.from_step = plan, rank, world, from_step
        self._left = plan.rows_left(rank, world, from_step)
        self._groups: dict[Group, Columns] = {}
        self._seen: set[Group] = set()
        self._row_bytes = 0  # of a decoded row, once a group has come

    @property
    def held_groups(self) -> int:
        """Row groups in memory now (decoded, not yet fully trained)."""
        return len(self._groups)

    def steps(self, groups: Iterable[tuple[int, int, Columns]]) -> Iterator[tuple[int, Columns]]:
        source = iter(groups)
        chunk = 1
        for first, table in self.plan.slice_tables(self.rank, self.world, self.from_step):
            rows = table.shape[1]
            at = 0
            while at < len(table):
                part = table[at : at + chunk]
                batch = self._chunk(part.reshape(-1), source)
                for i in range(len(part)):
                    lo, hi = i * rows, (i + 1) * rows
                    yield first + at + i, {k: v[lo:hi] for k, v in batch.items()}
                at += len(part)
                limit = CHUNK_BYTES // max(1, rows * self._row_bytes)
                chunk = max(1, min(2 * chunk, CHUNK_STEPS, limit))

    def _chunk(self, positions: np.ndarray, source: Iterator[tuple[int, int, Columns]]) -> Columns:
        """The rows at ``positions`` (epoch positions, in order), gathered from the row
        groups that hold them (pulled from ``source`` as needed); groups whose last
        owned row this was are dropped."""
        if not len(positions):
            return {}
        plan = self.plan
        k, r = plan.locate(positions)
        distinct, inverse, counts = np.unique(k, return_inverse=True, return_counts=True)
        wanted = [plan.group(int(i)) for i in distinct]
        for fg in wanted:
            while fg not in self._groups:
                self._take(next(source, None), fg)
        first = self._groups[wanted[0]]
        out = {key: np.empty((len(r), *v.shape[1:]), v.dtype) for key, v in first.items()}
        # the chunk's rows grouped by row group: one fancy index per group and column
        by_group = np.argsort(inverse, kind="stable")
        ends = np.cumsum(counts)
        for fg, lo, hi in zip(wanted, ends - counts, ends, strict=True):
            at = by_group[lo:hi]
            group, rows = self._groups[fg], r[at]
            for key, column in out.items():
                column[at] = group[key][rows]
            self._left[fg] -= int(hi - lo)
            if not self._left[fg]:
                del self._groups[fg]
        return out

    def _take(self, item: tuple[int, int, Columns] | None, waiting: Group) -> None:
        if item is None:
            raise ValueError(
                f"the data ended before row group {waiting[1]} of file {waiting[0]} came: "
                "the read plan and the groups read disagree"
            )
        f, g, columns = item
        if (f, g) in self._seen:
            raise ValueError(f"row group {g} of file {f} was read twice: the plan reads it once")
        self._seen.add((f, g))
        have = len(next(iter(columns.values())))
        expected = self.plan.layout.rows[f][g]
        if have != expected:
            raise ValueError(
                f"row group {g} of file {f}: {have} rows read, {expected} planned (the shard "
                "changed while the run was reading it)"
            )
        if have and not self._row_bytes:
            self._row_bytes = sum(v.nbytes for v in columns.values()) // have
        if self._left.get((f, g)):  # else read only for rows of windows trained before
            self._groups[(f, g)] = columns
