"""recovery: on a local multi-raylet cluster (a head and 2 one-worker nodes), seconds from
a worker SIGKILL / a node kill / a node joining to the first training step after it,
with elastic's recovery defaults and, as the peer, with Ray Train's own defaults; and
the checkpoint share of the smoke run's wall time at the default interval. Then live
recovery (``scaling.live``) on a head and 4 one-worker nodes, 3 workers: a worker
SIGKILL, a node lost with a spare node, a node lost with none; for each the survivors'
stall (their last step before the fault -> their next committed step), the committed
steps lost, the survivors whose process changed, and the newcomer's time to join
(fault -> the quorum it copied the state into). Writes bench-recovery.json."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path

from elastic.train.membership import member_pid
from elastic_bench.common import ELASTIC_MODEL, elastic_data, smoke_config
from elastic_harness.localcluster import RayCluster, Run

HELP = "shrink/grow/worker-kill recovery vs Ray defaults"
SHRINK_TARGET_S = 15.0  # node killed -> first step at 1 worker
GROW_TARGET_S = 20.0  # node added -> first step at 2 workers: resize_interval_s (10) + 10
CHECKPOINT_SHARE_TARGET = 0.02  # checkpoint time / wall time, smoke run, default interval
RAY_DEFAULT_KNOBS = [  # Ray Train 2.60's own values of the knobs elastic tunes
    "scaling.start_timeout_s=60",
    "scaling.health_check_interval_s=2",
    "scaling.worker_health_check_timeout_s=600",
    "scaling.resize_interval_s=60",
    "scaling.node_refresh_s=20",
    "scaling.drain_poll_interval_s=5",
]


LIVE_STALL_TARGET_S = 5.0  # survivors' stall with a live replica
LIVE_STEPS_LOST_TARGET = 1
LIVE_WORKERS = 3
NO_SPARE_WAIT_S = 90.0  # a node lost with no room: how long to watch for a restart


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--no-live", action="store_true", help="skip the live recovery round")


def _fault_figures(run: Run, t: float, survivors: set[int], wait_join: bool) -> dict:
    """After a fault at ``t``: the survivors' stall, committed steps lost, survivors
    restarted; with a replica's place free (``wait_join``) the newcomer's join, else
    (no room for it) the restart from storage that follows (Ray Train sizes the group
    down): the seconds from the fault to its first step, the steps it trains again."""
    out: dict = {"steps_lost": 0}
    broke = run.wait_for(
        "the survivors' next quorum, or a restart",
        lambda: (
            [q for q in run.events("quorum") if q["time"] >= t and q["gone"]]
            or [e for e in run.events("restart") + run.events("refit") if e["time"] >= t]
        ),
    )[0]
    kept = {member_pid(m) for m in broke.get("members", [])}
    if kept:  # live: the last step the old quorum committed -> the next one's first
        step = broke["step"]
        run.wait_for("a step after it", lambda: run.last_step() > step)
        records = [r for r in run.records() if "train/loss" in r]
        last = [r for r in records if r["step"] <= step and r["time"] < broke["time"]][-1]
        nxt = next(r for r in records if r["step"] > step and r["time"] > broke["time"])
        out["stall_s"] = nxt["time"] - last["time"]
    if wait_join:
        joined = run.wait_for(
            "a newcomer",
            lambda: [q for q in run.events("quorum") if q["time"] >= t and q["joined"]],
            timeout=120,
        )
        out["heal_s"] = joined[0]["time"] - t
        out["copy_s"] = joined[0]["seconds"]
        out["copied_mb"] = joined[0]["copied_bytes"] / 2**20
    else:

        def restarted() -> list[dict] | None:
            found = [e for e in run.events("restart") + run.events("refit") if e["time"] >= t]
            return found or ([{}] if time.time() - t > NO_SPARE_WAIT_S else None)

        restart = run.wait_for(
            "a restart, or the survivors training on", restarted, timeout=NO_SPARE_WAIT_S + 60
        )[0]
        out["restarted"] = bool(restart)
        if restart:  # Ray Train (or the driver) restarted the group
            again = run.wait_step(restart["time"])
            resumed = [e for e in run.events("resume") if e["time"] >= restart["time"] - 1]
            trained = [
                r for r in run.records() if "train/loss" in r and r["time"] < restart["time"]
            ]
            out["restart_s"] = again - t
            if resumed:
                out["steps_lost"] = max(0, trained[-1]["step"] - resumed[0]["step"])
            kept = set()  # the restart ended every worker
    out["survivor_restarts"] = len(survivors - kept)
    out["live"] = bool(kept) and out["survivor_restarts"] == 0
    return out


def _live_round(workdir: str) -> dict:
    """Live recovery's faults, in one run on a head and 4 one-worker nodes (3 workers,
    one spare node)."""
    overrides = [
        "+experiment=smoke",
        *ELASTIC_MODEL,
        "trainer.max_steps=0",
        "trainer.max_epochs=1000",
        "scaling.live=true",
        "strategy.zero_stage=0",
        "scaling.min_workers=2",
        f"scaling.max_workers={LIVE_WORKERS}",
        "checkpoint.every_steps=50",
        *elastic_data(workdir),
    ]
    cluster = RayCluster(LIVE_WORKERS + 1)
    run = Run(Path(workdir), f"recovery-live-{time.time_ns()}", overrides, cluster.address)
    out: dict = {}
    try:
        run.wait_for("a checkpoint", lambda: run.registered_steps(), timeout=300)

        def members() -> list[int]:
            quorums = run.events("quorum")
            if quorums:
                return [member_pid(m) for m in quorums[-1]["members"]]
            return sorted(cluster.train_worker_pids())

        now = members()
        t = time.time()
        os.kill(now[-1], signal.SIGKILL)
        out["worker_kill"] = _fault_figures(run, t, set(now[:-1]), wait_join=True)
        now = members()
        t = time.time()
        cluster.remove_node(cluster.node_of_pid(now[-1]))  # the spare takes its place
        out["node_kill_spare"] = _fault_figures(run, t, set(now[:-1]), wait_join=True)
        now = members()
        time.sleep(2)
        t = time.time()
        cluster.remove_node(cluster.node_of_pid(now[-1]))  # no room for a newcomer
        out["node_kill_no_spare"] = _fault_figures(run, t, set(now[:-1]), wait_join=False)
        out["events"] = [
            {k: e.get(k) for k in ("event", "step", "time", "members", "gone", "joined")}
            for e in run.events("quorum") + run.events("restart") + run.events("refit")
        ]
        run.signal(signal.SIGTERM)
        run.finish()
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
        cluster.shutdown()
    print(
        "live: "
        + "; ".join(
            f"{k} " + ", ".join(f"{m} {v:.2f}" for m, v in f.items() if not isinstance(v, bool))
            for k, f in out.items()
            if k != "events"
        ),
        flush=True,
    )
    return out


def _recovery_round(workdir: str, knobs: list[str], label: str) -> dict:
    overrides = [
        "+experiment=smoke",
        *ELASTIC_MODEL,
        "trainer.max_steps=0",
        "trainer.max_epochs=1000",
        *elastic_data(workdir),
        *knobs,
    ]
    cluster = RayCluster(2)
    run = Run(Path(workdir), f"recovery-{label}-{time.time_ns()}", overrides, cluster.address)
    out: dict = {}
    try:
        run.wait_for("a checkpoint", lambda: run.registered_steps())
        t = time.time()
        os.kill(cluster.train_worker_pids()[0], signal.SIGKILL)
        out["worker_kill_s"] = run.wait_step(t, restarted=True) - t

        out.update(
            run.shrink_then_grow(
                lambda: cluster.remove_node(cluster.nodes[0]), cluster.add_node, 1, 2
            )
        )
        run.signal(signal.SIGTERM)  # checkpoint and stop: the benchmark has what it needs
        run.finish()
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
        cluster.shutdown()
    print(f"{label}: " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()), flush=True)
    return out


def _live_summary(live: dict, restart_s: float) -> dict:
    """Each figure's worst over the faults a live replica covered, beside the restart
    path's worker kill of the same run (its seconds to the first step after the kill)."""
    faults = {k: f for k, f in live.items() if k != "events"}
    covered = [f for f in faults.values() if f["live"]]
    worst = {
        k: max(f[k] for f in covered if k in f)
        for k in ("stall_s", "steps_lost", "survivor_restarts", "heal_s")
        if any(k in f for f in covered)
    }
    return {
        **worst,
        "covered": [k for k, f in faults.items() if f["live"]],
        "restart_worker_kill_s": restart_s,
        "stall_ratio_vs_restart": worst["stall_s"] / restart_s if "stall_s" in worst else None,
        "faults": live,
    }


