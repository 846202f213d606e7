"""Benchmarks, each measured side by side with its peer in one run, reported as a ratio.

    python launch/bench.py overhead [--rounds 3] [--steps 220] [--zero-stage 0]

overhead: steady-state step time of the smoke experiment through ``elastic`` (Ray Train
+ DeepSpeed + streamed Parquet) vs plain ``torchrun --nproc-per-node 2`` DDP on the same
model and the same data held in memory. Rounds alternate which goes first; the ratio is
of the medians. Writes bench-overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 20


def _smoke_config(extra: list[str]):
    from elastic.compose import compose, typed_config

    cfg, name = compose(["+experiment=smoke", *extra])
    return typed_config(cfg, name)


def _elastic_step_s(overrides: list[str], steps: int, workdir: str) -> tuple[float, float]:
    """(steady-state step time, mean step time including epoch starts) after warm-up.

    Steady state is the median over 10-step log intervals: an interval holding an epoch
    start (Ray Data starting the next epoch's pipeline) is an outlier, reported apart."""
    name = f"bench-{time.time_ns()}"
    cmd = [
        sys.executable,
        str(REPO / "launch/run.py"),
        "+experiment=smoke",
        *overrides,
        f"trainer.max_steps={steps}",
        "trainer.log_every_steps=10",
        "checkpoint.every_steps=0",
        "logger=none",
        f"run.storage_path={workdir}",
        f"run.name={name}",
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    times = {}
    with open(os.path.join(workdir, name, "metrics.jsonl")) as f:
        for rec in map(json.loads, f):
            if "train/loss" in rec:
                times[rec["step"]] = rec["time"]
    steps_logged = sorted(s for s in times if s >= WARMUP_STEPS)
    pairs = zip(steps_logged[:-1], steps_logged[1:], strict=True)
    intervals = [(times[b] - times[a]) / (b - a) for a, b in pairs]
    last = steps_logged[-1]
    mean = (times[last] - times[WARMUP_STEPS]) / (last - WARMUP_STEPS)
    return statistics.median(intervals), mean


def _torchrun_step_s(cfg, steps: int) -> float:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={cfg.scaling.max_workers}",
        str(REPO / "launch/peers/ddp_step.py"),
        "--data",
        cfg.data.path,
        "--input-dim",
        str(cfg.model.input_dim),
        "--hidden-dims",
        ",".join(map(str, cfg.model.hidden_dims)),
        "--output-dim",
        str(cfg.model.output_dim),
        "--global-batch",
        str(cfg.data.global_batch_size),
        "--lr",
        str(cfg.optim.lr),
        "--steps",
        str(steps),
        "--warmup",
        str(WARMUP_STEPS),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as Ray gives each 1-CPU worker
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    line = [s for s in out.splitlines() if s.startswith("{")][-1]
    return float(json.loads(line)["step_s"])


def overhead(args: argparse.Namespace) -> dict:
    from elastic.driver import prepare_data

    overrides = [f"strategy.zero_stage={args.zero_stage}", *args.overrides]
    cfg = _smoke_config(overrides)
    prepare_data(cfg)
    rounds = []
    workdir = tempfile.mkdtemp(prefix="elastic-bench-")
    try:
        for r in range(args.rounds):
            result = {}
            order = ["elastic", "torchrun"] if r % 2 == 0 else ["torchrun", "elastic"]
            for who in order:
                if who == "elastic":
                    result[who], result["elastic_with_epoch_starts"] = _elastic_step_s(
                        overrides, args.steps, workdir
                    )
                else:
                    result[who] = _torchrun_step_s(cfg, args.steps)
            rounds.append(result)
            print(
                f"round {r + 1}: elastic {result['elastic'] * 1e3:.2f} ms/step, "
                f"torchrun DDP {result['torchrun'] * 1e3:.2f} ms/step",
                flush=True,
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    el = statistics.median(r["elastic"] for r in rounds)
    tr = statistics.median(r["torchrun"] for r in rounds)
    with_starts = statistics.median(r["elastic_with_epoch_starts"] for r in rounds)
    report = {
        "ratio": el / tr,
        "elastic_step_s": el,
        "torchrun_step_s": tr,
        "elastic_step_s_with_epoch_starts": with_starts,
        "ratio_with_epoch_starts": with_starts / tr,
        "target": 1.10,
        "rounds": rounds,
        "setup": {
            "experiment": "smoke",
            "overrides": overrides,
            "steps": args.steps,
            "warmup_steps": WARMUP_STEPS,
            "workers": cfg.scaling.max_workers,
            "global_batch_size": cfg.data.global_batch_size,
            "cpus": os.cpu_count(),
        },
    }
    print(
        f"overhead: elastic {el * 1e3:.2f} ms/step vs torchrun DDP {tr * 1e3:.2f} ms/step: "
        f"ratio {el / tr:.3f} (target <= 1.10); with epoch starts "
        f"{with_starts * 1e3:.2f} ms/step, ratio {with_starts / tr:.3f}"
    )
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="bench", required=True)
    o = sub.add_parser("overhead", help="step time vs plain torchrun DDP")
    o.add_argument("--rounds", type=int, default=3)
    o.add_argument("--steps", type=int, default=220)
    o.add_argument(
        "--zero-stage",
        type=int,
        default=0,
        help="0 is DeepSpeed's plain data parallelism: like for like with DDP",
    )
    o.add_argument("overrides", nargs="*", help="extra config overrides for the elastic run")
    args = p.parse_args()
    report = {"overhead": overhead}[args.bench](args)
    out = Path(f"bench-{args.bench}.json")
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out.resolve()}")


if __name__ == "__main__":
    main()
