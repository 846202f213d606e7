"""overhead: steady-state step time of the smoke experiment through ``elastic`` (Ray Train
+ DeepSpeed + streamed Parquet) vs plain ``torchrun --nproc-per-node 2`` DDP on the same
model and the same data held in memory. Steady state is after the first epoch (the
split then comes from each worker's cache); the first epoch, while Ray Data reads and
decodes the shards on the same cores, is reported apart. Rounds alternate which goes
first; the ratio is of the medians. Writes bench-overhead.json."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile

from elastic.bench.common import smoke_config, torchrun_json, train

HELP = "step time vs plain torchrun DDP"
STEP_RATIO_TARGET = 1.05  # elastic's steady-state step time over torchrun DDP's, at most
WARMUP_STEPS = 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=3)
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
    report = {
        "ratio": el / tr,
        "elastic_step_s": el,
        "torchrun_step_s": tr,
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
    print(
        f"overhead: elastic {el * 1e3:.2f} ms/step vs torchrun DDP {tr * 1e3:.2f} ms/step: "
        f"ratio {el / tr:.3f} (target <= {STEP_RATIO_TARGET:.2f}); first epoch (Parquet read "
        f"and decoded on the same cores) {first * 1e3:.2f} ms/step, ratio {first / tr:.3f}; "
        f"with epoch starts {with_starts * 1e3:.2f} ms/step, ratio {with_starts / tr:.3f}"
    )
    return report
