"""chaos: one run with 10 random worker kills, 2 node removals and 2 node additions, beside
a clean run with the same seed: every step's rows (ids digests), per-step training loss,
final validation loss, exactly-once samples, the time from each worker group's start to
its first batch; then fixed world sizes 1, 2 and 3 from the same seed, 100 steps each:
the largest per-step loss difference. Writes bench-chaos.json and bench-chaos.png (both
runs' loss curves over the steps)."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path

from elastic_bench.common import ELASTIC_MODEL, elastic_data, train
from elastic_harness.localcluster import RayCluster, Run

HELP = "random kills, removals and additions vs a clean run; world sizes 1, 2, 3"
VAL_LOSS_GAP_TARGET = 0.0005  # final validation loss within 0.05% of the undisturbed run
WORLD_SIZE_LOSS_TARGET = 1e-4  # per-step loss at 1, 2, 3 workers: fp32 summation noise
FIRST_BATCH_TARGET_S = 1.0  # a worker group's start -> its first batch, at most
LANES = 12  # the row order's lanes, fixed for every run here (the default follows max_workers)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--world-steps", type=int, default=100, help="steps of each fixed size")
    p.add_argument("--plot", default="bench-chaos.png")


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
    data = elastic_data(workdir)
    overrides = [
        "+experiment=smoke",
        *ELASTIC_MODEL,
        # a cosine decay to 0 over the run: the final loss reflects the whole training
        f"trainer.max_steps={args.epochs * 2048 // 64}",  # the data's rows / global batch
        "trainer.max_epochs=0",
        "optim.schedule=cosine",
        "optim.warmup_steps=20",
        "scaling.max_failures=-1",  # 14 failures on purpose
        f"data.lanes={LANES}",
        *data,
    ]
    try:
        results = {
            label: _chaos_run(workdir, label, overrides, todo, rng)
            for label, todo in (("chaos", actions), ("clean", []))
        }
        worlds = _world_sizes(workdir, data, args.world_steps)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    chaotic, clean = results["chaos"], results["clean"]
    steps = sorted(clean["steps"])
    rel = {
        s: abs(chaotic["steps"][s]["loss"] - clean["steps"][s]["loss"])
        / abs(clean["steps"][s]["loss"])
        for s in steps
        if s in chaotic["steps"]
    }
    ready = chaotic["data_ready_s"]
    report = {
        "finished": chaotic["status"] == "finished" and chaotic["exit_code"] == 0,
        "samples_exactly_once": chaotic["samples_exactly_once"],
        "same_global_batches": sorted(chaotic["steps"]) == steps
        and all(chaotic["steps"][s]["digest"] == clean["steps"][s]["digest"] for s in steps),
        "val_loss_rel_gap": abs(chaotic["val_loss"] - clean["val_loss"]) / clean["val_loss"],
        "max_step_loss_rel_diff": max(rel.values()),
        "world_size_loss_rel_diff": worlds["max_rel_diff"],
        "world_sizes_same_global_batches": worlds["same_batches"],
        "data_ready_s": {
            "fresh": clean["data_ready_s"][0],
            "restarts": ready[1:],
            "median": statistics.median(ready),
            "max": max(ready),
            # when the loop took it: after DeepSpeed's start and the restore too
            "first_batch_s": chaotic["first_batch_s"],
        },
        "targets": {
            "val_loss_rel_gap": VAL_LOSS_GAP_TARGET,
            "world_size_loss_rel_diff": WORLD_SIZE_LOSS_TARGET,
            "data_ready_s": FIRST_BATCH_TARGET_S,
        },
        "actions": {a: actions.count(a) for a in ("kill", "remove", "add")},
        "runs": {k: {**v, "steps": len(v["steps"])} for k, v in results.items()},
        "world_size_runs": worlds,
        "setup": {"model": ELASTIC_MODEL, "epochs": args.epochs, "seed": args.seed},
    }
    _plot(args.plot, chaotic, clean, rel)
    print(
        f"chaos: finished={report['finished']} exactly_once={report['samples_exactly_once']} "
        f"same global batches={report['same_global_batches']}; val loss "
        f"{chaotic['val_loss']:.6f} vs clean {clean['val_loss']:.6f} (gap "
        f"{100 * report['val_loss_rel_gap']:.4f}%), largest per-step loss difference "
        f"{report['max_step_loss_rel_diff']:.2e}; world sizes 1/2/3: "
        f"{report['world_size_loss_rel_diff']:.2e}; first batch after a group start: median "
        f"{report['data_ready_s']['median']:.2f} s, max {report['data_ready_s']['max']:.2f} s"
    )
    return report


def _steps(run_records: list[dict]) -> dict[int, dict]:
    """The last record of every step (one a step is trained again after a restart: the
    last is what the surviving model saw), with its loss and ids digest."""
    out = {}
    for r in run_records:
        if "train/loss" in r:
            out[r["step"]] = {"loss": r["train/loss"], "digest": r["train/batch_digest"]}
    return out


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
    records = run.records()
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
        # a group's start -> its first step's rows read and decoded (the reader starts
        # with the group, beside DeepSpeed's start and the restore)
        "data_ready_s": [r["data_ready_s"] for r in records if r.get("event") == "startup"],
        "first_batch_s": [r["first_batch_s"] for r in records if r.get("event") == "startup"],
        "steps": _steps(records),
    }


def _world_sizes(workdir: str, data: list[str], steps: int) -> dict:
    """The same run at 1, 2 and 3 workers: every step's loss and rows."""
    runs = {}
    for world in (1, 2, 3):
        overrides = [
            "+experiment=smoke",
            *ELASTIC_MODEL,
            f"scaling.workers={world}",
            "scaling.cpus_per_worker=1",
            f"data.lanes={LANES}",
            *data,
        ]
        records, _ = train(overrides, steps, workdir, f"world{world}", log_every=1)
        runs[world] = _steps(records)
    base = runs[1]
    rel = {
        w: max(abs(r[s]["loss"] - base[s]["loss"]) / abs(base[s]["loss"]) for s in base)
        for w, r in runs.items()
        if w != 1
    }
    return {
        "steps": steps,
        "max_rel_diff": max(rel.values()),
        "max_rel_diff_by_world": rel,
        "same_batches": all(
            {s: v["digest"] for s, v in r.items()} == {s: v["digest"] for s, v in base.items()}
            for r in runs.values()
        ),
        "losses": {w: [r[s]["loss"] for s in sorted(r)] for w, r in runs.items()},
    }


def _plot(path: str, chaotic: dict, clean: dict, rel: dict[int, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for label, run, style in (("clean", clean, "-"), ("chaos (14 failures)", chaotic, "--")):
        steps = sorted(run["steps"])
        top.plot(steps, [run["steps"][s]["loss"] for s in steps], style, label=label, lw=1)
    for _, step in chaotic["actions"]:
        top.axvline(step, color="grey", alpha=0.3, lw=0.8)
    top.set_yscale("log")
    top.set_ylabel("training loss")
    top.legend()
    top.set_title("elastic: a run with kills, removals and additions vs the clean run")
    steps = sorted(rel)
    bottom.plot(steps, [max(rel[s], 1e-12) for s in steps], lw=1)
    bottom.set_yscale("log")
    bottom.set_ylabel("relative loss difference")
    bottom.set_xlabel("step (grey: a failure or a node added)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
