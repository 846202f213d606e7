"""The plan of world-size-independent global batches (elastic/data/order.py), checked
against an independent enumeration of the split's rows. Pure: no Ray."""

from __future__ import annotations

import itertools

import pytest

from elastic.data.order import EpochPlan, Layout

# irregular on purpose: an empty file, an empty row group, groups of every size
LAYOUT = Layout(((100, 37), (), (250, 0, 250, 13), (64,), (1, 1, 1)))
B = 48


def all_rows(layout: Layout) -> list[tuple[int, int, int]]:
    return [
        (f, g, r) for f, groups in enumerate(layout.rows) for g, n in enumerate(groups)
        for r in range(n)
    ]  # fmt: skip


def plan(epoch: int = 0, seed: int = 3, lanes: int = 8, window: int = 40, **kw) -> EpochPlan:
    return EpochPlan(LAYOUT, seed, epoch, B, lanes, window, **kw)


@pytest.mark.parametrize("lanes", [1, 5, 8, 48])
def test_every_row_is_in_exactly_one_global_batch_of_the_epoch(lanes):
    p = plan(lanes=lanes)
    batches = [p.batch(s) for s in range(p.steps)]
    seen = [r for b in batches for r in b]
    assert sorted(seen) == sorted(all_rows(LAYOUT)) and len(seen) == len(set(seen))
    # full global batches until the lanes run out, then the tail
    sizes = [len(b) for b in batches]
    full = len(seen) // B
    assert sizes[:full] == [B] * full and sum(sizes) == p.rows == 717
    assert all(0 < n < B for n in sizes[full:])


@pytest.mark.parametrize("lanes", [1, 5, 8, 48])
def test_the_global_batch_is_the_same_at_every_world_size(lanes):
    """Any world size up to the global batch, dividing it or not: the ranks' slices, in
    rank order, are the global batch, and differ by at most one row."""
    p = plan(lanes=lanes)
    for step in range(p.steps):
        expected = p.batch(step)
        for world in (1, 2, 3, 5, 7, 8, 13, 48):
            slices = [p.slice(step, r, world) for r in range(world)]
            assert [r for s in slices for r in s] == expected, (step, world)
            sizes = [len(s) for s in slices]
            assert max(sizes) - min(sizes) <= 1


def test_the_order_is_fixed_by_seed_and_epoch_and_new_every_epoch():
    assert [plan().batch(s) for s in range(3)] == [plan().batch(s) for s in range(3)]
    assert plan(epoch=1).batch(0) != plan(epoch=0).batch(0)
    assert plan(seed=4).batch(0) != plan(seed=3).batch(0)
    # rows really mixed: the first batch draws on most of the files, not one
    assert len({f for f, _, _ in plan().batch(0)}) >= 3


def test_shuffling_is_seekable_a_lane_read_from_its_middle_is_the_same():
    p = plan(lanes=5, window=40)
    for lane in range(5):
        start, stop = p.lane_range(lane)
        whole = p.lane_rows(lane, 0, stop - start)
        assert sorted(whole) == sorted(p._row_at(i) for i in range(start, stop))
        for a, b in [(0, 7), (39, 41), (40, 80), (55, stop - start)]:
            assert p.lane_rows(lane, a, b) == whole[a:b]


def test_without_shuffling_lanes_are_contiguous_runs_of_the_files():
    p = plan(lanes=4, shuffle=False)
    rows = all_rows(LAYOUT)
    for lane in range(4):
        start, stop = p.lane_range(lane)
        assert p.lane_rows(lane, 0, stop - start) == rows[start:stop]