def _checkpoint_share(workdir: str) -> dict:
    """Checkpoint share of wall time of the smoke run at the default interval."""
    run = Run(Path(workdir), f"ckpt-{time.time_ns()}", ["+experiment=smoke", "logger=none"])
    if run.finish() != 0:
        raise RuntimeError("the smoke run failed:\n" + run.output()[-5000:])
    summary = run.summary()
    return {
        "checkpoint_overhead": summary["time_breakdown"]["checkpoint"],
        "checkpoint_every_steps": smoke_config([]).checkpoint.every_steps,
        "steps": summary["steps"],
    }


def measure(args: argparse.Namespace) -> dict:
    workdir = tempfile.mkdtemp(prefix="elastic-bench-")
    rounds = []
    try:
        for r in range(args.rounds):
            order = [("elastic", []), ("ray_defaults", RAY_DEFAULT_KNOBS)]
            if r % 2:
                order.reverse()
            rounds.append({label: _recovery_round(workdir, knobs, label) for label, knobs in order})
        live = None if args.no_live else _live_round(workdir)
        ckpt = _checkpoint_share(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    keys = ("shrink_s", "grow_s", "worker_kill_s")
    med = {
        who: {k: statistics.median(r[who][k] for r in rounds) for k in keys}
        for who in ("elastic", "ray_defaults")
    }
    report = {
        **{k: med["elastic"][k] for k in keys},
        **{f"{k}_ray_defaults": med["ray_defaults"][k] for k in keys},
        **{f"{k}_ratio": med["elastic"][k] / med["ray_defaults"][k] for k in keys},
        **ckpt,
        **({"live": _live_summary(live, med["elastic"]["worker_kill_s"])} if live else {}),
        "targets": {
            "live_stall_s": LIVE_STALL_TARGET_S,
            "live_steps_lost": LIVE_STEPS_LOST_TARGET,
            "live_survivor_restarts": 0,
            "shrink_s": SHRINK_TARGET_S,
            "grow_s": f"resize_interval_s + 10 = {GROW_TARGET_S}",
            "checkpoint_overhead": CHECKPOINT_SHARE_TARGET,
        },
        "rounds": rounds,
        "setup": {
            "cluster": "ray.cluster_utils.Cluster: head (2 CPUs) + 2 worker nodes (3 CPUs, "
            "one training worker each); GCS health check 1 s x 3",
            "model": ELASTIC_MODEL,
            "ray_default_knobs": RAY_DEFAULT_KNOBS,
            "cpus": os.cpu_count(),
        },
    }
    print(
        "recovery (elastic vs Ray defaults): "
        + ", ".join(
            f"{k} {med['elastic'][k]:.1f} s vs {med['ray_defaults'][k]:.1f} s" for k in keys
        )
        + f"; checkpoint overhead {100 * ckpt['checkpoint_overhead']:.2f}% of wall time"
    )
    return report
