"""Global batches that do not depend on the world size: which rows form every step.

Pure (no Ray, no I/O beyond the Parquet footers), so it can be checked against an
independent enumeration. What it guarantees:

- An epoch's rows are dealt into ``lanes`` canonical lanes that do not depend on the
  world size: the split's row groups in an order fixed by (seed, epoch), concatenated,
  cut into ``lanes`` contiguous ranges in proportion to the rows each gives a step, so
  that all run out together (an epoch is ceil(rows / B) steps, rarely one more).
- A lane is read in windows of ``window`` rows; each window's rows are permuted by
  (seed, epoch, lane, window). Shuffling is therefore seekable: the rows of any step
  are found from the Parquet metadata alone, with nothing read and thrown away.
- Global batch ``s`` takes rows ``[s*q_c, (s+1)*q_c)`` of every lane ``c``, where
  ``q_c = B // lanes`` (+1 for the first ``B % lanes`` lanes), lane after lane. It is a
  function of (split, seed, epoch, step) alone.
- At world size N, rank r trains rows ``[G*r//N, G*(r+1)//N)`` of that list (G: the
  step's rows): its slice. Any N from 1 to B takes the same global batches, and slices
  differ by at most one row, whether or not N divides B. A *split* may weight the ranks
  instead (shares w by rank: rank r trains ``[G*W_r//W, G*W_{r+1}//W)``, W_r the shares
  of the ranks before r, W all): the same rows form the step, only who trains which
  changes (``stragglers.policy=rebalance``). Since a rank's rows come from a
  contiguous run of lanes (the same ones every full step), it reads a contiguous part of
  the epoch's row-group order: what it trains, plus the row groups it shares with its
  neighbours at each end, and the rest of the windows it resumes in.

``lanes`` sets what a rank holds and reads: about ``lanes / N + 1`` lanes, each with a
window and a row group in memory. ``lanes >= N`` keeps every lane's rows on one or two
ranks; fewer lanes than ranks make ranks share lanes (each reads the lane's row groups).

A row is named by (file index, row group, row in the group), in the split's sorted
file order; inside the plan by its *position* in the epoch's row order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

Row = tuple[int, int, int]  # (file index, row group, row within the group)
Group = tuple[int, int]  # (file index, row group)
Split = int | tuple[int, ...]
"""Who trains which part of every step: a world size N (N equal shares), or each rank's
share (non-negative integers, by rank; their sum > 0)."""


def slice_sizes(rows: int, split: Split) -> list[int]:
    """How many of a step's ``rows`` each rank trains under ``split``, by rank (the
    sizes of :meth:`EpochPlan.bounds`' slices)."""
    cum = np.cumsum((0, *shares_of(split)))
    return [int(n) for n in np.diff(rows * cum // cum[-1])]


def shares_of(split: Split) -> tuple[int, ...]:
    """A split as its shares, by rank."""
    if isinstance(split, int):
        return (1,) * split
    if not split or min(split) < 0 or sum(split) <= 0:
        raise ValueError(f"shares {split} must be non-negative integers with a positive sum")
    return tuple(int(w) for w in split)


@dataclass(frozen=True)
class Layout:
    """The split's row groups, from the Parquet footers: ``rows[f][g]`` is the number of
    rows in row group g of file f (files in the split's sorted order)."""

    rows: tuple[tuple[int, ...], ...]

    @classmethod
    def of_files(cls, files: list[str]) -> Layout:
        from elastic.data.footers import footers

        return cls(tuple(f.rows for f in footers(files)))

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
    _starts: np.ndarray = field(init=False, repr=False)
    _perms: dict[int, tuple[int, np.ndarray]] = field(init=False, repr=False)

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
        self._starts = np.cumsum([0] + [n for _, _, n in groups], dtype=np.int64)
        self._perms = {}  # per lane: its latest window's permutation
        c = np.arange(self.lanes, dtype=np.int64)
        self._quota = self.global_batch // self.lanes + (c < self.global_batch % self.lanes)
        # lanes as long as their quotas make them: every lane runs out at the same step
        ends = np.cumsum(np.r_[0, self._quota]) * self.rows // self.global_batch
        self._lane_start, self._lane_size = ends[:-1], np.diff(ends)
        self._full = int((self._lane_size // self._quota).min())

    # -- the epoch's shape ------------------------------------------------------------
    @property
    def rows(self) -> int:
        return int(self._starts[-1])

    def lane_range(self, lane: int) -> tuple[int, int]:
        """Lane ``lane``'s positions in the epoch's row order: [start, stop)."""
        start = int(self._lane_start[lane])
        return start, start + int(self._lane_size[lane])

    def quota(self, lane: int) -> int:
        """Rows lane ``lane`` gives to every full step."""
        return int(self._quota[lane])

    @property
    def steps(self) -> int:
        """Steps in the epoch (the last ones smaller where lanes run out)."""
        return int((-(-self._lane_size // self._quota)).max())

    def global_rows(self, step: int) -> int:
        """Rows of global batch ``step`` (the global batch, less at the epoch's tail)."""
        if step < self._full:
            return self.global_batch
        left = np.clip(self._lane_size - step * self._quota, 0, self._quota)
        return int(left.sum())

    # -- slices -----------------------------------------------------------------------
    @property
    def full_steps(self) -> int:
        """Steps in which every lane gives its whole quota (all but the epoch's tail)."""
        return self._full

    def _counts(self, step: int) -> np.ndarray:
        return np.clip(self._lane_size - step * self._quota, 0, self._quota)

    def bounds(self, step: int, rank: int, world: Split) -> tuple[int, int]:
        """Rank ``rank``'s rows of global batch ``step``: [lo, hi) of its lane-by-lane list."""
        shares = shares_of(world)
        if not 1 <= len(shares) <= self.global_batch:
            raise ValueError(
                f"world size {len(shares)} must be between 1 and the global batch "
                f"({self.global_batch})"
            )
        rows, total = self.global_rows(step), sum(shares)
        before = sum(shares[:rank])
        return rows * before // total, rows * (before + shares[rank]) // total

    def slice_ranges(self, step: int, rank: int, world: Split) -> list[tuple[int, int, int]]:
        """Rank ``rank``'s slice of step ``step`` as (lane, first, last) ranges of lane rows."""
        lo, hi = self.bounds(step, rank, world)
        counts = self._counts(step)
        ends = np.cumsum(counts)
        out = []
        c = int(np.searchsorted(ends, lo, side="right"))
        while c < self.lanes and lo < hi:
            begin = int(ends[c] - counts[c])
            take = min(hi, int(ends[c])) - max(lo, begin)
            if take > 0:
                first = step * self.quota(c) + max(lo, begin) - begin
                out.append((c, first, first + take))
            lo = max(lo, int(ends[c]))
            c += 1
        return out

    def slice_positions(self, step: int, rank: int, world: Split) -> np.ndarray:
        """Epoch positions of rank ``rank``'s slice of step ``step``, in training order."""
        parts = [self.positions(c, a, b) for c, a, b in self.slice_ranges(step, rank, world)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def slices(
        self, rank: int, world: Split, from_step: int = 0, block: int = 1024
    ) -> Iterator[tuple[int, np.ndarray]]:
        """``(step, slice_positions(step, rank, world))`` for every step from
        ``from_step`` to the epoch's end (from :meth:`slice_tables`)."""
        for first, table in self.slice_tables(rank, world, from_step, block):
            for i, row in enumerate(table):
                yield first + i, row

    def slice_tables(
        self, rank: int, world: Split, from_step: int = 0, block: int = 1024
    ) -> Iterator[tuple[int, np.ndarray]]:
        """Rank ``rank``'s slices from ``from_step`` to the epoch's end as tables
        ``(first step, positions[steps, rows])``: the full steps ``block`` at a time
        (their slices take the same lane sub-ranges every step, so they are computed
        together), then each tail step alone."""
        full = self.full_steps
        for lo in range(from_step, full, block):
            hi = min(full, lo + block)
            at = np.arange(lo, hi, dtype=np.int64)[:, None]
            cols = []
            for c, first, last in self.slice_ranges(lo, rank, world):
                q = self.quota(c)
                rows = at * q + np.arange(first - lo * q, last - lo * q, dtype=np.int64)
                cols.append(self.positions_of(c, rows.reshape(-1)).reshape(len(at), -1))
            yield lo, np.concatenate(cols, axis=1) if cols else np.zeros((len(at), 0), np.int64)
        for step in range(max(from_step, full), self.steps):
            yield step, self.slice_positions(step, rank, world)[None, :]

    def _spans(self, rank: int, world: Split, from_step: int) -> list[tuple[int, range, int, int]]:
        """What rank ``rank`` trains from ``from_step`` to the epoch's end, as
        (lane, steps, a, b): lane rows ``s*q + [a, b)`` of every step s in ``steps``. The
        full steps take the same sub-ranges of the same lanes each step (one span a lane);
        the tail, where lanes run out and the slices move, one span a lane a step."""
        out = []
        full = self.full_steps
        if from_step < full:
            for c, first, last in self.slice_ranges(from_step, rank, world):
                q = self.quota(c)
                out.append((c, range(from_step, full), first - from_step * q, last - from_step * q))
        for step in range(max(from_step, full), self.steps):
            for c, first, last in self.slice_ranges(step, rank, world):
                q = self.quota(c)
                out.append((c, range(step, step + 1), first - step * q, last - step * q))
        return out

    # -- positions --------------------------------------------------------------------
    def positions(self, lane: int, first: int, last: int) -> np.ndarray:
        """Epoch positions of rows ``first`` to ``last`` (exclusive) of lane ``lane``, in
        training order."""
        size = int(self._lane_size[lane])
        first, last = max(0, first), min(size, last)
        return self.positions_of(lane, np.arange(first, max(first, last), dtype=np.int64))

    def positions_of(self, lane: int, rows: np.ndarray) -> np.ndarray:
        """Epoch positions of lane rows ``rows`` (ascending) of lane ``lane``."""
        start, stop = self.lane_range(lane)
        size = stop - start
        out = np.empty(len(rows), np.int64)
        if not len(rows):
            return out
        windows = rows // self.window
        cuts = np.flatnonzero(np.diff(windows)) + 1
        for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(rows)], strict=True):
            w = int(windows[a])
            perm = self._perm(lane, w, min(self.window, size - w * self.window))
            out[a:b] = start + w * self.window + perm[rows[a:b] - w * self.window]
        return out

    def _perm(self, lane: int, w: int, length: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(length, dtype=np.int64)
        cached = self._perms.get(lane)
        if cached is None or cached[0] != w:
            rng = np.random.default_rng([self.seed, self.epoch, lane, w, 0x1A7E])
            cached = self._perms[lane] = (w, rng.permutation(length).astype(np.int64))
        return cached[1]

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(index into the epoch's group order, row within that group) of each position."""
        k = np.searchsorted(self._starts, positions, side="right") - 1
        return k, positions - self._starts[k]

    def group(self, k: int) -> Group:
        """The (file, row group) at index ``k`` of the epoch's group order."""
        f, g, _ = self._order[k]
        return f, g

    def _rows(self, positions: np.ndarray) -> list[Row]:
        k, r = self.locate(positions)
        return [(*self.group(int(a)), int(b)) for a, b in zip(k, r, strict=True)]

    def _row_at(self, position: int) -> Row:
        return self._rows(np.array([position], np.int64))[0]

    # -- rows (for checks and tools: the loop works with positions) -------------------
    def lane_rows(self, lane: int, first: int, last: int) -> list[Row]:
        """Rows ``first`` to ``last`` (exclusive) of lane ``lane``, in training order."""
        return self._rows(self.positions(lane, first, last))

    def batch(self, step: int) -> list[Row]:
        """Global batch ``step`` (0-based in the epoch), lane by lane."""
        return self._rows(self.slice_positions(step, 0, 1))

    def slice(self, step: int, rank: int, world: Split) -> list[Row]:
        """Rank ``rank``'s part of global batch ``step`` at world size ``world``."""
        return self._rows(self.slice_positions(step, rank, world))

    # -- what to read -----------------------------------------------------------------
    def reads(self, rank: int, world: Split, from_step: int = 0) -> list[Group]:
        """The row groups (file, group) rank ``rank`` must read to train from step
        ``from_step`` to the end of the epoch, in the order it first needs them: the
        windows its slices touch from the resume step on, each window's groups once (a
        window's rows are permuted: it is read whole at the step of its first row)."""
        needed: dict[Group, tuple[int, int]] = {}
        for c, steps, a, b in self._spans(rank, world, from_step):
            start, stop = self.lane_range(c)
            q = self.quota(c)
            lo_row, hi_row = steps[0] * q + a, steps[-1] * q + b  # lane rows touched
            for w in range(lo_row // self.window, (hi_row - 1) // self.window + 1):
                # the first step whose rows [s*q + a, s*q + b) reach into window w
                when = (max(steps[0], (w * self.window - b) // q + 1), c)
                lo = start + w * self.window
                hi = min(stop, lo + self.window)
                k0 = int(np.searchsorted(self._starts, lo, side="right")) - 1
                k1 = int(np.searchsorted(self._starts, hi, side="left"))
                for k in range(k0, k1):
                    fg = self.group(k)
                    needed[fg] = min(needed.get(fg, when), when)
        return [fg for fg, _ in sorted(needed.items(), key=lambda kv: kv[1])]

    def rows_left(self, rank: int, world: Split, from_step: int = 0) -> dict[Group, int]:
        """How many rows of each row group rank ``rank`` trains from ``from_step`` on."""
        parts = []
        for c, steps, a, b in self._spans(rank, world, from_step):
            at = np.arange(steps.start, steps.stop, dtype=np.int64)
            rows = (at[:, None] * self.quota(c) + np.arange(a, b)[None, :]).reshape(-1)
            parts.append(self.positions_of(c, rows))
        if not parts:
            return {}
        k, _ = self.locate(np.concatenate(parts))
        counts = np.bincount(k, minlength=len(self._order))
        return {self.group(int(i)): int(counts[i]) for i in np.flatnonzero(counts)}