@pytest.mark.parametrize("world,from_step", [(1, 0), (3, 0), (3, 5), (8, 9), (2, 14), (7, 3)])
def test_a_rank_reads_what_it_trains_from_the_resume_step_and_little_more(world, from_step):
    p = plan(lanes=8, window=40)
    read_rows = 0
    for rank in range(world):
        reads = p.reads(rank, world, from_step)
        assert len(reads) == len(set(reads))
        needed = {
            (f, g) for step in range(from_step, p.steps) for f, g, _ in p.slice(step, rank, world)
        }
        assert needed <= set(reads), (rank, needed - set(reads))
        read_rows += sum(LAYOUT.rows[f][g] for f, g in reads)
        # in the order they are first trained, give or take one window (a window's
        # groups are all read when its first row is needed: its rows are permuted)
        first: dict[tuple[int, int], int] = {}
        for step in range(from_step, p.steps):
            for f, g, _ in p.slice(step, rank, world):
                first.setdefault((f, g), step)
        slack = -(-p.window // min(p.quota(c) for c in range(p.lanes)))
        steps = [first[fg] for fg in reads if fg in first]
        assert all(a <= b + slack for i, a in enumerate(steps) for b in steps[i + 1 :]), steps
    # little more: the ranks together read the rows left to train, plus what neighbours
    # share at their boundaries (a window and a row group each side) and the windows
    # the resume step is in
    left = sum(len(p.batch(s)) for s in range(from_step, p.steps))
    biggest = max(n for rows in LAYOUT.rows for n in rows)
    assert read_rows <= left + (2 * (world - 1) + p.lanes) * (p.window + biggest)
    if from_step == 0 and world == 1:
        assert read_rows == p.rows  # alone, a rank reads each row group once


def test_the_layout_comes_from_the_parquet_footers(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for i, (rows, group) in enumerate([(250, 100), (7, 100), (64, 16)]):
        table = pa.table({"sample_id": pa.array(range(rows), pa.int64())})
        pq.write_table(table, tmp_path / f"part-{i}.parquet", row_group_size=group)
    files = sorted(str(p) for p in tmp_path.glob("*.parquet"))
    assert Layout.of_files(files).rows == ((100, 100, 50), (7,), (16, 16, 16, 16))


def test_impossible_plans_are_refused():
    with pytest.raises(ValueError, match="lanes=49"):
        plan(lanes=49)
    with pytest.raises(ValueError, match="world size 49"):
        plan(lanes=8).slice(0, 0, 49)
    with pytest.raises(ValueError, match="window=0"):
        plan(window=0)


def test_a_different_lane_count_is_another_order():
    """The lane count is part of the plan (like MosaicML's canonical node count): the
    same lanes give the same batches at any world size; other lanes, other batches."""
    a, b = plan(lanes=8), plan(lanes=6)
    assert a.batch(0) != b.batch(0)
    assert list(itertools.chain(*(a.batch(s) for s in range(a.steps)))) != list(
        itertools.chain(*(b.batch(s) for s in range(b.steps)))
    )


def _groups(p: EpochPlan, reads):
    """Decoded row groups as the reader delivers them: whole, in the read plan's order,
    sample_id = a number of (file, group, row)."""
    import numpy as np

    for f, g in reads:
        n = p.layout.rows[f][g]
        ids = np.array([f * 1_000_000 + g * 1_000 + r for r in range(n)], np.int64)
        yield f, g, {"sample_id": ids, "x": ids[:, None].astype(np.float32) * [1.0, -1.0]}


@pytest.mark.parametrize("world,from_step", [(1, 0), (3, 0), (3, 6), (8, 14)])
def test_a_rank_assembles_its_slices_from_the_row_groups_it_reads(world, from_step):
    from elastic.data.assemble import SliceAssembler

    p = plan(lanes=8, window=40)
    for rank in range(world):
        asm = SliceAssembler(p, rank, world, from_step)
        got = list(asm.steps(_groups(p, p.reads(rank, world, from_step))))
        assert [s for s, _ in got] == list(range(from_step, p.steps))
        for step, batch in got:
            want = [f * 1_000_000 + g * 1_000 + r for f, g, r in p.slice(step, rank, world)]
            assert (batch["sample_id"].tolist() if batch else []) == want, (rank, step)
            if batch:
                assert (batch["x"][:, 0] == batch["sample_id"]).all()
                assert (batch["x"][:, 1] == -batch["sample_id"]).all()
        assert asm.held_groups == 0  # every group dropped once trained


@pytest.mark.parametrize("shares", [(1, 3), (5, 1, 2), (0, 1), (2, 2, 2), (9_000, 1_000)])
def test_a_weighted_split_trains_the_same_rows_in_proportion_to_the_shares(shares):
    """Rebalancing (stragglers.policy=rebalance) moves rows between ranks, never out of
    the step: the slices in rank order are the global batch, each rank's as large as
    its share of it (within a row)."""
    from elastic.data.assemble import SliceAssembler
    from elastic.data.order import slice_sizes

    p, world = plan(lanes=8, window=40), len(shares)
    for step in range(p.steps):
        expected = p.batch(step)
        slices = [p.slice(step, r, shares) for r in range(world)]
        assert [row for sl in slices for row in sl] == expected, (step, shares)
        for r, sl in enumerate(slices):
            assert abs(len(sl) - len(expected) * shares[r] / sum(shares)) < 1
        assert [len(sl) for sl in slices] == slice_sizes(len(expected), shares)
    if len(set(shares)) == 1:  # equal shares are the plain world size
        assert all(
            p.slice(s, r, shares) == p.slice(s, r, world)
            for s in range(p.steps)
            for r in range(world)
        )
    for rank in range(world):  # and a rank assembles them from what it reads (a resume)
        asm = SliceAssembler(p, rank, shares, 4)
        got = list(asm.steps(_groups(p, p.reads(rank, shares, 4))))
        for step, batch in got:
            want = [f * 1_000_000 + g * 1_000 + r for f, g, r in p.slice(step, rank, shares)]
            assert (batch["sample_id"].tolist() if batch else []) == want
        assert asm.held_groups == 0


@pytest.mark.parametrize(
    "world,from_step,block", [(1, 0, 1024), (3, 5, 4), (8, 2, 3), ((1, 3), 4, 2), (2, 14, 1)]
)
def test_slices_computed_a_block_of_steps_at_a_time_are_each_steps_slice(world, from_step, block):
    p = plan(lanes=8, window=40)
    for rank in range(world if isinstance(world, int) else len(world)):
        got = [(s, pos.tolist()) for s, pos in p.slices(rank, world, from_step, block)]
        want = [(s, p.slice_positions(s, rank, world).tolist()) for s in range(from_step, p.steps)]
        assert got == want, (rank, world)


def test_blocks_that_do_not_match_the_plan_are_refused():
    from elastic.data.assemble import SliceAssembler

    p = plan(lanes=8)
    reads = p.reads(0, 1)
    with pytest.raises(ValueError, match="the data ended before row group"):
        list(SliceAssembler(p, 0, 1).steps(_groups(p, reads[:-1])))
    doubled = list(_groups(p, reads[:1])) * 2
    with pytest.raises(ValueError, match="read twice"):
        list(SliceAssembler(p, 0, 1).steps(iter(doubled)))
    f, g, cols = next(_groups(p, reads[:1]))
    short = [(f, g, {k: v[:-1] for k, v in cols.items()})]
    with pytest.raises(ValueError, match="rows read"):
        list(SliceAssembler(p, 0, 1).steps(iter(short)))


@pytest.mark.parametrize("from_step,cache", [(0, False), (3, True)])
def test_ray_data_reads_a_ranks_row_groups_into_its_slices(
    tmp_path, ray_session, monkeypatch, from_step, cache
):
    """The real read path: each rank's row groups of real Parquet shards through Ray Data
    (read tasks of consecutive groups, decoded by the format's decoder, read ahead in the
    reader's thread, two epochs to an execution: three epochs cross a chain's end), kept
    after the first read where the split is cached, assembled into its slices: the
    sample ids and inputs the plan names, read back independently with pyarrow."""
    import numpy as np
    import pyarrow.parquet as pq

    from elastic.config.schema import DataConfig
    from elastic.data import reader as reader_module
    from elastic.data.reader import PlannedReader, epoch_plan
    from elastic.data.shards import check_dataset
    from elastic.datasets.synthetic import generate

    monkeypatch.setattr(reader_module, "CHAIN_EPOCHS", 2)
    generate(str(tmp_path / "train"), None, 700, 0, 4, 8, 2, seed=5)
    for path in (tmp_path / "train").glob("*.parquet"):
        pq.write_table(pq.read_table(path), path, row_group_size=60)
    cfg = DataConfig(
        path=str(tmp_path / "train"), global_batch_size=32, lanes=4, shuffle_window_rows=50, seed=1
    )
    split = check_dataset(cfg)["train"]
    layout = Layout(split.row_groups)
    assert layout == Layout.of_files(split.files)
    tables = [pq.ParquetFile(f) for f in split.files]

    def truth(f: int, g: int, r: int) -> tuple[int, list[float]]:
        row = tables[f].read_row_group(g).slice(r, 1).to_pylist()[0]
        return row["sample_id"], row["x"]

    for rank in range(2):
        reader = PlannedReader(
            cfg,
            split.files,
            layout,
            rank,
            2,
            first_epoch=2,
            first_step=from_step,
            epochs=3,
            cache=cache,
        )
        for epoch, first in ((2, from_step), (3, 0), (4, 0)):
            p = epoch_plan(cfg, layout, epoch)
            got = list(reader.epoch(epoch, first))
            assert len(got) == p.steps - first
            for step, batch in enumerate(got, start=first):
                want = [truth(*row) for row in p.slice(step, rank, 2)]
                assert batch.sample_id.tolist() == [i for i, _ in want], (rank, epoch, step)
                np.testing.assert_array_equal(batch.x, np.array([x for _, x in want], np.float32))
                assert batch.global_rows == len(p.batch(step))
        reader.close()


def test_a_group_read_twice_in_a_row_comes_as_two_reads(tmp_path, ray_session):
    """One Ray Data execution reads several epochs: a row group read at one epoch's end
    and again at the next one's start, in one block, comes out as two whole reads (not
    as one of twice its rows, which the reader would take for a changed shard)."""
    import pyarrow.parquet as pq

    from elastic.config.schema import DataConfig
    from elastic.data.pipeline import RayStream, planned_dataset
    from elastic.data.shards import check_dataset
    from elastic.datasets.synthetic import generate

    generate(str(tmp_path / "train"), None, 200, 0, 1, 8, 2, seed=5)
    (path,) = (tmp_path / "train").glob("*.parquet")
    pq.write_table(pq.read_table(path), path, row_group_size=60)
    cfg = DataConfig(path=str(tmp_path / "train"), global_batch_size=8, lanes=1)
    files = check_dataset(cfg)["train"].files
    rows = Layout.of_files(files).rows[0]
    reads = [(0, 0), (0, 0), (0, 1), (0, 2), (0, 2)]
    stream = RayStream(
        planned_dataset(cfg, files, reads).iter_batches(batch_size=None, batch_format="numpy")
    )
    got = [(tag, len(columns["sample_id"])) for tag, columns in stream.pieces()]
    stream.close()
    assert got == [((f, g), rows[g]) for f, g in reads]
