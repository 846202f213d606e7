"""Elastic training on real multi-raylet Ray clusters, with real kills: nodes die and join,
worker processes are SIGKILLed mid-step and mid-checkpoint, nodes are drained, the driver
gets SIGTERM. Each run is the real command line; what it must show is in its files."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import (
    FAST_POLL,
    assert_every_epoch_once,
    cluster_data,
    cluster_overrides,
    planned_digests,
)

from elastic_harness.localcluster import Run, saving_pids

pytestmark = pytest.mark.slow  # the fast tier: pytest -m 'not slow'

ROWS, BATCH, EPOCHS = 2048, 64, 6


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return cluster_data(tmp_path_factory.mktemp("elastic-data"), ROWS, seed=1)


def _overrides(data, *extra: str) -> list[str]:
    return cluster_overrides(data, 1024, BATCH, EPOCHS, FAST_POLL, *extra)


def _losses(run: Run) -> list[tuple[int, float]]:
    """(step, loss) in the order logged: a step trained again after a restart repeats."""
    return [(r["step"], r["train/loss"]) for r in run.records() if "train/loss" in r]


def _assert_loss_continues(run: Run, resume_step: int) -> None:
    """The first step after a resume from ``resume_step`` has about the loss that step had
    the first time (a resume that lost model or optimizer state starts over instead)."""
    losses = _losses(run)
    first = next(loss for step, loss in losses if step == resume_step + 1)
    again = [loss for step, loss in losses if step == resume_step + 1][-1]
    initial = losses[0][1]
    assert abs(again - first) < 0.5 * (initial - first), (resume_step, first, again, initial)


def test_a_worker_killed_mid_save_a_node_lost_and_one_joined_train_the_same_batches(
    cluster, data, tmp_path
):
    """2 workers on 2 nodes; a worker process is SIGKILLed while it writes a checkpoint
    -> the group restarts at 2 from the checkpoint before (the half-written one is never
    resumed from); a node is killed (mid-step) -> the run goes on with 1; a node joins ->
    it grows back to 2. Every step trains the rows the plan gives it (each step's ids
    digest equals the plan's, computed apart from the run: the same global batches as an
    undisturbed run), every sample of every epoch once, the loss continues; one W&B run
    (offline) tells the story."""
    c = cluster(2)
    overrides = _overrides(
        data, "scaling.min_workers=1", "scaling.max_workers=2", "scaling.cpus_per_worker=3"
    )
    overrides[overrides.index("logger=none")] = "logger=wandb"
    run = Run(tmp_path, "shrink-grow", overrides, c.address)
    run.wait_for("a registered checkpoint", lambda: run.registered_steps())

    def saving_worker():
        workers = set(c.train_worker_pids())
        return next((pid for pid in saving_pids(run.dir) if pid in workers), None)

    pid = run.wait_for("a checkpoint save", saving_worker, poll=0.002)
    registered = max(run.registered_steps())
    killed = time.time()
    os.kill(pid, signal.SIGKILL)
    killed_save = run.last_step()  # rank 0 logs a step before it checkpoints it
    run.wait_step(killed, restarted=True)
    run.shrink_then_grow(lambda: c.remove_node(c.nodes[0]), c.add_node, 1, 2)
    assert run.finish() == 0, run.output()[-5000:]
    s = run.summary()
    assert s["status"] == "finished"
    assert s["world_sizes"] == [2, 1, 2]
    restarts = [e for e in s["events"] if e["event"] == "restart"]
    assert [(e["cause"], e["world_size"]) for e in restarts] == [
        ("failure", 2),
        ("shrink", 1),
        ("grow", 2),
    ]
    resumes = [e for e in s["events"] if e["event"] == "resume"]
    # the worker killed mid-save: from the newest checkpoint Ray had registered (complete
    # on every rank), never the save killed halfway
    assert registered <= resumes[0]["step"] < killed_save and resumes[0]["step"] % 5 == 0
    assert [(e["from_world_size"], e["world_size"], e["resharded"]) for e in resumes] == [
        (2, 2, False),
        (2, 1, True),
        (1, 2, True),
    ]
    assert_every_epoch_once(s, data / "train", EPOCHS, ROWS)
    steps = EPOCHS * ROWS // BATCH
    trained = {r["step"]: r["train/batch_digest"] for r in run.records() if "train/loss" in r}
    lanes = 8 * 2  # data.lanes=0: 8 a worker at scaling.max_workers=2
    planned = planned_digests(data / "train", {"global_batch_size": BATCH, "lanes": lanes}, steps)
    assert trained == planned
    _assert_loss_continues(run, resumes[1]["step"])
    _assert_one_wandb_run(s, starts=len([e for e in s["events"] if e["event"] == "world_size"]))


def _alerts(run_dir: str) -> list:
    import glob

    from wandb_records import records

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    return [r.alert for r in records(path) if r.WhichOneof("record_type") == "alert"]


def _assert_one_wandb_run(summary: dict, starts: int) -> None:
    """Each worker-group start's rank 0 (and no other rank) resumed the same W&B run; its
    offline files, read with wandb's own record classes, hold the world-size changes,
    the restart and resume markers and every phase of the time breakdown."""
    import glob

    from wandb_records import history

    runs = sorted(glob.glob(os.path.join(os.path.dirname(summary["wandb_dir"]), "offline-run-*")))
    assert len(runs) == starts, runs  # one init per start: rank 0 only
    assert len({r.rsplit("-", 1)[1] for r in runs}) == 1, runs  # one run id
    rows = [row for r in runs for row in history(r)]
    sizes = [row["train/world_size"] for row in rows if "train/world_size" in row]
    assert [w for i, w in enumerate(sizes) if i == 0 or sizes[i - 1] != w] == [2, 1, 2]
    assert sum(1 for row in rows if "event/restart" in row) == 3
    assert sum(1 for row in rows if "event/resume" in row) == 3
    # restart alerts; a straggler alert may come too where the machine is busy (a rank
    # 1.3x slower for a window: stragglers.policy=report, the default)
    alerts = [a for r in runs for a in _alerts(r) if not a.title.endswith(": straggler")]
    assert [a.title for a in alerts] == ["shrink-grow: restart"] * 3
    causes = ["cause=failure", "cause=shrink", "cause=grow"]
    assert all(c in a.text for c, a in zip(causes, alerts, strict=True))
    phases = {"data_wait", "forward", "backward", "optimizer", "checkpoint"}
    logged = [row for row in rows if "train/loss" in row]
    assert all({f"time/{p}_share" for p in phases} <= set(row) for row in logged)
    assert all(row["train/samples_per_s"] > 0 for row in logged[1:])


def test_drained_nodes_checkpoint_at_once_then_shrink(cluster, data, tmp_path):
    """A node drain (Ray's preemption notice) makes the run checkpoint right away; when
    the node then goes, the run resumes from that checkpoint: no step is lost. Twice:
    the second drain lands in the worker group that the first one's restart started
    (one drain watcher serves every group of the run). Then a batch system's warning
    signal, SIGTERM to the driver: it checkpoints now and exits 75; the same command
    resumes from that checkpoint (not from an earlier one) and finishes."""
    c = cluster(3)
    overrides = _overrides(
        data,
        "scaling.min_workers=1",
        "scaling.max_workers=3",
        "scaling.cpus_per_worker=3",
        "checkpoint.every_steps=1000",
    )
    run = Run(tmp_path, "drain", overrides, c.address)
    drains: list[dict] = []
    for after in (10, 5):  # steps into the group before its node is drained
        group = len(drains) + 1  # the first drain's group goes on until Ray restarts it
        until = (drains[-1]["step"] if drains else 0) + after
        reached = lambda g=group, u=until: run.last_step_of_group(g) >= u  # noqa: E731
        run.wait_for(f"step {until} in worker group {group}", reached)
        # the drain watcher lives on the driver's node (the head here), which no drain
        # takes: on a worker node it went with the first victim, and the run never
        # heard of the second drain
        assert c.actor_pids("RunDrainWatcher") == []
        victim = c.nodes[0]
        c.drain(victim, deadline_s=60)
        drain = run.wait_for("the drain event", lambda: run.events("node_drain")[len(drains) :])
        drains.append(drain[0])
        run.wait_for("the drain checkpoint", lambda: drains[-1]["step"] in run.registered_steps())
        c.remove_node(victim)  # the machine goes, as the drain announced
    until = drains[-1]["step"] + 5
    run.wait_for(f"step {until} in worker group 3", lambda: run.last_step_of_group(3) >= until)
    run.signal(signal.SIGTERM)
    assert run.finish() == 75, run.output()[-5000:]
    first = run.summary()
    assert first["status"] == "preempted"
    stopped_at = first["steps"]
    assert stopped_at >= until
    assert os.path.basename(first["checkpoint"]) == f"step={stopped_at:09d}"
    assert [e["reason"] for e in first["events"] if e["event"] == "preempted"] == ["SIGTERM"]

    rerun = Run(tmp_path, "drain", overrides, c.address)
    assert rerun.finish() == 0, rerun.output()[-5000:]
    s = rerun.summary()
    assert s["status"] == "finished"
    assert s["world_sizes"] == [3, 2, 1]
    resumes = [e["step"] for e in s["events"] if e["event"] == "resume"]
    assert resumes == [*(d["step"] for d in drains), stopped_at]
    assert_every_epoch_once(s, data / "train", EPOCHS, ROWS)


def test_half_written_checkpoints_past_the_resume_point_are_removed(tmp_path):
    """A group that died while saving step 10 leaves step=000000010 behind; the group that
    resumes from step 5 removes it before it saves step 10 itself (Ray would merge the
    new save into the stale folder's files)."""
    from elastic.train.checkpoint import remove_unregistered, step_dir_name

    for step in (5, 10, 15):
        (tmp_path / step_dir_name(step)).mkdir()
        (tmp_path / step_dir_name(step) / "rng-rank1.pt").write_bytes(b"x")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    removed = remove_unregistered(str(tmp_path), resumed_step=5)
    assert sorted(removed) == [step_dir_name(10), step_dir_name(15)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", step_dir_name(5)]
