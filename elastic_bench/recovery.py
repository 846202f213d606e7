"""recovery: on a local multi-raylet cluster (a head and 2 one-worker nodes), seconds from
a worker SIGKILL / a node kill / a node joining to the first training step after it,
with elastic's recovery defaults and, as the peer, with Ray Train's own defaults; and
the checkpoint share of the smoke run's wall time at the default interval. Writes
bench-recovery.json."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path

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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=1)


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
        "targets": {
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
