"""scale: how each cost grows with the world size, the model size and the dataset size,
measured here and modelled to 1,000 nodes and to the seed studies' machine (Summit:
4,608 nodes of 6 GPUs). Writes bench-scale.json and bench-scale-{world,model,data}.png.

Measured (each series: its sizes, its values, the law fitted to them: :mod:`.fit`):

- vs world size (:mod:`.world`): one elastic run a size on a multi-raylet cluster on
  this machine; start-up, a steady step, an epoch's data start, recovery after a worker
  kill and after a node kill, growth when a node joins;
- vs model size (:mod:`.ckpt_ranks`): ZeRO-3 at 2 ranks, checkpoint save, load and bytes;
  the resharding restore at 3 ranks (a universal-checkpoint conversion, then the load);
- vs dataset size (:mod:`.data`): the exactly-once bitmap's bytes and write, the merge
  of a checkpoint's ids into it, the resume state, the checks before Ray starts.

Modelled: each law at the sizes of a 1,000-node and a 4,608-node machine (6 workers a
node). A world-size cost is modelled as the wall time at the smallest size measured,
plus what the fits say grows from there: the head side's CPU seconds (one driver, one
GCS, one Ray Train controller: serial) and one worker's CPU seconds (each worker on its
own cores there, so the workers' work is parallel). What a machine here cannot show
(network latency, a parallel filesystem's bandwidth, GPU speed) is not in the model;
docs/performance.md#scale lists the assumptions beside the figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from elastic_bench.common import torchrun_json
from elastic_bench.scale import data as dataset
from elastic_bench.scale.fit import Fit, fit
from elastic_bench.scale.plot import figures, markdown
from elastic_bench.scale.world import compute_alone_s, measure_world

HELP = "how start-up, steps, recovery, checkpoints and data state grow (to 16+ workers)"
WORKERS_PER_NODE_AT_SCALE = 6  # Summit: 6 GPUs a node
SCALES = {"1,000 nodes": 1_000, "Summit, 4,608 nodes": 4_608}  # nodes
SAMPLES_PER_WORKER = 32  # a step's rows on one worker at scale (weak scaling)
CHECKPOINT_EVERY = 50  # checkpoint.every_steps' default
RESTART_BUDGET_S = 5.0  # "a few seconds per restart at 1,000 nodes": more is to fix
MODEL_SIZES_AT_SCALE = {"1B params": 1e9, "10B params": 1e10}
SAMPLES_AT_SCALE = {"10^10 samples": 1e10}
RANKS = "elastic_bench.scale.ckpt_ranks"  # the model series' ranks, under torchrun
QUICK = {"worlds": [2, 8, 16], "params": [1e6, 1e7, 1e8], "merged": [1e4, 1e5, 1e6]}
BUDGETS = {  # series -> the value past which it breaks the run (its unit)
    **{f"{p}.modelled_s": RESTART_BUDGET_S for p in ("worker_kill", "node_kill", "node_join")},
    "checkpoint.reshard_load_s": RESTART_BUDGET_S,  # in every resize
    "ledger.merge_s": RESTART_BUDGET_S,  # every rank waits for rank 0 at each checkpoint
    "ledger.save_s": RESTART_BUDGET_S,
    "step.head_cpu_per_s": 1.0,  # the head's processes want more than a core: they lag
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16, 24])
    p.add_argument("--per-node", type=int, default=2, help="training workers a raylet node")
    p.add_argument("--params", type=float, nargs="+", default=[1e6, 3e6, 1e7, 3e7, 1e8, 3e8])
    p.add_argument("--samples", type=float, nargs="+", default=[1e6, 1e7, 1e8, 1e9])
    p.add_argument("--merged", type=float, nargs="+", default=[1e4, 1e5, 1e6, 1e7])
    p.add_argument("--quick", action="store_true", help="fewer sizes; still 16 workers")
    p.add_argument("--skip", nargs="*", default=[], choices=["world", "model", "data"])
    p.add_argument(
        "--points",
        metavar="JSON",
        help="measure nothing: fit, model and plot again the points of an earlier run's "
        "bench-scale.json (or bench-scale.partial.json)",
    )


def _series(
    group: str, what: str, unit: str, xs: list[float], ys: list, at: Mapping[str, float]
) -> dict[str, Any]:
    """A measured series, its fitted law, and the law's values at the sizes in ``at``."""
    key = "world_sizes" if group == "world" else "sizes"
    pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
    out: dict[str, Any] = {"group": group, "what": what, "unit": unit,
                           key: [p[0] for p in pairs], "values": [p[1] for p in pairs]}  # fmt: skip
    if len(pairs) >= 2:
        law = fit([p[0] for p in pairs], [p[1] for p in pairs])
        out["fit"] = law.to_dict()
        if not law.trusted:
            out["not_modelled"] = law.refusal
        elif at:
            out["at"] = {label: law.at(x) for label, x in at.items()}
            out["at_sizes"] = dict(at)
    return out


