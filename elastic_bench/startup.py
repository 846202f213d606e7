"""startup: where a short run's seconds go outside its steps, through the real command
(``launch/run.py``, its embedded Ray cluster), with and without a validation split.

From each run's records: Ray and the worker group's start (session start -> the workers'
first event), the workers' own start (-> the first step: data, DeepSpeed, the first
batch), the steps, and the end (last step -> session end: final validation and
checkpoint). The split's cost is the "with val" run's start minus the "without" one's.
No target yet (issue 16 sets one for the time to the first batch). Writes
bench-startup.json."""

from __future__ import annotations

import argparse
import statistics
import tempfile

from elastic_bench.common import elastic_data, train

HELP = "seconds of a short run outside its steps, with and without a val split"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)


def phases(records: list[dict]) -> dict[str, float]:
    """Seconds of each part of one session of a run, from its metrics.jsonl records."""
    start = next(r["time"] for r in records if r.get("event") == "session_start")
    end = next(r["time"] for r in records if r.get("event") == "session_end")
    group = next(r["time"] for r in records if r.get("event") == "world_size")
    steps = [r["time"] for r in records if "train/loss" in r]
    startup = next(r for r in records if r.get("event") == "startup")
    return {
        "to_worker_group_s": group - start,
        "to_first_step_s": steps[0] - start,
        "worker_first_step_s": startup["first_step_s"],
        "steps_s": steps[-1] - steps[0],
        "end_s": end - steps[-1],
        "session_s": end - start,
    }


def measure(args: argparse.Namespace) -> dict:
    """Each round: the same short run with a validation split and without."""
    runs: dict[str, list[dict]] = {"with_val": [], "without_val": []}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as workdir:
        data = elastic_data(workdir)
        model = [
            "+experiment=smoke",
            "model.input_dim=64",
            "model.output_dim=4",
            "model.hidden_dims=[64,64]",
            "data.global_batch_size=64",
        ]
        for r in range(args.rounds):
            for label, extra in (("with_val", []), ("without_val", ["data.val_path=null"])):
                records, summary = train([*model, *data, *extra], args.steps, workdir, label)
                assert summary["status"] == "finished", summary
                p = phases(records)
                runs[label].append(p)
                print(
                    f"round {r + 1} {label}: " + ", ".join(f"{k} {v:.1f}" for k, v in p.items()),
                    flush=True,
                )
    median = {
        label: {k: statistics.median(p[k] for p in ps) for k in ps[0]} for label, ps in runs.items()
    }
    cost = [
        w["to_first_step_s"] - o["to_first_step_s"]
        for w, o in zip(runs["with_val"], runs["without_val"], strict=True)
    ]
    print(
        "val split's cost to the first step: "
        + ", ".join(f"{c:+.1f} s" for c in cost)
        + f" (rounds); median start {median['with_val']['to_first_step_s']:.1f} s with val",
        flush=True,
    )
    return {"runs": runs, "median": median, "val_split_start_cost_s": cost, "steps": args.steps}
