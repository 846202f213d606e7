"""Stragglers: every rank's own compute time per step, and the slow one found.

The end-to-end test slows one Ray Train worker for real (no injected sleep,
``localcluster.Slowdown``): its process and every thread of it is pinned to one core
(``sched_setaffinity``) beside three busy-looping processes pinned to the same core, so
it gets about a quarter of that core; the other worker has the other core, shared only
with Ray's own processes (whose work makes its compute time vary from interval to
interval: hence a quarter, not a half, for a margin in the means)."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
from conftest import FAST_POLL

from elastic.config.schema import StragglersConfig
from elastic.observe.report import write_report
from elastic.train.stragglers import FIGURES, StragglerWatch, eviction
from elastic_harness.localcluster import Run, Slowdown, train_workers_under


def _table(compute: list[float], steps: int = 4, rows: int = 32, fixed=None) -> np.ndarray:
    """One interval's sums per rank, in FIGURES' columns (``fixed``: the optimizer's
    part of each rank's compute time per step)."""
    out = np.zeros((len(compute), len(FIGURES)))
    out[:, FIGURES.index("optimizer_s")] = np.array(fixed or [0.0] * len(compute)) * steps
    out[:, FIGURES.index("compute_s")] = np.array(compute) * steps
    out[:, FIGURES.index("rows")] = rows * steps
    out[:, FIGURES.index("steps")] = steps
    return out


def test_a_rank_slow_for_a_whole_window_is_found_once_and_again_after_recovering():
    where = [{"node": f"n{r}", "pid": 100 + r} for r in range(3)]
    watch = StragglerWatch(StragglersConfig(threshold=1.3, window=3), where)
    found = []
    # rank 2 at 1.5x the others for 2 intervals (too short), fast once, then 4 intervals
    # slow (found at the 3rd), fast, slow for 3 again (found again)
    pattern = [1.5, 1.5, 1.0, 1.5, 1.5, 1.5, 1.5, 1.0, 1.5, 1.5, 1.5]
    for i, slow in enumerate(pattern):
        figures, events = watch.observe(_table([0.010, 0.011, 0.0105 * slow]))
        found += [(i, e["rank"], e["node"], e["pid"], e["ratio"]) for e in events]
        if i == 0:
            assert figures["worker_compute_s/rank0"] == pytest.approx(0.010)
            assert figures["worker_compute_samples_per_s/rank1"] == pytest.approx(32 / 0.011)
            # slowest / median of all three: 0.01575 / 0.011
            assert figures["train/straggler_ratio"] == pytest.approx(0.01575 / 0.011)
    # the ratio is against the median of the *other* ranks: 0.01575 / 0.0105
    assert found == [(5, 2, "n2", 102, 1.5), (10, 2, "n2", 102, 1.5)]
    workers, slowest = watch.summary()
    assert [w["node"] for w in workers] == ["n0", "n1", "n2"]
    assert workers[0]["compute_s"] == pytest.approx(0.010)
    mean2 = 0.0105 * np.mean(pattern)
    assert workers[2]["compute_s"] == pytest.approx(mean2)
    assert slowest == pytest.approx(mean2 / 0.011)


def test_the_first_interval_of_a_group_is_logged_but_judges_nobody():
    """A worker group's first interval holds its first step (allocations, lazy
    initialisation; one rank may take far longer than another): its figures are logged,
    but it starts no streak and is kept out of the per-rank means."""
    watch = StragglerWatch(StragglersConfig(threshold=1.3, window=1), [{}, {}])
    figures, events = watch.observe(_table([1.5, 0.5]), warmup=True)
    assert figures["worker_compute_s/rank0"] == pytest.approx(1.5) and events == []
    _, events = watch.observe(_table([0.010, 0.011]))
    assert events == []
    workers, slowest = watch.summary()
    assert [w["compute_s"] for w in workers] == pytest.approx([0.010, 0.011])
    assert [w["steps"] for w in workers] == [4, 4]
    assert slowest == pytest.approx(0.011 / 0.0105)


def test_two_workers_compare_each_with_the_other():
    watch = StragglerWatch(StragglersConfig(threshold=1.3, window=1), [{}, {}])
    _, events = watch.observe(_table([0.010, 0.016]))  # 1.6x the other: 1.23x their mean
    assert [e["rank"] for e in events] == [1]
    _, events = watch.observe(_table([0.010]))  # one worker: nobody to compare with
    assert events == []


def test_evict_takes_the_slowest_node_while_min_workers_and_max_evictions_allow():
    where = [{"node_id": "A"}, {"node_id": "A"}, {"node_id": "B"}]  # ranks 0, 1 share node A
    found = [{"rank": 0, "node": "a", "ratio": 1.4}, {"rank": 2, "node": "b", "ratio": 1.8}]
    cfg = StragglersConfig(policy="evict", cooldown_s=30, max_evictions=2)
    request, why = eviction(found, where, 1, 0, cfg)
    assert why is None
    assert (request["node_id"], request["workers"], request["cooldown_s"]) == ("B", 1, 30)
    # node A takes both its ranks: 1 of 3 workers left, under min_workers=2
    request, why = eviction(found[:1], where, 2, 0, cfg)
    assert request is None and "leave 1 of 3 workers, under scaling.min_workers=2" in why
    request, why = eviction(found, where, 1, 2, cfg)
    assert request is None and why == "stragglers.max_evictions=2 reached"


def _run_split(watch, cost, shares, batch=64, intervals=3, steps=4, max_rows=None, fixed=0.0):
    """Intervals of a simulated run in which rank r's compute time per step is
    ``cost(r, rows)`` (``fixed`` of it the optimizer's), under ``shares``; then the
    watch's rebalance()."""
    from elastic.data.order import EpochPlan, Layout

    plan = EpochPlan(Layout(((4096,),)), 0, 0, batch, 8)
    world = shares if isinstance(shares, int) else len(shares)
    rows = [hi - lo for lo, hi in (plan.bounds(0, r, shares) for r in range(world))]
    for _ in range(intervals):
        table = _table([cost(r, n) for r, n in enumerate(rows)], steps, fixed=[fixed] * len(rows))
        table[:, FIGURES.index("rows")] = np.array(rows) * steps
        watch.observe(table)
    return rows, watch.rebalance(batch, max_rows)


def test_rebalance_moves_rows_to_the_faster_rank_until_their_times_even_out():
    cfg = StragglersConfig(window=3, policy="rebalance")
    # rank 1 twice as slow per row: times even out at x = 2 (64 - x), x = 42.7
    watch = StragglerWatch(cfg, [{}, {}])
    per_row = (0.001, 0.002)
    _, _ = _run_split(watch, lambda r, n: n * per_row[r], 2, intervals=2)
    assert watch.rebalance(64) is None  # not a whole window yet
    rows, split = _run_split(watch, lambda r, n: n * per_row[r], 2, intervals=1)
    assert rows == [32, 32] and split is not None
    # times in proportion to the rows: there in one move, and no more moves
    rows, again = _run_split(watch, lambda r, n: n * per_row[r], split)
    assert abs(rows[0] - 42.67) < 1 and again is None
    # fixed costs in the forward and backward passes too (not only the optimizer's):
    # the first move (a + b * rows not fitted yet) falls short of the even split
    # (x = 49.3: 0.010 + 0.001 x = 0.030 + 0.002 (64 - x)), never past it; the second,
    # fitted from the two windows, is there, and the split does not run away
    watch = StragglerWatch(cfg, [{}, {}])
    cost = lambda r, n: (0.010, 0.030)[r] + n * per_row[r]  # noqa: E731
    rows, split = _run_split(watch, cost, 2, fixed=0.002)
    rows, split = _run_split(watch, cost, split, fixed=0.002)
    assert 40 < rows[0] < 49.3 and split is not None, rows
    rows, split = _run_split(watch, cost, split, fixed=0.002)
    assert abs(rows[0] - 49.33) < 1 and split is None, rows
    for _ in range(2):
        rows, new = _run_split(watch, cost, tuple(rows), fixed=0.002)
        assert new is None and abs(rows[0] - 49.33) < 1, rows
    # noise: a window whose intervals swing more than the ranks are apart leaves the
    # split as it is; the next window's intervals add to the evidence (the split is
    # judged on both), and the move is then fitted against the split before
    watch = StragglerWatch(cfg, [{}, {}])
    _, split = _run_split(watch, cost, 2, fixed=0.002)
    swing = iter([1.4, 0.6, 1.4, 0.6])  # a window of 4 intervals: their mean is 1
    factor = {"now": 1.0}

    def noisy(r, n):
        if r == 0:  # one value per interval: rank 0 is asked first
            factor["now"] = next(swing)
        return cost(r, n) * (factor["now"] if r == 0 else 1.0)

    rows, none = _run_split(watch, noisy, split, intervals=4, fixed=0.002)
    assert none is None and rows[0] < 48, rows
    rows, again = _run_split(watch, cost, split, intervals=4, fixed=0.002)
    assert again is not None
    rows, last = _run_split(watch, cost, again, fixed=0.002)
    assert abs(rows[0] - 49.33) < 1 and last is None, rows
    # never a slice over max_rows (data.micro_batch_size x accumulation): the rest to
    # the other rank
    watch = StragglerWatch(cfg, [{}, {}])
    _, capped = _run_split(watch, lambda r, n: n * (0.001, 0.010)[r], 2, max_rows=40)
    rows, _ = _run_split(watch, lambda r, n: n * (0.001, 0.010)[r], capped)
    assert rows == [40, 24]


def _slowed_run(tmp_path, data, name: str, *extra: str) -> tuple[Run, int, int]:
    """A 2-worker run with its first worker slowed for real (module docstring) from
    its start; returns the run and the slowed and the fast worker's pids."""
    overrides = [
        "+experiment=smoke",
        f"data.path={data}/train",
        f"data.val_path={data}/val",
        "model.input_dim=32",
        "model.output_dim=4",
        "data.global_batch_size=64",
        "cluster.num_cpus=4",  # logical CPUs: 2 workers and Ray Data's read tasks
        "scaling.workers=2",
        "model.hidden_dims=[1024,1024]",
        "trainer.max_steps=120",
        "trainer.log_every_steps=4",
        "checkpoint.every_steps=0",
        "stragglers.window=3",
        "logger=none",
        FAST_POLL,
        *extra,
    ]
    run = Run(tmp_path, name, overrides)
    slowdown = Slowdown(busy=3)
    try:
        workers = run.wait_for(
            "2 training workers", lambda: len(w := train_workers_under(run.proc.pid)) == 2 and w
        )
        slow_pid, fast_pid = workers
        # from the first step on (slowed from its start, the worker's imports and
        # DeepSpeed's set-up took 4x as long: time the suite pays, testing nothing)
        run.wait_for("the first step", lambda: run.last_step() >= 1)
        slowdown.apply([slow_pid], [fast_pid])
        assert run.finish(timeout=300) == 0, run.output()
    finally:
        slowdown.stop()
        if run.proc.poll() is None:
            run.proc.kill()
    return run, slow_pid, fast_pid


def _losses(run: Run) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in run.records() if "train/loss" in r}


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to slow one")
def test_a_slowed_worker_is_found_and_rebalancing_moves_rows_off_it_not_the_losses(
    small_data, tmp_path
):
    """report: the slowed rank is found, the other is not. rebalance: rows move to the
    fast rank, and the loss of every step is the report run's (the same global batches,
    the same gradient: only who trains which rows changes)."""
    run, slow_pid, fast_pid = _slowed_run(tmp_path, small_data, "report")
    summary = run.summary()
    stragglers = [e for e in summary["events"] if e["event"] == "straggler"]
    assert stragglers, run.output()
    assert {e["pid"] for e in stragglers} == {slow_pid}, stragglers
    assert all(e["ratio"] > 1.3 for e in stragglers)
    assert "[elastic] straggler at step" in run.output()
    by_pid = {w["pid"]: w for w in summary["workers"]}
    assert set(by_pid) == {slow_pid, fast_pid}
    # the slowed rank's own work took longer; the fast one waited for it in the collectives
    assert by_pid[slow_pid]["compute_s"] > 1.3 * by_pid[fast_pid]["compute_s"]
    assert by_pid[fast_pid]["comm_s"] > by_pid[slow_pid]["comm_s"]
    assert summary["slowest_median_ratio"] > 1.0
    assert summary["time_breakdown"]["comm"] > 0
    # every log line holds each rank's figures
    logged = [r for r in run.records() if "train/loss" in r]
    assert all(f"worker_compute_s/rank{r}" in rec for rec in logged for r in (0, 1))
    report = write_report([str(run.dir)], str(tmp_path / "report"))
    assert (tmp_path / "report" / "worker_times.png").stat().st_size > 0
    rows = json.loads((tmp_path / "report" / "report.json").read_text())["workers"]
    slow_rank = by_pid[slow_pid]["rank"]
    assert {e["rank"] for e in rows[0]["stragglers"]} == {slow_rank}
    assert "## Workers" in report.read_text()

    balanced, slow2, fast2 = _slowed_run(
        tmp_path, small_data, "rebalance", "stragglers.policy=rebalance"
    )
    summary2 = balanced.summary()
    ranks = {w["pid"]: w["rank"] for w in summary2["workers"]}
    moves = balanced.events("rebalance")
    assert moves, balanced.output()
    last = moves[-1]["rows"]
    assert sum(last) == 64 and last[ranks[fast2]] > last[ranks[slow2]], moves
    assert "[elastic] rebalance at step" in balanced.output()
    # the compute times came closer: lock-step waits less for the slowed rank
    w2 = {w["pid"]: w for w in summary2["workers"]}
    before = by_pid[slow_pid]["compute_s"] / by_pid[fast_pid]["compute_s"]
    after = w2[slow2]["compute_s"] / w2[fast2]["compute_s"]
    assert after < before, (before, after)
    # the same losses, step by step: fp32 summation order is all that differs
    a, b = _losses(run), _losses(balanced)
    assert sorted(a) == sorted(b)
    worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in a)
    assert worst < 1e-4, worst


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to slow one")
def test_evict_drops_the_slow_node_for_its_cooldown_then_takes_it_back(tmp_path):
    """A real 3-raylet cluster (a head and two worker nodes, one training worker each);
    the worker on the second node is slowed for real. ``stragglers.policy=evict``: the
    run checkpoints, the slow node is kept out and the group restarts at 1 from that
    checkpoint; although the node is free, the run does not grow back onto it before
    ``stragglers.cooldown_s``; after it, the node is taken back (world size 2 again).
    Every step trains the planned rows, every sample once."""
    from conftest import cluster_data, cluster_overrides, planned_digests

    from elastic_harness.localcluster import RayCluster

    cooldown = 20
    data = cluster_data(tmp_path / "data", 2048, seed=3)
    overrides = cluster_overrides(
        data, 1024, 64, 200, FAST_POLL,
        "scaling.min_workers=1", "scaling.max_workers=2", "scaling.cpus_per_worker=3",
        "checkpoint.every_steps=1000", "trainer.log_every_steps=4",
        "stragglers.policy=evict", "stragglers.window=3",
        f"stragglers.cooldown_s={cooldown}",
    )  # fmt: skip
    c = RayCluster(2)
    slowdown = Slowdown(busy=3)
    try:
        run = Run(tmp_path, "evict", overrides, c.address)
        pids = run.wait_for(
            "2 training workers", lambda: len(p := c.train_worker_pids()) == 2 and p
        )
        slow_pid = next(p for p in pids if c.node_of_pid(p) is c.nodes[1])
        fast_pid = next(p for p in pids if p != slow_pid)
        slow_node = c.nodes[1].node_id
        run.wait_for("the first step", lambda: run.last_step() >= 1)
        slowdown.apply([slow_pid], [fast_pid])
        evicted = run.wait_for("the eviction", lambda: run.events("evict"), timeout=240)[0]
        slowdown.stop()  # the node is fine again: only the cooldown keeps it out
        grown = run.wait_for(
            "the group grown back",
            lambda: [e for e in run.events("restart") if e["cause"] == "grow"],
            timeout=240,
        )[0]
        run.wait_step(grown["time"], world=2)
        run.signal(signal.SIGTERM)
        assert run.finish() == 75, run.output()[-5000:]
    finally:
        slowdown.stop()
        if run.proc.poll() is None:
            run.proc.kill()
        c.shutdown()

    s = run.summary()
    assert evicted["node_id"] == slow_node and evicted["workers"] == 1, evicted
    stragglers = [e for e in s["events"] if e["event"] == "straggler"]
    assert stragglers and stragglers[0]["node_id"] == slow_node, stragglers
    restarts = [e for e in s["events"] if e["event"] == "restart"]
    assert [(e["cause"], e["world_size"]) for e in restarts] == [("evict", 1), ("grow", 2)]
    assert s["world_sizes"] == [2, 1, 2]
    # the smaller group resumed from the eviction's checkpoint: no step lost
    resumes = [e["step"] for e in s["events"] if e["event"] == "resume"]
    assert resumes[0] == evicted["step"], (resumes, evicted)
    # kept out for the cooldown, though free; taken back after it
    held = [e for e in s["events"] if e["event"] == "cordon"]
    released = [e for e in s["events"] if e["event"] == "cordon_released"]
    assert [e["node_id"] for e in held] == [e["node_id"] for e in released] == [slow_node]
    assert released[0]["time"] - held[0]["time"] >= cooldown
    assert grown["time"] - evicted["time"] >= cooldown
    assert slow_node in {w["node_id"] for w in s["workers"]}  # the last group's ranks
    assert s["samples_exactly_once"] is True
    # every logged step, by any group (the world-1 group's steps past the checkpoint the
    # grown group resumed from were trained again), trained the plan's rows
    trained = {r["step"]: r["train/batch_digest"] for r in run.records() if "train/loss" in r}
    planned = planned_digests(data / "train", {"global_batch_size": 64, "lanes": 16}, max(trained))
    assert trained == {k: planned[k] for k in trained}
    assert {r["train/world_size"] for r in run.records() if "train/loss" in r} == {1, 2}