def _judged(name: str, series: dict[str, Any]) -> dict[str, Any]:
    if "at" in series and "fit" in series:  # (a modelled phase is judged as it is made)
        _judge(name, series, Fit.from_dict(series["fit"]).at)
    return series


def _first_over(value: Callable[[float], float], budget: float, x_from: float) -> float | None:
    """The smallest size from ``x_from`` (to 10^7 times it) where ``value`` passes
    ``budget``, on a grid of 60 sizes a decade; None if it never does."""
    for x in np.geomspace(x_from, x_from * 1e7, 421):
        if value(float(x)) > budget:
            return float(x)
    return None


def _judge(name: str, series: dict[str, Any], value: Callable[[float], float]) -> None:
    """Note in ``series`` its budget (:data:`BUDGETS`) and the size that passes it."""
    if name in BUDGETS:
        xs = series.get("world_sizes") or series.get("sizes") or [1.0]
        series["budget"] = BUDGETS[name]
        series["over_budget_from"] = _first_over(value, BUDGETS[name], min(xs))


def _world_targets() -> dict[str, float]:
    return {k: n * WORKERS_PER_NODE_AT_SCALE for k, n in SCALES.items()}


def world_series(points: list[dict]) -> dict[str, dict]:
    """Every world-size figure as a series, and the modelled wall time of each phase."""
    at = _world_targets()
    out: dict[str, dict] = {}
    worlds = [p["world"] for p in points]
    for phase, what in (
        ("start", "session start -> first step"),
        ("worker_kill", "worker SIGKILL -> first step of the restarted group"),
        ("node_kill", "node killed -> first step at the smaller size (resharded)"),
        ("node_join", "node joined -> first step at the larger size"),
    ):
        have = [p for p in points if phase in p]
        if len(have) < 2:
            continue
        xs = [p["world"] for p in have]
        out[f"{phase}.wall_s"] = _series(
            "world", f"{what}: wall seconds here (2 shared cores)", "s", xs,
            [p[phase]["wall_s"] for p in have], {},
        )  # fmt: skip
        for figure, unit, label, ys in (
            (
                "head_cpu_s",
                "CPU s",
                "the head side's CPU seconds, less its steady background over the same time",
                [_net_head_cpu(p, phase) for p in have],
            ),
            (
                "worker_cpu_s",
                "CPU s",
                "one worker's CPU seconds",
                [p[phase]["worker_cpu_s"] for p in have],
            ),
        ):
            # inputs of the model below, not carried out on their own
            out[f"{phase}.{figure}"] = _series("world", f"{what}: {label}", unit, xs, ys, {})
        modelled = _modelled(out, phase, xs[0], have[0][phase]["wall_s"])
        if modelled:  # (both laws trusted)
            out[f"{phase}.modelled_s"] = modelled
    step = [p["step"] for p in points]
    alone = [p["compute_alone_s"] for p in points]
    out["step.wall_s"] = _series(
        "world", "a steady step's wall seconds here (2 shared cores)", "s", worlds,
        [s["step_s"] for s in step], {},
    )  # fmt: skip
    for key, what, unit, ys in (
        (
            "step.framework_cpu_s",
            "one rank's CPU seconds a step beyond its compute alone",
            "CPU s",
            [s["worker_cpu_per_step_s"] - a for s, a in zip(step, alone, strict=True)],
        ),
        (
            "step.head_cpu_per_s",
            "head side's CPU seconds a second",
            "CPU s/s",
            [s["head_cpu_per_s"] for s in step],
        ),  # fmt: skip
        (
            "epoch_start_s",
            "an epoch's extra data wait (slowest rank)",
            "s",
            [p.get("epoch_start_s") for p in points],
        ),  # fmt: skip
    ):
        out[key] = _series("world", what, unit, worlds, ys, at)
    return out


