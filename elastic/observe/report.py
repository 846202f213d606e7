"""A scaling study's report from its runs' own records: ``launch/report.py``.

Each run's ``summary.json`` (throughput, time breakdown, time to target, world sizes)
and its history (``metrics.jsonl``: validations, events, driver sessions) give:
throughput vs workers with scaling efficiency, the time breakdown per world size,
the validation metric against the run's time with restarts and failures marked, and
the learning speedup T_1 / T_N (time to the target metric). Repeats of a world size
are averaged and their spread shown.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic.observe.metrics import Target, parse_target, read_records, run_seconds, sessions
from elastic.observe.summary import PHASES as RUN_PHASES
from elastic.observe.workers import worker_lines, worker_rows, worker_times_plot

PHASES = (*RUN_PHASES, "other")
MARKED_EVENTS = ("restart", "resume", "preempted", "node_drain")


@dataclass
class Run:
    """One run as its records tell it."""

    summary_path: Path
    summary: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def world_sizes(self) -> list[int]:
        return list(self.summary.get("world_sizes") or [])

    @property
    def label(self) -> str:
        sizes = self.world_sizes
        return str(sizes[0]) if len(sizes) == 1 else "elastic " + "->".join(map(str, sizes))

    @property
    def name(self) -> str:
        return str(self.summary.get("run_name") or self.summary_path.parent.name)

    def clock(self, at: float) -> float:
        """Run seconds (time in the run's sessions) at wall-clock time ``at``."""
        return run_seconds(sessions(self.records), at)


def find_runs(paths: list[str]) -> list[Run]:
    """Every run whose summary.json lies under ``paths`` (a Hydra multirun directory,
    run output directories, or summary files), with its history."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            found.append(p)
        elif p.is_dir():
            found += sorted(p.rglob("summary.json"))
        else:
            raise FileNotFoundError(f"{p} does not exist: give a multirun or run directory")
    runs = []
    for path in found:
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(
                f"{path} is not a readable summary.json ({e}): remove it or re-run its job"
            ) from None
        run_dir = summary.get("run_dir")
        if not run_dir and summary.get("checkpoint"):
            run_dir = os.path.dirname(summary["checkpoint"])
        records = read_records(run_dir) if run_dir else []
        runs.append(Run(path, summary, records))
    if not runs:
        raise FileNotFoundError(f"no summary.json under {', '.join(paths)}: nothing to report")
    return runs


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _fmt(value: float | None, spec: str = ".3g", std: float | None = None) -> str:
    if value is None:
        return "n/a"
    text = format(value, spec)
    return f"{text} ± {format(std, spec)}" if std else text


@dataclass
class Group:
    """The runs at one fixed world size."""

    world: int
    runs: list[Run]

    def values(self, key: str) -> list[float]:
        return [r.summary[key] for r in self.runs if r.summary.get(key) is not None]

    @property
    def samples_per_s(self) -> tuple[float | None, float | None]:
        return _mean_std(self.values("samples_per_s"))

    @property
    def time_to_target(self) -> tuple[float | None, float | None]:
        return _mean_std(self.values("time_to_target_s"))

    def breakdown(self) -> dict[str, float]:
        shares = [r.summary.get("time_breakdown") or {} for r in self.runs]
        return {p: statistics.fmean(s.get(p, 0.0) for s in shares) for p in PHASES}

    def final(self, key: str) -> tuple[float | None, float | None]:
        name = key.removeprefix("val/")
        vals = [r.summary["val"][name] for r in self.runs if name in (r.summary.get("val") or {})]
        return _mean_std(vals)


def groups(runs: list[Run]) -> list[Group]:
    by_world: dict[int, list[Run]] = {}
    for r in runs:
        if len(r.world_sizes) == 1:
            by_world.setdefault(r.world_sizes[0], []).append(r)
    return [Group(w, by_world[w]) for w in sorted(by_world)]


def run_target(runs: list[Run]) -> Target | None:
    """The runs' metrics.target (the first run that has one)."""
    text = next((r.summary["target"] for r in runs if r.summary.get("target")), None)
    return parse_target(text) if text else None


def metric_key(runs: list[Run]) -> str:
    """The validation metric to follow: the runs' target metric, else val/loss."""
    target = run_target(runs)
    return target.key if target else "val/loss"


def tables(runs: list[Run]) -> dict[str, list[dict[str, Any]]]:
    """The report's numbers, row by row (also written as report.json)."""
    gs = groups(runs)
    base = gs[0] if gs else None
    base_rate = base.samples_per_s[0] if base else None
    base_t = base.time_to_target[0] if base else None
    key = metric_key(runs)
    throughput, breakdown, learning = [], [], []
    for g in gs:
        rate, rate_std = g.samples_per_s
        t, t_std = g.time_to_target
        speedup = rate / base_rate if rate and base_rate else None
        throughput.append(
            {
                "world_size": g.world,
                "runs": len(g.runs),
                "samples_per_s": rate,
                "samples_per_s_std": rate_std,
                "samples_per_s_per_worker": rate / g.world if rate else None,
                "speedup": speedup,
                # against perfect scaling from the smallest world size measured
                "scaling_efficiency": speedup * base.world / g.world if speedup and base else None,
            }
        )
        breakdown.append({"world_size": g.world, **g.breakdown()})
        final, final_std = g.final(key)
        learning.append(
            {
                "world_size": g.world,
                "runs": len(g.runs),
                "reached": len(g.values("time_to_target_s")),
                "time_to_target_s": t,
                "time_to_target_s_std": t_std,
                "learning_speedup": base_t / t if t and base_t else None,
                "final_metric": final,
                "final_metric_std": final_std,
            }
        )
    return {
        "throughput": throughput,
        "breakdown": breakdown,
        "learning": learning,
        "workers": worker_rows(runs),
    }


def _val_series(run: Run, key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in run.records:
        if isinstance(r.get(key), (int, float)):
            xs.append(run.clock(r["time"]))
            ys.append(float(r[key]))
    return xs, ys


def plots(runs: list[Run], rows: dict[str, list[dict[str, Any]]], out: Path) -> list[str]:
    """The PNG figures; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    tp, bd = rows["throughput"], rows["breakdown"]
    if tp:
        fig, ax = plt.subplots(figsize=(6, 4))
        ws = [r["world_size"] for r in tp]
        for g in groups(runs):
            ax.scatter([g.world] * len(g.runs), g.values("samples_per_s"), color="C0", s=12)
        ax.errorbar(
            ws,
            [r["samples_per_s"] for r in tp],
            yerr=[r["samples_per_s_std"] or 0 for r in tp],
            marker="o",
            label="measured (mean ± std)",
        )
        base = tp[0]
        if base["samples_per_s"]:
            ideal = [base["samples_per_s"] * w / base["world_size"] for w in ws]
            ax.plot(ws, ideal, "--", color="gray", label="perfect scaling")
        for r in tp:
            if r["scaling_efficiency"] is not None:
                ax.annotate(
                    f"{100 * r['scaling_efficiency']:.0f}%",
                    (r["world_size"], r["samples_per_s"]),
                    textcoords="offset points",
                    xytext=(6, -12),
                )
        ax.set(xlabel="workers", ylabel="samples/s", title="Throughput and scaling efficiency")
        ax.set_xticks(ws)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "throughput.png", dpi=120)
        plt.close(fig)
        names.append("throughput.png")
    if bd:
        fig, ax = plt.subplots(figsize=(6, 4))
        labels = [str(r["world_size"]) for r in bd]
        bottom = [0.0] * len(bd)
        for i, phase in enumerate(PHASES):
            heights = [100 * r[phase] for r in bd]
            ax.bar(labels, heights, bottom=bottom, label=phase, color=f"C{i}")
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.set(xlabel="workers", ylabel="% of training time", title="Where the time goes")
        ax.legend(fontsize="small", loc="lower right")
        fig.tight_layout()
        fig.savefig(out / "time_breakdown.png", dpi=120)
        plt.close(fig)
        names.append("time_breakdown.png")
    key = metric_key(runs)
    fig, ax = plt.subplots(figsize=(7, 4))
    colors: dict[str, str] = {}
    for run in runs:
        xs, ys = _val_series(run, key)
        if not xs:
            continue
        color = colors.setdefault(run.label, f"C{len(colors)}")
        ax.plot(xs, ys, marker=".", color=color, label=f"{run.label} workers ({run.name})")
        for e in run.records:
            if e.get("event") in MARKED_EVENTS and "time" in e:
                ax.axvline(run.clock(e["time"]), color=color, alpha=0.35, linestyle=":")
    target = run_target(runs)
    if target:
        ax.axhline(
            target.value, color="black", linestyle="--", linewidth=1, label=f"target {target}"
        )
    ax.set(
        xlabel="run time (s)",
        ylabel=key,
        title="Validation vs time (dotted: restarts, resumes, drains)",
    )
    if colors:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out / "val_vs_time.png", dpi=120)
    plt.close(fig)
    names.append("val_vs_time.png")
    learn = [r for r in rows["learning"] if r["learning_speedup"] is not None]
    if tp:
        fig, ax = plt.subplots(figsize=(6, 4))
        ws = [r["world_size"] for r in tp]
        ax.plot(ws, [w / ws[0] for w in ws], "--", color="gray", label="ideal")
        ax.plot(ws, [r["speedup"] for r in tp], marker="o", label="throughput speedup")
        if learn:
            ax.plot(
                [r["world_size"] for r in learn],
                [r["learning_speedup"] for r in learn],
                marker="s",
                label="learning speedup T1/TN",
            )
        ax.set(xlabel="workers", ylabel=f"speedup vs {ws[0]} worker(s)", title="Speedup")
        ax.set_xticks(ws)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "speedup.png", dpi=120)
        plt.close(fig)
        names.append("speedup.png")
    if (name := worker_times_plot(runs, out)) is not None:
        names.append(name)
    return names


def markdown(runs: list[Run], rows: dict[str, list[dict[str, Any]]], images: list[str]) -> str:
    key = metric_key(runs)
    target = run_target(runs)
    experiments = sorted({str(r.summary.get("experiment") or "?") for r in runs})
    lines = [
        f"# Scaling report: {', '.join(experiments)}",
        "",
        f"{len(runs)} runs. Every figure comes from the runs' own records (summary.json, "
        "metrics.jsonl); repeats at a world size are shown as mean ± std.",
        "",
        "## Throughput",
        "",
        "| workers | runs | samples/s | per worker | speedup | scaling efficiency |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows["throughput"]:
        eff = r["scaling_efficiency"]
        lines.append(
            f"| {r['world_size']} | {r['runs']} | "
            f"{_fmt(r['samples_per_s'], ',.0f', r['samples_per_s_std'])} | "
            f"{_fmt(r['samples_per_s_per_worker'], ',.0f')} | {_fmt(r['speedup'], '.2f')} | "
            f"{'n/a' if eff is None else f'{100 * eff:.0f}%'} |"
        )
    lines += [
        "",
        "Samples/s is steady state (from the end of each run's first step). Scaling "
        "efficiency: speedup / (workers / the smallest world size measured).",
        "",
        "## Where the time goes (% of training time)",
        "",
        "| workers | " + " | ".join(PHASES) + " |",
        "|---|" + "---|" * len(PHASES),
    ]
    for r in rows["breakdown"]:
        lines.append(
            f"| {r['world_size']} | " + " | ".join(f"{100 * r[p]:.1f}" for p in PHASES) + " |"
        )
    lines += [
        "",
        "comm is the time in the step's collectives (the gradient reduction and the "
        "ranks' agreement on their steps): it holds the wait for the slowest rank. "
        "data_wait includes the pipeline's start.",
        "",
        f"## Learning: time to {target or 'target (no metrics.target set)'}",
        "",
        f"| workers | runs | reached | time to target (s) | learning speedup T1/TN | final {key} |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows["learning"]:
        lines.append(
            f"| {r['world_size']} | {r['runs']} | {r['reached']}/{r['runs']} | "
            f"{_fmt(r['time_to_target_s'], '.1f', r['time_to_target_s_std'])} | "
            f"{_fmt(r['learning_speedup'], '.2f')} | "
            f"{_fmt(r['final_metric'], '.4g', r['final_metric_std'])} |"
        )
    lines += [
        "",
        "Time to target: the run's time (its driver sessions: start-up, restarts and lost "
        "work included, queue time between sessions not) until a validation first met the "
        "target. Learning speedup: T at the smallest world size / T at N.",
        "",
        "## Runs",
        "",
        "| run | experiment | world sizes | steps | samples/s | time to target (s) | "
        "restarts | summary |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        s = run.summary
        restarts = sum(1 for e in s.get("events") or [] if e.get("event") == "restart")
        lines.append(
            f"| {run.name} | {s.get('experiment')} | {run.label} | {s.get('steps')} | "
            f"{_fmt(s.get('samples_per_s'), ',.0f')} | {_fmt(s.get('time_to_target_s'), '.1f')} "
            f"| {restarts} | {run.summary_path} |"
        )
    lines += worker_lines(rows["workers"])
    lines += ["", "## Figures", ""]
    lines += [f"![{name}]({name})" for name in images]
    return "\n".join(lines) + "\n"


def write_report(paths: list[str], out_dir: str | None = None) -> Path:
    """report.md, report.json and the PNG figures into ``out_dir`` (default: the first
    path, when it is a directory)."""
    runs = find_runs(paths)
    out = Path(out_dir or (paths[0] if Path(paths[0]).is_dir() else "."))
    out.mkdir(parents=True, exist_ok=True)
    rows = tables(runs)
    images = plots(runs, rows, out)
    (out / "report.json").write_text(json.dumps(rows, indent=2) + "\n")
    path = out / "report.md"
    path.write_text(markdown(runs, rows, images))
    return path
