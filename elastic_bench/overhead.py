"""overhead: steady-state step time of the smoke experiment through ``elastic`` (Ray Train
+ DeepSpeed + streamed Parquet) vs its peers on the same model and the same data held in
memory: plain ``torchrun --nproc-per-node 2`` DDP (``launch/peers/ddp_step.py``) and
DeepSpeed under torchrun with the engine elastic builds (``launch/peers/ds_step.py``),
at each ZeRO stage of ``--zero-stages`` (0 and 2 by default). The layers apart:
DeepSpeed vs DDP is DeepSpeed's own cost, elastic vs DeepSpeed is elastic's (its loop,
Ray, the streamed data). Each stage is judged against its like-for-like peer: DDP at 0,
DeepSpeed at the same stage above it. At 0 a third peer, DDP with the malloc settings
elastic gives its training workers (``vs_ddp_same_malloc``): glibc's defaults map and
unmap a fresh gradient of the model's size every step, which those settings avoid, and
a DDP user could set them too; reported beside the verdict, which stays on plain DDP.
Steady state is after the first epoch (the split
then comes from each worker's cache); the first epoch, while Ray Data reads and decodes
the shards on the same cores, is reported apart. Each round runs every run once, each
elastic run next to the peer it is judged against, every other round in the reverse
order: a machine whose speed drifts over minutes then slows both of a pair alike, and
a steady drift favours neither side over two rounds (two peers that should match,
DeepSpeed ZeRO-0 against DDP, were measured a tenth apart from round to round when the
rounds did not alternate). A ratio is the geometric mean of the
rounds' ratios,
with its 95% confidence interval (Student's t over the rounds' log ratios), and the
verdict is on the interval's upper end: met only when the whole interval is at or
under the target. Beside each run's step time, the CPU a step of every process it
started, counted from outside over the steps it timed (``cpu`` per stage, ``cpu_rounds``):
elastic's training workers apart from Ray's resident processes and the driver.
``--variant NAME=OVERRIDES`` adds an elastic run with those overrides to every round,
next to the same peer as the default run: judged against that peer and against the
default elastic run of the same rounds (``variants`` per stage), without a verdict.
Writes bench-overhead.json."""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from elastic.cluster.allocator import worker_malloc_env
from elastic_bench.common import smoke_config, torchrun_json, train
from elastic_harness.localcluster import CpuClock

HELP = "step time vs plain torchrun DDP"
STEP_RATIO_TARGET = 1.05  # elastic's steady-state step time over torchrun DDP's, at most
WARMUP_STEPS = 20
CPU_PERIOD_S = 0.5  # how often every process's CPU seconds are read
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
    p.add_argument("--steps", type=int, default=400)
    p.add_argument(
        "--zero-stages",
        default="0,2",
        help="comma separated; each stage's elastic run is judged against plain DDP at 0 "
        "(DeepSpeed's plain data parallelism: like for like) and against DeepSpeed under "
        "torchrun at the same stage otherwise",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=OVERRIDES",
        help="an elastic variant run in every round beside the default, at each stage, e.g. "
        "--variant 'after=strategy.overlap_reduce=false' (overrides separated by spaces), "
        "or another checkout's code: --variant 'before=@/path/to/checkout' (a git worktree "
        "of the commit before a change): judged against the same peer and against the "
        "default elastic run; no verdict",
    )
    p.add_argument(
        "--deepspeed-malloc",
        action="store_true",
        help="also run DeepSpeed under torchrun with the malloc settings elastic gives its "
        "workers, next to each elastic run (vs_deepspeed_same_malloc: like for like)",
    )
    p.add_argument("overrides", nargs="*", help="extra config overrides for the elastic run")