def _net_head_cpu(point: dict, phase: str) -> float:
    """The head side's CPU seconds of a phase, less what it spends anyway over as long
    (its steady rate while training at that size: polls, health checks, heartbeats):
    stretched by 2 shared cores, a phase would otherwise seem to cost the head more at
    larger sizes only because it lasts longer here."""
    window = point[phase]
    return window["head_cpu_s"] - point["step"]["head_cpu_per_s"] * window["wall_s"]


def _modelled(series: dict[str, dict], phase: str, x0: float, wall0: float) -> dict[str, Any]:
    """A phase's wall time at scale: the wall time at the smallest size measured plus the
    growth the fits give the head side's CPU and one worker's CPU from there."""
    head, worker = series[f"{phase}.head_cpu_s"], series[f"{phase}.worker_cpu_s"]
    if not all(s.get("fit", {}).get("trusted") for s in (head, worker)):
        return {}
    h, w = Fit.from_dict(head["fit"]), Fit.from_dict(worker["fit"])

    def wall(x: float) -> float:
        # the head's net CPU fell with the size in every phase measured (its steady
        # background over-counts long windows): no growth is taken from a falling law
        return wall0 + max(0.0, h.at(x) - h.at(x0)) + w.at(x) - w.at(x0)

    out = {
        "group": "world",
        "what": f"{phase}: modelled wall seconds at scale",
        "unit": "s",
        "world_sizes": [x0],
        "at": {k: wall(x) for k, x in _world_targets().items()},
        "at_sizes": _world_targets(),
        "formula": f"wall({x0:g}) + max(0, head(N) - head({x0:g})) + worker(N) - worker({x0:g})",
    }
    _judge(f"{phase}.modelled_s", out, wall)
    return out


def model_points(sizes: list[float], workdir: str) -> list[dict]:
    points = []
    for params in sizes:
        d = f"{workdir}/ckpt-{int(params)}"
        saved = torchrun_json(2, RANKS, ["--params", str(params), "--dir", d, "--mode", "save"])
        resharded = torchrun_json(3, RANKS, ["--params", str(params), "--dir", d, "--mode", "load"])
        shutil.rmtree(d, ignore_errors=True)
        assert resharded["universal"] and resharded["from_world"] == 2, resharded
        points.append({**saved, "reshard_load_s": resharded["reshard_load_s"]})
        print(f"model {saved['params']:,} params: save {saved['save_s']:.2f} s, load "
              f"{saved['load_s']:.2f} s, {saved['bytes'] / 1e6:.0f} MB, reshard 2->3 "
              f"{resharded['reshard_load_s']:.2f} s", flush=True)  # fmt: skip
    return points


def model_series(points: list[dict]) -> dict[str, dict]:
    xs = [float(p["params"]) for p in points]
    return {
        f"checkpoint.{k}": _series(
            "model", what, unit, xs, [p[k] for p in points], MODEL_SIZES_AT_SCALE
        )  # fmt: skip
        for k, what, unit in (
            ("save_s", "ZeRO-3 checkpoint written, 2 ranks", "s"),
            ("load_s", "the same read back, 2 ranks", "s"),
            ("bytes", "its bytes", "bytes"),
            ("reshard_load_s", "restored at 3 ranks: converted, then loaded", "s"),
        )
    }


def data_points(args: argparse.Namespace, workdir: str) -> dict[str, list[dict]]:
    ledger = []
    for n in args.samples:
        ledger.append({"samples": n, **dataset.ledger_point(int(n), workdir)})
        print(f"ledger {n:.0e} ids: {ledger[-1]}", flush=True)
    merges = []
    for m in args.merged:
        merges.append({"merged": m, "merge_s": dataset.merge_point(int(m))})
        print(f"ledger merge of {m:.0e} ids: {merges[-1]['merge_s']:.3f} s", flush=True)
    checks = []
    for n in args.samples:
        path, shards = f"{workdir}/split-{int(n)}", dataset.shards_of(int(n))
        dataset.make_split(path, shards)
        checks.append({"samples": n, "shards": shards, **dataset.config_point(path)})
        shutil.rmtree(path, ignore_errors=True)
        print(f"config checks, {checks[-1]['shards']} shards: {checks[-1]}", flush=True)
    return {"ledger": ledger, "merge": merges, "checks": checks}


