"""overhead: steady-state step time of the smoke experiment through ``elastic`` (Ray Train
+ DeepSpeed + streamed Parquet) vs plain ``torchrun --nproc-per-node 2`` DDP on the same
model and the same data held in memory. Steady state is after the first epoch (the
split then comes from each worker's cache); the first epoch, while Ray Data reads and
decodes the shards on the same cores, is reported apart. Rounds alternate which goes
first; ``ratio`` is the geometric mean of the rounds' ratios, with its 95% confidence
interval (Student's t over the rounds' log ratios), and the verdict is on the
interval's upper end: met only when the whole interval is at or under the target.
Writes bench-overhead.json."""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import tempfile

from elastic.bench.common import smoke_config, torchrun_json, train

HELP = "step time vs plain torchrun DDP"
STEP_RATIO_TARGET = 1.05  # elastic's steady-state step time over torchrun DDP's, at most
WARMUP_STEPS = 20
# Student's t, two-sided 95%, by degrees of freedom (rounds - 1)
T95 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def ratio_interval(ratios: list[float]) -> tuple[float, float | None, float | None]:
    """The rounds' ratios' geometric mean and its 95% confidence interval (None with
    one round: no spread to judge by). Ratios are compared on the log scale, where
    1.1x slower and 1.1x faster are the same distance from 1."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), None, None
    half = T95.get(len(logs) - 1, 1.96) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument(
        "--zero-stage",
        type=int,
        default=0,
        help="0 is DeepSpeed's plain data parallelism: like for like with DDP",
    )
    p.add_argument("overrides", nargs="*", help="extra config overrides for the elastic run")


def _elastic_step_s(overrides: list[str], steps: int, workdir: str) -> dict[str, float]:
    """Step times of one elastic run after warm-up, from its 10-step log intervals.

    ``steady``: the median over the intervals after the first epoch (the train split
    then comes from each worker's cache, or from the read-ahead buffer when it streams
    every epoch): what the rest of a long run costs per step. ``first_epoch``: the median
    over the first epoch's intervals, while Ray Data reads and decodes the Parquet shards
    on the same two cores. ``with_epoch_starts``: the mean over every step after warm-up
    (intervals holding an epoch start included)."""
    records, _ = train(["+experiment=smoke", *overrides], steps, workdir, "bench")
    times, epochs = {}, {}
    for rec in records:
        if "train/loss" in rec:
            times[rec["step"]], epochs[rec["step"]] = rec["time"], rec["train/epoch"]
    logged = sorted(s for s in times if s >= WARMUP_STEPS)
    first, later = [], []  # an interval holding the first epoch's end is in neither
    for a, b in zip(logged[:-1], logged[1:], strict=True):
        per_step = (times[b] - times[a]) / (b - a)
        if epochs[b] == 0:
            first.append(per_step)
        elif epochs[a] >= 1:
            later.append(per_step)
    if not first or not later:
        raise SystemExit(
            f"bench overhead: --steps {steps} does not reach past the first epoch after "
            f"{WARMUP_STEPS} warm-up steps; give more steps"
        )
    return {
        "steady": statistics.median(later),
        "first_epoch": statistics.median(first),
        "with_epoch_starts": (times[logged[-1]] - times[logged[0]]) / (logged[-1] - logged[0]),
    }


def _torchrun_step_s(cfg, steps: int) -> float:
    args = [
        "--data", cfg.data.path, "--input-dim", str(cfg.model.input_dim),
        "--hidden-dims", ",".join(map(str, cfg.model.hidden_dims)),
        "--output-dim", str(cfg.model.output_dim),
        "--global-batch", str(cfg.data.global_batch_size), "--lr", str(cfg.optim.lr),
        "--steps", str(steps), "--warmup", str(WARMUP_STEPS),
    ]  # fmt: skip
    return float(torchrun_json(cfg.scaling.max_workers, "ddp_step.py", args)["step_s"])


def measure(args: argparse.Namespace) -> dict:
    from elastic.train.driver import prepare_data

    overrides = [f"strategy.zero_stage={args.zero_stage}", *args.overrides]
    cfg = smoke_config(overrides)
    prepare_data(cfg)
    rounds = []
    workdir = tempfile.mkdtemp(prefix="elastic-bench-")
    try:
        for r in range(args.rounds):
            result: dict[str, float] = {}
            order = ["elastic", "torchrun"] if r % 2 == 0 else ["torchrun", "elastic"]
            for who in order:
                if who == "elastic":
                    step_s = _elastic_step_s(overrides, args.steps, workdir)
                    result["elastic"] = step_s["steady"]
                    result["elastic_first_epoch"] = step_s["first_epoch"]
                    result["elastic_with_epoch_starts"] = step_s["with_epoch_starts"]
                else:
                    result[who] = _torchrun_step_s(cfg, args.steps)
            result["ratio"] = result["elastic"] / result["torchrun"]
            rounds.append(result)
            print(
                f"round {r + 1}: elastic {result['elastic'] * 1e3:.2f} ms/step (first epoch "
                f"{result['elastic_first_epoch'] * 1e3:.2f}), torchrun DDP "
                f"{result['torchrun'] * 1e3:.2f} ms/step: ratio {result['ratio']:.3f}",
                flush=True,
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    el, tr = median("elastic"), median("torchrun")
    first, with_starts = median("elastic_first_epoch"), median("elastic_with_epoch_starts")
    ratio, low, high = ratio_interval([r["ratio"] for r in rounds])
    report = {
        "ratio": ratio,
        "ratio_ci_low": low,
        "ratio_ci_high": high,
        "met": None if high is None else high <= STEP_RATIO_TARGET,
        "verdict_on": "the 95% interval's upper end",
        "elastic_step_s": el,
        "torchrun_step_s": tr,
        "peers": {"torchrun_ddp": {"step_s": tr, "rounds": [r["torchrun"] for r in rounds]}},
        "ratio_of_medians": el / tr,
        "ratio_per_round_median": median("ratio"),
        "elastic_first_epoch_step_s": first,
        "ratio_first_epoch": first / tr,
        "elastic_step_s_with_epoch_starts": with_starts,
        "ratio_with_epoch_starts": with_starts / tr,
        "target": STEP_RATIO_TARGET,
        "rounds": rounds,
        "setup": {
            "experiment": "smoke",
            "overrides": overrides,
            "steps": args.steps,
            "warmup_steps": WARMUP_STEPS,
            "workers": cfg.scaling.max_workers,
            "global_batch_size": cfg.data.global_batch_size,
            "steps_per_epoch": -(-cfg.data.synthetic.rows // cfg.data.global_batch_size)
            if cfg.data.synthetic
            else None,
            "cpus": os.cpu_count(),
        },
    }
    interval = "one round: no interval" if high is None else f"95% interval {low:.3f}-{high:.3f}"
    print(
        f"overhead: elastic {el * 1e3:.2f} ms/step vs torchrun DDP {tr * 1e3:.2f} ms/step: "
        f"ratio {ratio:.3f} ({interval}; target <= {STEP_RATIO_TARGET:.2f} over the whole "
        f"interval); first epoch (Parquet read "
        f"and decoded on the same cores) {first * 1e3:.2f} ms/step, ratio {first / tr:.3f}; "
        f"with epoch starts {with_starts * 1e3:.2f} ms/step, ratio {with_starts / tr:.3f}"
    )
    return report