def _elastic_step_s(
    overrides: list[str], steps: int, workdir: str, checkout: Path | None = None
) -> dict[str, Any]:
    """Step times of one elastic run after warm-up, from its 10-step log intervals.

    ``steady``: the median over the intervals after the first epoch (the train split
    then comes from each worker's cache, or from the read-ahead buffer when it streams
    every epoch): what the rest of a long run costs per step. ``first_epoch``: the median
    over the first epoch's intervals, while Ray Data reads and decodes the Parquet shards
    on the same two cores. ``with_epoch_starts``: the mean over every step after warm-up
    (intervals holding an epoch start included)."""
    records, _ = train(
        ["+experiment=smoke", *overrides], steps, workdir, "bench", checkout=checkout
    )
    times, epochs = {}, {}
    for rec in records:
        if "train/loss" in rec:
            times[rec["step"]], epochs[rec["step"]] = rec["time"], rec["train/epoch"]
    logged = sorted(s for s in times if s >= WARMUP_STEPS)
    first, later = [], []  # an interval holding the first epoch's end is in neither
    steady_from = None
    for a, b in zip(logged[:-1], logged[1:], strict=True):
        per_step = (times[b] - times[a]) / (b - a)
        if epochs[b] == 0:
            first.append(per_step)
        elif epochs[a] >= 1:
            later.append(per_step)
            steady_from = a if steady_from is None else steady_from
    if not first or not later:
        raise SystemExit(
            f"bench overhead: --steps {steps} does not reach past the first epoch after "
            f"{WARMUP_STEPS} warm-up steps; give more steps"
        )
    assert steady_from is not None  # ``later`` is not empty
    return {
        "steady": statistics.median(later),
        "first_epoch": statistics.median(first),
        "with_epoch_starts": (times[logged[-1]] - times[logged[0]]) / (logged[-1] - logged[0]),
        "window": (times[steady_from], times[logged[-1]]),  # the steady steps, as a peer's
        "steps": logged[-1] - steady_from,
    }


def _ddp_peer(cfg, steps: int, same_malloc: bool = False) -> dict:
    """Plain DDP under torchrun: its rank 0's JSON line (``step_s``, ``window``, ``steps``).
    ``same_malloc``: with the malloc settings elastic gives its training workers
    (:mod:`elastic.cluster.allocator`), which a DDP user could set too: like for like."""
    args = [
        "--data", cfg.data.path, "--input-dim", str(cfg.model.input_dim),
        "--hidden-dims", ",".join(map(str, cfg.model.hidden_dims)),
        "--output-dim", str(cfg.model.output_dim),
        "--global-batch", str(cfg.data.global_batch_size), "--lr", str(cfg.optim.lr),
        "--steps", str(steps), "--warmup", str(WARMUP_STEPS),
    ]  # fmt: skip
    env = worker_malloc_env(os.environ) if same_malloc else None
    return torchrun_json(cfg.scaling.max_workers, "ddp_step.py", args, env)


def _deepspeed_peer(cfg, overrides: list[str], steps: int, same_malloc: bool = False) -> dict:
    """DeepSpeed under torchrun, the engine elastic builds from the same config: its
    rank 0's JSON line (``step_s``, ``window``, ``steps``); ``same_malloc`` as for
    :func:`_ddp_peer`."""
    args = ["--steps", str(steps), "--warmup", str(WARMUP_STEPS), "--"]
    args += ["+experiment=smoke", *overrides]
    env = worker_malloc_env(os.environ) if same_malloc else None
    return torchrun_json(cfg.scaling.max_workers, "ds_step.py", args, env)


TRAINING = "ray::RayTrainWorker"  # the kind of an elastic run's training processes


def _cpu_ms(clock: CpuClock, window: tuple[float, float], steps: int) -> dict[str, Any]:
    """CPU milliseconds a step over ``window`` (epoch seconds from, to) of ``steps``,
    every process of the run or the peer counted (``clock``: this process's children):
    ``total``, and for an elastic run the training workers' apart from everything else
    it keeps running (``resident``: Ray's processes, actors and pooled workers, the
    driver), by kind."""
    kinds = {k: 1e3 * v / steps for k, v in clock.head_by_kind(*window).items()}
    total = sum(kinds.values())
    training = sum(v for k, v in kinds.items() if k.startswith(TRAINING))
    return {
        "total": total,
        "training": training,
        "resident": total - training,
        "by_kind": {k: round(v, 3) for k, v in kinds.items() if v >= 0.05},
    }


def _counted(run: Callable[[], dict]) -> tuple[dict, dict[str, Any]]:
    """``run()``'s result, and the CPU a step of every process it started over the
    steps it timed (its ``window``, epoch seconds from and to, over its ``steps``)."""
    clock = CpuClock(None, period_s=CPU_PERIOD_S)
    try:
        result = run()
    finally:
        clock.stop()
    return result, _cpu_ms(clock, tuple(result["window"]), result["steps"])


def _same_malloc(rounds: list[dict[str, float]], el: str, peer: str, key: str) -> dict:
    """Elastic (round key ``el``) against ``peer`` given elastic's malloc settings (round
    key ``<key>_malloc``), and those settings' own effect on ``peer`` (over ``key``)."""
    given = f"{key}_malloc"
    return {
        f"vs_{peer}_same_malloc": _figures([r[el] / r[given] for r in rounds]),
        f"{peer}_same_malloc_vs_{peer}": _figures([r[given] / r[key] for r in rounds]),
    }


