"""bench-scale.json as figures and a Markdown table: each series measured (points) beside
its fitted law carried out to the sizes modelled (a line), one figure a group
(``bench-scale-world.png``, ``-model.png``, ``-data.png``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from elastic_bench.scale.fit import Fit

GROUP_X = {"world": "workers", "model": "parameters", "data": "samples (merge: ids merged)"}


def law(series: dict[str, Any]) -> Fit | None:
    f = series.get("fit")
    return None if f is None else Fit.from_dict(f)


def sizes(series: dict[str, Any]) -> list[float]:
    return series.get("world_sizes") or series.get("sizes") or []


def _number(v: float, unit: str) -> str:
    if unit == "bytes":
        for div, name in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
            if abs(v) >= div:
                return f"{v / div:.3g} {name}"
        return f"{v:.0f} B"
    return f"{v:.3g} {unit}" if abs(v) < 1e4 else f"{v:,.0f} {unit}"


def markdown(report: dict[str, Any]) -> str:
    """A row a series: what, the sizes and values measured, the law, the modelled values,
    and where it has a budget, the first size (x) past it."""
    lines = [
        "| series | measured (size: value) | law (x: the size) | modelled | budget: past it from |",
        "|---|---|---|---|---|",
    ]
    for name, s in report["series"].items():
        unit = s.get("unit", "")
        pairs = zip(sizes(s), s.get("values", []), strict=False)
        measured = ", ".join(f"{x:g}: {_number(y, unit)}" for x, y in pairs)
        fitted = s.get("fit", {}).get("fitted", "")
        at = "; ".join(f"{k}: {_number(v, unit)}" for k, v in s.get("at", {}).items())
        at = at or s.get("not_modelled", "")
        judged = ""
        if "budget" in s:
            over = s.get("over_budget_from")
            past = "never" if over is None else f"{over:.3g}"
            judged = f"{_number(s['budget'], unit)}: {past}"
        lines.append(f"| `{name}`: {s['what']} | {measured} | {fitted} | {at} | {judged} |")
    return "\n".join(lines) + "\n"


def figures(report: dict[str, Any], prefix: str = "bench-scale") -> list[str]:
    """One PNG a group of series (log-log): the points, the law to the largest size
    modelled. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for group, xlabel in GROUP_X.items():
        names = [n for n, s in report["series"].items()
                 if s.get("group") == group and s.get("values")]  # fmt: skip
        if not names:
            continue
        cols = min(4, len(names))
        rows = math.ceil(len(names) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
        for ax, name in zip(axes.flat, names, strict=False):
            s = report["series"][name]
            xs, ys = np.array(sizes(s), float), np.array(s["values"], float)
            ax.plot(xs, ys, "o", color="C0", label="measured")
            fitted = law(s)
            if fitted is not None:
                modelled = list(s.get("at_sizes", {}).values())
                grid = np.geomspace(xs.min(), max([*xs, *modelled]), 100)
                ax.plot(grid, [fitted.at(x) for x in grid], "-", color="C1",
                        label=f"{fitted.model} law")  # fmt: skip
                for x in modelled:
                    ax.axvline(x, color="grey", lw=0.5, ls=":")
            ax.set_xscale("log")
            if (ys > 0).all():
                ax.set_yscale("log")
            ax.set_title(name, fontsize=9)
            ax.set_xlabel(xlabel, fontsize=8)
            ax.set_ylabel(s.get("unit", ""), fontsize=8)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(names) :]:
            ax.axis("off")
        fig.tight_layout()
        path = f"{prefix}-{group}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written