def data_series(points: dict[str, list[dict]]) -> dict[str, dict]:
    merged_at = {k: w * SAMPLES_PER_WORKER * CHECKPOINT_EVERY for k, w in _world_targets().items()}
    ledger, merges, checks = points["ledger"], points["merge"], points["checks"]
    xs = [p["samples"] for p in ledger]
    cx = [p["samples"] for p in checks]
    out = {
        f"ledger.{k}": _series("data", what, unit, xs, [p[k] for p in ledger], SAMPLES_AT_SCALE)
        for k, what, unit in (
            ("bytes", "exactly-once bitmaps in a checkpoint", "bytes"),
            ("save_s", "their write (rank 0, every checkpoint)", "s"),
            ("load_s", "their read (every resume)", "s"),
        )
    }
    out["ledger.merge_s"] = _series(
        "data",
        "rank 0 folds a checkpoint's trained ids into the bitmap (x: ids merged)",
        "s",
        [p["merged"] for p in merges],
        [p["merge_s"] for p in merges],
        merged_at,
    )
    for k, what, unit in (
        ("config_s", "checks before Ray starts (every shard's footer)", "s"),
        ("state_bytes", "trainer_state.json (the resume state and data record)", "bytes"),
        ("worker_args_bytes", "what the driver sends each worker it starts", "bytes"),
    ):
        ys = [p.get(k) for p in checks]  # (worker_args_bytes: not in the first runs)
        out[f"data.{k}"] = _series("data", what, unit, cx, ys, SAMPLES_AT_SCALE)
    return out


def analyse(report: dict[str, Any]) -> dict[str, Any]:
    """The series, their laws and the modelled values from the points measured; the
    table and the figures."""
    points = report["points"]
    series = {
        **(data_series(points["data"]) if "data" in points else {}),
        **(model_series(points["model"]) if "model" in points else {}),
        **(world_series(points["world"]) if "world" in points else {}),
    }
    report["series"] = {name: _judged(name, s) for name, s in series.items()}
    report["scales"] = {
        "workers_per_node": WORKERS_PER_NODE_AT_SCALE,
        "nodes": SCALES,
        "samples_per_worker_step": SAMPLES_PER_WORKER,
        "checkpoint_every_steps": CHECKPOINT_EVERY,
    }
    report["table"] = markdown(report)
    report["figures"] = figures(report)
    print(report["table"], flush=True)
    return report


def _keep(report: dict[str, Any]) -> None:
    """What is measured so far, in bench-scale.partial.json: a failure further on in an
    hour's run loses nothing before it (``--points`` analyses it)."""
    with open("bench-scale.partial.json", "w") as f:
        json.dump(report, f)


def measure(args: argparse.Namespace) -> dict:
    if args.points:
        with open(args.points) as f:
            return analyse(json.load(f))
    if args.quick:
        args.worlds, args.params, args.merged = QUICK["worlds"], QUICK["params"], QUICK["merged"]
    workdir = tempfile.mkdtemp(prefix="bench-scale-")
    report: dict[str, Any] = {"points": {}, "date": time.strftime("%Y-%m-%d")}
    started = time.perf_counter()
    try:
        if "data" not in args.skip:
            report["points"]["data"] = data_points(args, workdir)
            _keep(report)
        if "model" not in args.skip:
            report["points"]["model"] = model_points(args.params, workdir)
            _keep(report)
        if "world" not in args.skip:
            worlds = []
            for n in args.worlds:
                point = measure_world(n, args.per_node, f"{workdir}/world-{n}")
                point["compute_alone_s"] = compute_alone_s(n)
                worlds.append(point)
                print(f"world {n}: " + json.dumps(point), flush=True)
                _keep({**report, "points": {**report["points"], "world": worlds}})
            report["points"]["world"] = worlds
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report["bench_s"] = time.perf_counter() - started
    return analyse(report)
