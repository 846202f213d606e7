"""chaos: one run with 10 random worker kills, 2 node removals and 2 node additions, beside
a clean run with the same seed; exactly-once samples and the final validation loss.
Writes bench-chaos.json."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

from elastic.bench.common import ELASTIC_MODEL, elastic_data
from elastic.cluster.localcluster import RayCluster, Run

HELP = "random kills, removals and additions vs a clean run"
LOSS_GAP_TARGET = 0.02  # final validation loss within 2% of the same run undisturbed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=20)


def measure(args: argparse.Namespace) -> dict:
    """10 worker kills, 2 node removals, 2 node additions, in a seeded random order, each
    once the run has checkpointed past the previous one's restart."""
    import random

    rng = random.Random(args.seed)
    actions = ["kill"] * 10 + ["remove"] * 2 + ["add"] * 2
    while True:  # never fewer than one worker node, never more than two
        rng.shuffle(actions)
        nodes, ok = 2, True
        for a in actions:
            nodes += {"remove": -1, "add": 1}.get(a, 0)
            ok = ok and 1 <= nodes <= 2
        if ok:
            break
    workdir = tempfile.mkdtemp(prefix="elastic-bench-")
    overrides = [
        "+experiment=smoke",
        *ELASTIC_MODEL,
        # a cosine decay to 0 over the run: the final loss then reflects the training,
        # not the last steps' noise (which differs with the batch order resizes bring)
        f"trainer.max_steps={args.epochs * 2048 // 64}",  # the data's rows / global batch
        "trainer.max_epochs=0",
        "optim.schedule=cosine",
        "optim.warmup_steps=20",
        "scaling.max_failures=-1",  # 14 failures on purpose
        *elastic_data(workdir),
    ]
    try:
        results = {
            label: _chaos_run(workdir, label, overrides, todo, rng)
            for label, todo in (("chaos", actions), ("clean", []))
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    chaotic, clean = results["chaos"], results["clean"]
    val_gap = abs(chaotic["val_loss"] - clean["val_loss"]) / clean["val_loss"]
    train_gap = abs(chaotic["loss_last"] - clean["loss_last"]) / clean["loss_last"]
    report = {
        "finished": chaotic["status"] == "finished" and chaotic["exit_code"] == 0,
        "samples_exactly_once": chaotic["samples_exactly_once"],
        "val_loss_gap": val_gap,
        "train_loss_gap": train_gap,
        "target_loss_gap": LOSS_GAP_TARGET,
        "actions": {a: actions.count(a) for a in ("kill", "remove", "add")},
        "runs": results,
        "setup": {"model": ELASTIC_MODEL, "epochs": args.epochs, "seed": args.seed},
    }
    print(
        f"chaos: finished={report['finished']} exactly_once={report['samples_exactly_once']} "
        f"val loss {chaotic['val_loss']:.5f} vs clean {clean['val_loss']:.5f} "
        f"(gap {100 * val_gap:.2f}%), last train loss gap {100 * train_gap:.2f}%, "
        f"wall {chaotic['wall_s']:.0f} s vs {clean['wall_s']:.0f} s"
    )
    return report


def _chaos_run(workdir: str, label: str, overrides: list[str], actions: list[str], rng) -> dict:
    cluster = RayCluster(2)
    run = Run(Path(workdir), label, overrides, cluster.address)
    done = []
    try:
        for action in actions:
            run.wait_checkpoint()
            if action == "kill":
                pids = run.wait_for("training workers", cluster.train_worker_pids)
                os.kill(rng.choice(pids), signal.SIGKILL)
            elif action == "remove":
                cluster.remove_node(rng.choice(cluster.nodes))
            else:
                cluster.add_node()
            done.append((action, run.last_step()))
            print(f"chaos: {action} at step {run.last_step()}", flush=True)
            run.wait_step(time.time())  # the next action only once it trains again
        rc = run.finish(timeout=1800)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
        cluster.shutdown()
    summary = run.summary()
    return {
        "exit_code": rc,
        "status": summary["status"],
        "samples_exactly_once": summary["samples_exactly_once"],
        "world_sizes": summary["world_sizes"],
        "loss_last": summary["loss_last"],
        "val_loss": summary["val"]["loss"],
        "wall_s": summary["wall_s"],
        "actions": done,
        "restarts": [e for e in summary["events"] if e["event"] == "restart"],
    }
