"""hetero: 2 workers, one slowed about 2x for real (``localcluster.Throttle``: a cgroup CPU
quota of half a core, where the cpu cgroup is writable, as for root; else
``localcluster.Slowdown``: pinned to a core beside a busy-looping process, a noisy
neighbour rather than a slow node, under which rounds came out above their ideal and
were refused), in lock-step (``stragglers.policy=report``) and
with ``rebalance``; the ideal is the sum of each worker's samples/s measured alone (a
1-worker run on the fast core, one on the slowed core, each with half the global
batch). Every run's samples/s is the median of its log intervals after the rebalance
run's first move. ``--rounds`` rounds of the four runs, the 2-worker runs alternating
which goes first; medians and each ratio's range over the rounds, the verdict on the
lowest valid round. A round whose rebalanced pair beats the ideal (two workers sharing
the machine faster than the sum of each alone) is refused: its alone runs were not a
trustworthy reference (the machine's speed drifted, or the slowdown was not the same
in the pair as alone: each run records each worker's CPU seconds per second,
``cpu_use``, and how the slowdown was made, ``slowdown_method``). Writes
bench-hetero.json (each round's log intervals too, refused rounds with their reason)."""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from elastic_harness.localcluster import Run, Slowdown, Throttle, train_workers_under

HELP = "one worker slowed 2x: lock-step vs rebalance vs the ideal"
REBALANCE_VS_LOCKSTEP_TARGET = 1.3  # rebalance's samples/s over lock-step's, at least
REBALANCE_VS_IDEAL_TARGET = 0.9  # rebalance's samples/s over the ideal, at least
# a round whose rebalance exceeds its ideal by more than this is refused (the ideal is
# an upper bound: two workers sharing the machine cannot beat the sum of each alone;
# the slack is the log intervals' median noise)
IDEAL_CEILING = 1.02
# Rows a step large against the model, so that a step's compute grows with its rows and
# dominates its gradient all-reduce, as on GPUs: here the slowed core slows the slowed
# rank's side of the all-reduce too, which no split of the rows can move (at 2,048 rows
# a step the all-reduce was ~25% of a rebalanced step, at 16,384 ~5%, and 32,768 came
# closest to the ideal).
# With a 1024-wide MLP and 128 rows a worker, fixed costs per step (optimizer, Python)
# made a half-speed worker's step hardly shorter with fewer rows.
BATCH = 32768
ROWS = 262144
MODEL = [
    "+experiment=smoke",
    "model.input_dim=64",
    "model.output_dim=4",
    "model.hidden_dims=[512,512]",
    "checkpoint.every_steps=0",
    "logger=none",
    "trainer.progress=off",
    "cluster.num_cpus=4",  # logical: the workers and Ray Data's read tasks
    "stragglers.window=3",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--log-every", type=int, default=5)


def measure(args: argparse.Namespace) -> dict:
    workdir = tempfile.mkdtemp(prefix="elastic-bench-")
    try:
        from elastic.datasets.synthetic import generate

        root = f"{workdir}/data"
        generate(f"{root}/train", None, ROWS, 0, 8, 64, 4, seed=1)
        data = [f"data.path={root}/train", "data.val_path=null"]
        base = [*MODEL, *data, f"trainer.max_steps={args.steps}"]
        base.append(f"trainer.log_every_steps={args.log_every}")
        two = [*base, "scaling.workers=2", f"data.global_batch_size={BATCH}"]
        one = [*base, "scaling.workers=1", f"data.global_batch_size={BATCH // 2}"]
        runs = {
            "lockstep": ([*two, "stragglers.policy=report"], True),
            "rebalance": ([*two, "stragglers.policy=rebalance"], True),
            "alone_fast": (one, False),
            "alone_slow": (one, True),
        }
        rounds = []
        for r in range(args.rounds):  # alternated: each round the other 2-worker run first
            order = list(runs) if r % 2 == 0 else ["rebalance", "lockstep", *list(runs)[2:]]
            done = {k: _run(workdir, f"{k}-{r}", *runs[k]) for k in order}
            rounds.append(_round(done))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return _report(rounds, args.steps)


def _report(rounds: list[dict], steps: int) -> dict:
    """The figures over the valid rounds (medians, each ratio's range, the verdict on
    the lowest); with no valid round every figure is None and ``met`` False."""
    valid = [r for r in rounds if r["valid"]]
    figures = ("lockstep_samples_per_s", "rebalance_samples_per_s", "ideal_samples_per_s")
    ratios = ("rebalance_vs_lockstep", "rebalance_vs_ideal", "slowdown")
    report: dict = {k: None for k in (*figures, *ratios)}
    for k in ("rebalance_vs_lockstep", "rebalance_vs_ideal"):
        report[f"{k}_min"] = report[f"{k}_max"] = None
    if valid:
        report.update({k: statistics.median(r[k] for r in valid) for k in (*figures, *ratios)})
        for k in ("rebalance_vs_lockstep", "rebalance_vs_ideal"):
            report[f"{k}_min"] = min(r[k] for r in valid)
            report[f"{k}_max"] = max(r[k] for r in valid)
    report.update(
        {
            "met": bool(valid)
            and report["rebalance_vs_lockstep_min"] >= REBALANCE_VS_LOCKSTEP_TARGET
            and report["rebalance_vs_ideal_min"] >= REBALANCE_VS_IDEAL_TARGET,
            "valid_rounds": len(valid),
            "refused_rounds": [
                {"round": i, "because": r["refused_because"]}
                for i, r in enumerate(rounds)
                if not r["valid"]
            ],
            "rounds": [{k: v for k, v in r.items() if k != "runs"} for r in rounds],
            "final_rows": rounds[-1]["final_rows"] if rounds else None,
            "targets": {
                "rebalance_vs_lockstep": REBALANCE_VS_LOCKSTEP_TARGET,
                "rebalance_vs_ideal": REBALANCE_VS_IDEAL_TARGET,
                "ideal_ceiling": IDEAL_CEILING,
            },
            "verdict_on": "the lowest valid round",
            "runs": rounds[-1]["runs"] if rounds else {},
            "setup": {
                "model": MODEL,
                "global_batch": BATCH,
                "steps": steps,
                "slowdown": next(
                    (r["runs"]["alone_slow"]["slowdown_method"] for r in rounds), None
                ),
            },
        }
    )
    for r in report["refused_rounds"]:
        print(f"hetero: round {r['round']} refused: {r['because']}")
    if not valid:
        print(
            f"hetero: no valid round of {len(rounds)}: no figure and no verdict "
            "(rerun; see each run's cpu_use in bench-hetero.json)"
        )
        return report
    print(
        f"hetero ({len(valid)} valid rounds of {len(rounds)}, medians): lock-step "
        f"{report['lockstep_samples_per_s']:,.0f} samples/s, rebalance "
        f"{report['rebalance_samples_per_s']:,.0f} ({report['rebalance_vs_lockstep']:.2f}x, "
        f"rounds {report['rebalance_vs_lockstep_min']:.2f}-"
        f"{report['rebalance_vs_lockstep_max']:.2f}, target >= "
        f"{REBALANCE_VS_LOCKSTEP_TARGET}), ideal {report['ideal_samples_per_s']:,.0f} "
        f"(rebalance {100 * report['rebalance_vs_ideal']:.0f}% of it, rounds "
        f"{100 * report['rebalance_vs_ideal_min']:.0f}-"
        f"{100 * report['rebalance_vs_ideal_max']:.0f}%, target >= "
        f"{100 * REBALANCE_VS_IDEAL_TARGET:.0f}%); slowed worker "
        f"{report['slowdown']:.2f}x slower alone; final rows per rank {report['final_rows']}"
    )
    return report


def _round(runs: dict[str, dict]) -> dict:
    """One round's figures from its four runs."""
    moves = runs["rebalance"]["rebalances"]
    # every run over the same steps: after the rebalance run's first move (which goes
    # all the way; later ones refine it, at any step, from more intervals), so that
    # the steady state is compared, and the lock-step run is not judged on its start;
    # the alone runs alike (the same steps, the median interval), so that the ideal is
    # not lowered by the epoch starts that the 2-worker runs' medians leave out
    after = moves[0]["step"] if moves else 0
    rate = {k: _rate(r["intervals"], after) for k, r in runs.items()}
    ideal = rate["alone_fast"] + rate["alone_slow"]
    refused = None
    if rate["rebalance"] > IDEAL_CEILING * ideal:
        use = {k: r.get("cpu_use") for k, r in runs.items()}
        refused = (
            f"rebalance {rate['rebalance']:,.0f} samples/s above its ideal {ideal:,.0f} "
            f"(alone {rate['alone_fast']:,.0f} + {rate['alone_slow']:,.0f}): the alone runs "
            f"are no reference for this round (each worker's CPU s per s, slowed first: {use})"
        )
    return {
        "valid": refused is None,
        "refused_because": refused,
        "lockstep_samples_per_s": rate["lockstep"],
        "rebalance_samples_per_s": rate["rebalance"],
        "ideal_samples_per_s": ideal,
        "alone_samples_per_s": {"fast": rate["alone_fast"], "slow": rate["alone_slow"]},
        "rebalance_vs_lockstep": rate["rebalance"] / rate["lockstep"],
        "rebalance_vs_ideal": rate["rebalance"] / ideal,
        "slowdown": rate["alone_fast"] / rate["alone_slow"],
        "from_step": after,
        "final_rows": moves[-1]["rows"] if moves else None,
        "moves": [(m["step"], m["rows"]) for m in moves],
        "samples_per_s_by_step": {k: r["intervals"] for k, r in runs.items()},
        "runs": {k: {x: v for x, v in r.items() if x != "intervals"} for k, r in runs.items()},
    }


def _run(workdir: str, label: str, overrides: list[str], slow_one: bool) -> dict:
    """A run with its first worker slowed (``slow_one``) or pinned alone to the other
    core; its summary's figures and its log intervals."""
    run = Run(Path(workdir), label, overrides)
    slowdown: Throttle | Slowdown = Throttle() if Throttle.available() else Slowdown(busy=1)
    try:
        world = 2 if "scaling.workers=2" in overrides else 1
        pids = run.wait_for(
            "training workers",
            lambda: len(w := train_workers_under(run.proc.pid)) == world and w,
        )
        if slow_one:
            slowdown.apply(pids[:1], pids[1:])
        else:
            slowdown.apply([], pids)
        use = _cpu_use(run.proc, pids, timeout=900)
        throttled = slowdown.throttled_s() if isinstance(slowdown, Throttle) else None
        rc = run.finish(timeout=60)
    finally:
        slowdown.stop()
        if run.proc.poll() is None:
            run.proc.kill()
    if rc != 0:
        raise RuntimeError(f"{label} run failed ({rc}):\n{run.output()[-3000:]}")
    summary = run.summary()
    return {
        "slowdown_method": slowdown_method(slowdown) if slow_one else None,
        "cpu_use": use,  # pids[0] first: the slowed worker where one is
        "throttled_s": throttled if slow_one else None,
        "samples_per_s": summary["samples_per_s"],
        "workers": summary["workers"],
        "slowest_median_ratio": summary["slowest_median_ratio"],
        "stragglers": [e for e in summary["events"] if e["event"] == "straggler"],
        "rebalances": [e for e in summary["events"] if e["event"] == "rebalance"],
        "intervals": [
            (r["step"], r["train/samples_per_s"]) for r in run.records() if "train/loss" in r
        ],
    }


def _rate(intervals: list[tuple[int, float]], after: int) -> float:
    """The median samples/s of the log intervals that end after step ``after`` + one
    interval (the first after a change holds the reader's switch)."""
    steps = [s for s, _ in intervals]
    gap = min((b - a for a, b in zip(steps, steps[1:], strict=False)), default=1)
    rates = [v for s, v in intervals if s > after + gap]
    return statistics.median(rates or [v for _, v in intervals])


def slowdown_method(slowdown: Throttle | Slowdown) -> str:
    if isinstance(slowdown, Throttle):
        return f"cgroup cpu quota: {slowdown.fraction} of a core"
    return f"busy neighbour: {len(slowdown.busy)} spinning process(es) on its core"


def _cpu_use(run: subprocess.Popen, pids: list[int], timeout: float) -> list[float | None]:
    """Until ``run`` (the run's driver) ends: each of ``pids``' CPU seconds per wall
    second, from now to its last sample (about 0.5 for a worker slowed 2x, near 1 for
    one alone on its core that never waits; None for one that ended before a second
    sample)."""

    def cpu(pid: int) -> float:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system

    start: dict[int, tuple[float, float]] = {}
    for pid in pids:
        try:
            start[pid] = (time.monotonic(), cpu(pid))
        except psutil.Error:
            continue
    last: dict[int, tuple[float, float]] = {}
    deadline = time.monotonic() + timeout
    while run.poll() is None and time.monotonic() < deadline:
        for pid in list(start):
            try:
                last[pid] = (time.monotonic(), cpu(pid))
            except psutil.Error:
                continue  # it ended: its last sample stands
        time.sleep(1.0)
    out: list[float | None] = []
    for pid in pids:
        if pid not in last or last[pid][0] <= start[pid][0]:
            out.append(None)
            continue
        out.append((last[pid][1] - start[pid][1]) / (last[pid][0] - start[pid][0]))
    return out