def round_order(
    stages: list[int], r: int, variants: tuple[str, ...] = (), ds_malloc: bool = False
) -> list[tuple[str, int | None]]:
    """Round ``r``'s runs in order: each elastic run beside the peer it is judged
    against (DDP at ZeRO-0, DeepSpeed at the same stage above it), e.g. ddp, elastic 0,
    ddp with elastic's malloc settings, deepspeed 0, deepspeed 2, elastic 2; every other
    round the other way round. A variant's run (``elastic:NAME``) comes just before its
    stage's peer, the default elastic run just after: both next to the peer (with one
    variant). ``ds_malloc``: DeepSpeed with elastic's malloc settings too, next to
    each elastic run or its DDP-with-the-settings neighbour."""
    mine = {s: [(f"elastic:{v}", s) for v in variants] for s in stages}
    dsm = {s: [("deepspeed_malloc", s)] if ds_malloc else [] for s in stages}
    runs: list[tuple[str, int | None]] = []
    if 0 in stages:
        zero0 = [("ddp", None), ("elastic", 0), ("ddp_malloc", None), *dsm[0], ("deepspeed", 0)]
        runs += [*mine[0], *zero0]
    else:
        runs += [("ddp", None)]
    for s in stages:
        runs += [*mine[s], ("deepspeed", s), ("elastic", s), *dsm[s]] if s != 0 else []
    return runs if r % 2 == 0 else runs[::-1]


def parse_variants(texts: list[str]) -> dict[str, list[str]]:
    """``--variant NAME=OVERRIDES`` (repeatable): {name: overrides}."""
    variants: dict[str, list[str]] = {}
    for text in texts:
        name, _, rest = text.partition("=")
        overrides = rest.split()
        taken = name in variants or name in ("first_epoch", "with_epoch_starts")
        if not name.isidentifier() or not overrides or taken:
            raise SystemExit(
                f"bench overhead: --variant {text!r}: give a new name, '=', then the "
                "overrides, e.g. --variant 'after=strategy.overlap_reduce=false', or "
                "@CHECKOUT, e.g. --variant 'before=@/tmp/before'"
            )
        checkout = overrides[0][1:] if overrides[0].startswith("@") else None
        if checkout is not None and not (Path(checkout) / "launch" / "run.py").is_file():
            raise SystemExit(
                f"bench overhead: --variant {text!r}: {checkout} is not a checkout of elastic "
                "(no launch/run.py): make one with git worktree add PATH COMMIT"
            )
        variants[name] = overrides
    return variants


def _interval(figures: dict) -> str:
    low, high = figures["ratio_ci_low"], figures["ratio_ci_high"]
    return "one round: no interval" if high is None else f"95% {low:.3f}-{high:.3f}"


def _stages(text: str) -> list[int]:
    try:
        stages = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        stages = []
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise SystemExit(f"bench overhead: --zero-stages {text!r}: give stages 0-3, e.g. 0,2")
    return stages


def _figures(ratios: list[float]) -> dict[str, float | bool | None]:
    ratio, low, high = ratio_interval(ratios)
    return {
        "ratio": ratio,
        "ratio_ci_low": low,
        "ratio_ci_high": high,
        "met": None if high is None else high <= STEP_RATIO_TARGET,
    }


def _cpu_figures(cpu_rounds: list[dict[str, dict[str, Any]]], run: str, peer: str) -> dict:
    """CPU a step of ``run`` and its ``peer`` (medians over the rounds, in ms) and the
    ratio of their totals with its interval: where a step's work goes (elastic's
    training workers apart from what Ray keeps running beside them), not a verdict on
    step time (it leaves out waiting, and on a loaded host CPU seconds stretch too)."""

    def median(key: str, part: str) -> float:
        return statistics.median(c[key][part] for c in cpu_rounds)

    ratio, low, high = ratio_interval([c[run]["total"] / c[peer]["total"] for c in cpu_rounds])
    kinds = {k for c in cpu_rounds for k in c[run]["by_kind"]}
    by_kind = {
        k: statistics.median(c[run]["by_kind"].get(k, 0.0) for c in cpu_rounds) for k in kinds
    }
    return {
        "elastic_ms": median(run, "total"),
        "elastic_training_ms": median(run, "training"),
        "elastic_resident_ms": median(run, "resident"),
        "elastic_by_kind_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "peer_ms": median(peer, "total"),
        "ratio": ratio,
        "ratio_ci_low": low,
        "ratio_ci_high": high,
    }


