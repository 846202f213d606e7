"""Each worker's own figures over a run, from its records (``metrics.jsonl``): the
per-rank series the loop logs every interval (``worker_<figure>/rank<r>``) and the
report's plot of each rank's compute time per step, stragglers marked."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

WORKER_KEY = re.compile(r"^worker_(?P<figure>[a-z_]+)/rank(?P<rank>\d+)$")


def rank_series(records: list[dict[str, Any]], figure: str = "compute_s") -> dict[int, list]:
    """``{rank: [(step, world_size, value), ...]}`` of one per-rank figure (a rank is a
    position in its worker group: after a resize rank r may be another node)."""
    out: dict[int, list] = {}
    for rec in records:
        for key, value in rec.items():
            m = WORKER_KEY.match(key)
            if m and m["figure"] == figure and isinstance(value, (int, float)):
                out.setdefault(int(m["rank"]), []).append(
                    (rec["step"], rec.get("train/world_size"), float(value))
                )
    return out


def worker_rows(runs: list[Any]) -> list[dict[str, Any]]:
    """Per run: its final group's slowest / median compute time, and the stragglers found."""
    return [
        {
            "run": run.name,
            "slowest_median_ratio": run.summary.get("slowest_median_ratio"),
            "stragglers": [
                {k: e.get(k) for k in ("step", "rank", "node", "ratio")}
                for e in run.summary.get("events") or []
                if e.get("event") == "straggler"
            ],
        }
        for run in runs
    ]


def worker_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The report's Workers section (Markdown lines)."""
    lines = [
        "",
        "## Workers",
        "",
        "| run | slowest / median compute time | stragglers found (step: rank, node, ratio) |",
        "|---|---|---|",
    ]
    for w in rows:
        ratio = "n/a" if w["slowest_median_ratio"] is None else f"{w['slowest_median_ratio']:.2f}"
        found = "; ".join(
            f"{e['step']}: rank {e['rank']}, {e['node']}, {e['ratio']}x" for e in w["stragglers"]
        )
        lines.append(f"| {w['run']} | {ratio} | {found or '-'} |")
    lines += [
        "",
        "Compute time: forward + local backward + optimizer per step, without the wait in "
        "the collectives (in lock-step every rank waits for the slowest).",
    ]
    return lines


def worker_times_plot(runs: list[Any], out: Path) -> str | None:
    """``worker_times.png``: every run's ranks' compute time per step over its steps,
    straggler events marked; None when no run has per-rank figures."""
    with_series = [(run, rank_series(run.records)) for run in runs]
    with_series = [(run, s) for run, s in with_series if s]
    if not with_series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(with_series), 1, figsize=(7, 2.6 * len(with_series)), squeeze=False
    )
    for ax, (run, series) in zip(axes[:, 0], with_series, strict=True):
        for rank, points in sorted(series.items()):
            ax.plot(
                [p[0] for p in points], [1e3 * p[2] for p in points], lw=1, label=f"rank {rank}"
            )
        for e in run.records:
            if e.get("event") == "straggler":
                ax.axvline(e["step"], color="red", alpha=0.4, linestyle=":")
        ax.set(ylabel="compute ms/step", title=f"{run.name} (red: a straggler found)")
        ax.legend(fontsize="small")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out / "worker_times.png", dpi=120)
    plt.close(fig)
    return "worker_times.png"
