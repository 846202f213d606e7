"""Global batches that do not depend on the world size (issue 16): the plan.

Not yet used by the training loop, which still takes Ray Data's dynamic split; this is
the part that decides which rows form every global batch, kept pure so it can be
checked without Ray. What it guarantees:

- An epoch's rows are dealt into ``lanes`` canonical lanes that do not depend on the
  world size: the split's row groups in an order fixed by (seed, epoch), concatenated,
  cut into ``lanes`` contiguous ranges whose sizes differ by at most one row.
- A lane is read in windows of ``window`` rows; each window's rows are permuted by
  (seed, epoch, lane, window). Shuffling is therefore seekable: the rows of any step
  are found from the Parquet metadata alone, with nothing read and thrown away.
- Global batch ``s`` takes rows ``[s*q_c, (s+1)*q_c)`` of every lane ``c``, where
  ``q_c = B // lanes`` (+1 for the first ``B % lanes`` lanes). It is a function of
  (split, seed, epoch, step) alone.
- At world size N, rank r trains the lanes ``c % N == r``: its slice of the global
  batch. Any N from 1 to ``lanes`` takes the same global batches. Slices differ by at
  most one lane's quota. A rank reads only its lanes' row groups: what it trains, and at
  most a row group's worth more at each end of each lane.

A row is named by (file index, row group, row in the group), in the split's sorted
file order.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Row = tuple[int, int, int]  # (file index, row group, row within the group)


@dataclass(frozen=True)
class Layout:
    """The split's row groups, from the Parquet footers: ``rows[f][g]`` is the number of
    rows in row group g of file f (files in the split's sorted order)."""

    rows: tuple[tuple[int, ...], ...]

    @classmethod
    def of_files(cls, files: list[str]) -> Layout:
        import pyarrow.parquet as pq

        out = []
        for path in files:
            meta = pq.read_metadata(path)
            out.append(tuple(meta.row_group(g).num_rows for g in range(meta.num_row_groups)))
        return cls(tuple(out))

    def groups(self) -> list[tuple[int, int, int]]:
        """Every non-empty row group as (file, group, rows), in file order."""
        return [(f, g, n) for f, rows in enumerate(self.rows) for g, n in enumerate(rows) if n]


@dataclass
class EpochPlan:
    """Which rows form every global batch of one epoch (see the module docstring)."""

    layout: Layout
    seed: int
    epoch: int
    global_batch: int
    lanes: int
    window: int = 1024
    shuffle: bool = True
    _order: list[tuple[int, int, int]] = field(init=False, repr=False)
    _starts: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.lanes <= self.global_batch:
            raise ValueError(
                f"lanes={self.lanes} must be between 1 and the global batch "
                f"({self.global_batch}): every lane gives at least one row to every step"
            )
        if self.window < 1:
            raise ValueError(f"window={self.window} must be >= 1")
        groups = self.layout.groups()
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.epoch, 0x0ADE])
            groups = [groups[i] for i in rng.permutation(len(groups))]
        self._order = groups
        self._starts = [int(x) for x in np.cumsum([0] + [n for _, _, n in groups])]

    # -- the epoch's shape ------------------------------------------------------------
    @property
    def rows(self) -> int:
        return self._starts[-1]

    def lane_range(self, lane: int) -> tuple[int, int]:
        """Lane ``lane``'s positions in the epoch's row order: [start, stop)."""
        return self.rows * lane // self.lanes, self.rows * (lane + 1) // self.lanes

    def quota(self, lane: int) -> int:
        """Rows lane ``lane`` gives to every full step."""
        return self.global_batch // self.lanes + (lane < self.global_batch % self.lanes)

    @property
    def steps(self) -> int:
        """Steps in the epoch (the last ones smaller where lanes run out)."""
        longest = 0
        for c in range(self.lanes):
            start, stop = self.lane_range(c)
            longest = max(longest, -(-(stop - start) // self.quota(c)))
        return longest

    # -- rows -------------------------------------------------------------------------
    def lane_rows(self, lane: int, first: int, last: int) -> list[Row]:
        """Rows ``first`` to ``last`` (exclusive) of lane ``lane``, in training order."""
        start, stop = self.lane_range(lane)
        size = stop - start
        first, last = max(0, first), min(size, last)
        out: list[Row] = []
        window = -1
        perm: np.ndarray = np.zeros(0, np.int64)
        for i in range(first, last):
            w, offset = divmod(i, self.window)
            if w != window:
                window = w
                length = min(self.window, size - w * self.window)
                if self.shuffle:
                    rng = np.random.default_rng([self.seed, self.epoch, lane, w, 0x1A7E])
                    perm = rng.permutation(length)
                else:
                    perm = np.arange(length)
            out.append(self._row_at(start + w * self.window + int(perm[offset])))
        return out

    def _row_at(self, position: int) -> Row:
        k = bisect.bisect_right(self._starts, position) - 1
        f, g, _ = self._order[k]
        return f, g, position - self._starts[k]

    def batch(self, step: int) -> list[Row]:
        """Global batch ``step`` (0-based in the epoch), lane by lane."""
        return [r for c in range(self.lanes) for r in self._lane_step(c, step)]

    def rank_lanes(self, rank: int, world: int) -> list[int]:
        if not 1 <= world <= self.lanes:
            raise ValueError(f"world size {world} must be between 1 and lanes={self.lanes}")
        return list(range(rank, self.lanes, world))

    def slice(self, step: int, rank: int, world: int) -> list[Row]:
        """Rank ``rank``'s part of global batch ``step`` at world size ``world``."""
        return [r for c in self.rank_lanes(rank, world) for r in self._lane_step(c, step)]

    def _lane_step(self, lane: int, step: int) -> list[Row]:
        q = self.quota(lane)
        return self.lane_rows(lane, step * q, (step + 1) * q)

    # -- what to read -----------------------------------------------------------------
    def reads(self, rank: int, world: int, from_step: int = 0) -> list[tuple[int, int]]:
        """The row groups (file, group) rank ``rank`` must read to train from step
        ``from_step`` to the end of the epoch, in the order it first needs them: the
        windows of its lanes from the resume position on, each window's groups once."""
        needed: dict[tuple[int, int], tuple[int, int]] = {}
        for c in self.rank_lanes(rank, world):
            start, stop = self.lane_range(c)
            size, q = stop - start, self.quota(c)
            first = min(size, from_step * q)
            for w in range(first // self.window, -(-size // self.window)):
                lo = start + w * self.window
                hi = min(stop, lo + self.window)
                k = bisect.bisect_right(self._starts, lo) - 1
                while k < len(self._order) and self._starts[k] < hi:
                    f, g, _ = self._order[k]
                    # a window is needed whole at the step of its first row
                    when = (max(first, w * self.window) // q, c)
                    needed[(f, g)] = min(needed.get((f, g), when), when)
                    k += 1
        return [fg for fg, _ in sorted(needed.items(), key=lambda kv: kv[1])]


GROUP_COLUMNS = ("__file", "__group")  # which row group a decoded block's rows come from


class SliceAssembler:
    """Worker side: decoded row groups in, this rank's slice of each global batch out.

    Blocks arrive in the order of :meth:`EpochPlan.reads` (a group may come in several
    blocks, its rows in file order), each with the columns :data:`GROUP_COLUMNS` saying
    which group it holds. :meth:`steps` yields ``(step, batch)`` from ``from_step`` to
    the end of the epoch, each batch the rows of :meth:`EpochPlan.slice` in that order,
    and drops a group once this rank has trained all of its rows that it owns."""

    def __init__(self, plan: EpochPlan, rank: int, world: int, from_step: int = 0) -> None:
        self.plan, self.rank, self.world, self.from_step = plan, rank, world, from_step
        self._parts: dict[tuple[int, int], list[dict[str, np.ndarray]]] = {}
        self._groups: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        self._left: dict[tuple[int, int], int] = {}
        self._complete: set[tuple[int, int]] = set()
        for step in range(from_step, plan.steps):
            for f, g, _ in plan.slice(step, rank, world):
                self._left[(f, g)] = self._left.get((f, g), 0) + 1

    @property
    def held_groups(self) -> int:
        """Row groups in memory now (decoded, not yet fully trained)."""
        return len(self._groups) + len(self._parts)

    def steps(self, blocks: Any) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        blocks = iter(blocks)
        for step in range(self.from_step, self.plan.steps):
            rows = self.plan.slice(step, self.rank, self.world)
            for f, g, _ in rows:
                while (f, g) not in self._groups:
                    self._take(next(blocks, None), (f, g))
            batch = self._gather(rows)
            for f, g, _ in rows:
                self._left[(f, g)] -= 1
                if not self._left[(f, g)]:
                    del self._groups[(f, g)]
            yield step, batch

    def _take(self, block: dict[str, np.ndarray] | None, waiting: tuple[int, int]) -> None:
        if block is None:
            raise ValueError(
                f"the data ended before row group {waiting[1]} of file {waiting[0]} came: "
                "the read plan and the blocks read disagree"
            )
        f, g = int(block[GROUP_COLUMNS[0]][0]), int(block[GROUP_COLUMNS[1]][0])
        if (f, g) in self._complete:
            raise ValueError(f"row group {g} of file {f} was read twice: the plan reads it once")
        self._parts.setdefault((f, g), []).append(
            {k: v for k, v in block.items() if k not in GROUP_COLUMNS}
        )
        have = sum(len(next(iter(p.values()))) for p in self._parts[(f, g)])
        expected = self.plan.layout.rows[f][g]
        if have > expected:
            raise ValueError(f"row group {g} of file {f}: {have} rows read, {expected} planned")
        if have == expected:
            self._complete.add((f, g))
            parts = self._parts.pop((f, g))
            if (f, g) in self._left:  # a group read for rows of windows not ours: dropped
                self._groups[(f, g)] = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def _gather(self, rows: list[Row]) -> dict[str, np.ndarray]:
        """The rows, in this order; {} where this rank has none at this step (the tail of
        an epoch: the loop sends its empty batch)."""
        if not rows:
            return {}
        by_group: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        for pos, (f, g, r) in enumerate(rows):
            at, idx = by_group.setdefault((f, g), ([], []))
            at.append(pos)
            idx.append(r)
        first = self._groups[(rows[0][0], rows[0][1])]
        out = {k: np.empty((len(rows), *v.shape[1:]), v.dtype) for k, v in first.items()}
        for fg, (at, idx) in by_group.items():
            group = self._groups[fg]
            for k in out:
                out[k][at] = group[k][idx]
        return out
