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
from dataclasses import dataclass, field

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
        self._starts = list(np.cumsum([0] + [n for _, _, n in groups]))

    # -- the epoch's shape ------------------------------------------------------------
    @property
    def rows(self) -> int:
        return int(self._starts[-1])

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