def measure(args: argparse.Namespace) -> dict:
    from elastic.train.driver import prepare_data

    stages = _stages(args.zero_stages)
    variants = parse_variants(args.variant)
    cfg = smoke_config([f"strategy.zero_stage={stages[0]}", *args.overrides])
    for overrides in variants.values():  # a bad override fails here, not rounds in
        if not overrides[0].startswith("@"):  # another checkout's: its own config
            smoke_config([f"strategy.zero_stage={stages[0]}", *args.overrides, *overrides])
    prepare_data(cfg)
    rounds = []
    cpu_rounds: list[dict[str, dict[str, Any]]] = []  # CPU ms a step, by run
    workdir = tempfile.mkdtemp(prefix="elastic-bench-")
    try:
        for r in range(args.rounds):
            result: dict[str, float] = {}
            cpu: dict[str, dict[str, Any]] = {}
            for who, stage in round_order(stages, r, tuple(variants), args.deepspeed_malloc):
                overrides = [f"strategy.zero_stage={stage}", *args.overrides]
                if who in ("ddp", "ddp_malloc"):
                    run = partial(_ddp_peer, cfg, args.steps, who == "ddp_malloc")
                    out, cpu[who] = _counted(run)
                    result[who] = float(out["step_s"])
                    result[f"{who}_mean"] = float(out["mean_step_s"])  # hiccups in
                elif who in ("deepspeed", "deepspeed_malloc"):
                    name = f"deepspeed_zero{stage}" + ("_malloc" if who != "deepspeed" else "")
                    run = partial(
                        _deepspeed_peer, cfg, overrides, args.steps, who == "deepspeed_malloc"
                    )
                    out, cpu[name] = _counted(run)
                    result[name] = float(out["step_s"])
                    result[f"{name}_mean"] = float(out["mean_step_s"])
                else:
                    variant = who.partition(":")[2]
                    name = f"elastic_zero{stage}" + (f"_{variant}" if variant else "")
                    extra, checkout = variants.get(variant, []), None
                    if extra and extra[0].startswith("@"):  # another checkout's code
                        checkout, extra = Path(extra[0][1:]).resolve(), extra[1:]
                    step_s, cpu[name] = _counted(
                        partial(_elastic_step_s, overrides + extra, args.steps, workdir, checkout)
                    )
                    result[name] = step_s["steady"]
                    result[f"{name}_first_epoch"] = step_s["first_epoch"]
                    result[f"{name}_with_epoch_starts"] = step_s["with_epoch_starts"]
            rounds.append(result)
            cpu_rounds.append(cpu)
            print(
                f"round {r + 1}: "
                + ", ".join(f"{k} {v * 1e3:.2f} ms/step" for k, v in result.items()),
                flush=True,
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    ddp = median("ddp")
    by_stage: dict[str, dict] = {}
    for s in stages:
        el, ds = f"elastic_zero{s}", f"deepspeed_zero{s}"
        peer = "ddp" if s == 0 else ds
        vs_ddp = [r[el] / r["ddp"] for r in rounds]
        vs_ds = [r[el] / r[ds] for r in rounds]
        by_stage[str(s)] = {
            **_figures(vs_ddp if s == 0 else vs_ds),
            "peer": "torchrun_ddp" if s == 0 else "torchrun_deepspeed",
            "elastic_step_s": median(el),
            "peer_step_s": median(peer),
            "vs_ddp": _figures(vs_ddp),
            "vs_deepspeed": _figures(vs_ds),
            # what DeepSpeed itself adds above plain DDP, elastic's loop and Ray aside
            "deepspeed_vs_ddp": _figures([r[ds] / r["ddp"] for r in rounds]),
            # like for like: DDP with the malloc settings elastic's workers get (ZeRO-0)
            **(_same_malloc(rounds, el, "ddp", "ddp") if s == 0 else {}),
            **(_same_malloc(rounds, el, "deepspeed", ds) if args.deepspeed_malloc else {}),
            "elastic_first_epoch_step_s": median(f"{el}_first_epoch"),
            "ratio_first_epoch": median(f"{el}_first_epoch") / median(peer),
            "elastic_step_s_with_epoch_starts": median(f"{el}_with_epoch_starts"),
            "ratio_with_epoch_starts": median(f"{el}_with_epoch_starts") / median(peer),
            "cpu": _cpu_figures(cpu_rounds, el, peer),
            "variants": {
                v: {
                    **_figures([r[f"{el}_{v}"] / r[peer] for r in rounds]),
                    "overrides": variants[v],
                    "elastic_step_s": median(f"{el}_{v}"),
                    "vs_default": _figures([r[f"{el}_{v}"] / r[el] for r in rounds]),
                    "cpu": _cpu_figures(cpu_rounds, f"{el}_{v}", peer),
                }
                for v in variants
            },
        }
    main = by_stage[str(stages[0])]
    verdicts = [v["met"] for v in by_stage.values()]
    report = {
        # the first stage's figures at the top (0 by default: against plain DDP)
        **{k: main[k] for k in ("ratio", "ratio_ci_low", "ratio_ci_high")},
        "met": None if None in verdicts else all(verdicts),
        "verdict_on": "the 95% interval's upper end, every stage",
        "elastic_step_s": main["elastic_step_s"],
        "torchrun_step_s": main["peer_step_s"],
        "elastic_first_epoch_step_s": main["elastic_first_epoch_step_s"],
        "ratio_first_epoch": main["ratio_first_epoch"],
        "stages": by_stage,
        "peers": {
            "torchrun_ddp": {"step_s": ddp, "rounds": [r["ddp"] for r in rounds]},
            **(
                {
                    "torchrun_ddp_same_malloc": {
                        "step_s": median("ddp_malloc"),
                        "rounds": [r["ddp_malloc"] for r in rounds],
                    }
                }
                if 0 in stages
                else {}
            ),
            **{
                f"torchrun_deepspeed_zero{s}": {
                    "step_s": median(f"deepspeed_zero{s}"),
                    "rounds": [r[f"deepspeed_zero{s}"] for r in rounds],
                }
                for s in stages
            },
        },
        "target": STEP_RATIO_TARGET,
        "rounds": rounds,
        "cpu_rounds": cpu_rounds,
        "setup": {
            "experiment": "smoke",
            "zero_stages": stages,
            "overrides": args.overrides,
            "variants": variants,
            "deepspeed_malloc": args.deepspeed_malloc,
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
    for name, v in by_stage.items():
        for variant, w in v["variants"].items():
            d = w["vs_default"]
            print(
                f"overhead ZeRO-{name}, variant {variant} ({' '.join(w['overrides'])}): "
                f"{w['elastic_step_s'] * 1e3:.2f} ms/step; vs {v['peer']} {w['ratio']:.3f} "
                f"({_interval(w)}), vs the default elastic run {d['ratio']:.3f} ({_interval(d)})"
            )
        for peer, label in (("ddp", "DDP"), ("deepspeed", "DeepSpeed")):
            if f"vs_{peer}_same_malloc" in v:  # like for like: the peer with the settings
                same, gain = v[f"vs_{peer}_same_malloc"], v[f"{peer}_same_malloc_vs_{peer}"]
                print(
                    f"overhead ZeRO-{name}: vs {label} with elastic's malloc settings "
                    f"{same['ratio']:.3f} ({_interval(same)}); those settings alone on "
                    f"{label}: {gain['ratio']:.3f} ({_interval(gain)})"
                )
        interval = _interval(v)
        print(
            f"overhead ZeRO-{name}: elastic {v['elastic_step_s'] * 1e3:.2f} ms/step vs "
            f"{v['peer']} {v['peer_step_s'] * 1e3:.2f}: ratio {v['ratio']:.3f} ({interval}; "
            f"target <= {STEP_RATIO_TARGET:.2f} over the whole interval); vs DDP "
            f"{v['vs_ddp']['ratio']:.3f}, vs DeepSpeed {v['vs_deepspeed']['ratio']:.3f}, "
            f"DeepSpeed vs DDP {v['deepspeed_vs_ddp']['ratio']:.3f}; first epoch "
            f"{v['elastic_first_epoch_step_s'] * 1e3:.2f} ms/step; CPU a step "
            f"{v['cpu']['elastic_ms']:.1f} ms (training workers "
            f"{v['cpu']['elastic_training_ms']:.1f}, Ray's resident processes and the "
            f"driver {v['cpu']['elastic_resident_ms']:.1f}) vs the peer's "
            f"{v['cpu']['peer_ms']:.1f}: {v['cpu']['ratio']:.3f}"
        )
    return report
