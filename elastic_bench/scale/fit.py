"""How a measured cost grows, and where that puts it at sizes never measured.

A series (sizes x > 0, values y) is fitted by least squares to a constant, a line in
log(x), a line in x, and (from 5 points) a quadratic opening upward (one opening
downward turns over and goes negative past the sizes measured: never a law to carry
out). The law kept is the one that
*extrapolates* best on the points themselves: each candidate, fitted to every size but
the largest, predicts the largest, and the candidate that misses it least (relatively)
wins. A miss within 5 points, or 3 noise widths, of the best is as good (the noise:
the points' scatter about the two-parameter-or-fewer law that fits them all best, over
the largest value), and the simplest such law is kept, so that noise around a flat cost
stays a constant and a second parameter must earn its place. (Judged on earlier points
too, a fixed cost that dominates the smallest sizes made a line look worse than log(x)
at predicting the middle ones, and a linear cost was carried out as a logarithmic one.)
The kept law is then fitted to every point; if it then misses the largest size's value
by more than that tolerance, no law describes the series where it matters most, and it
is not carried out (:attr:`Fit.trusted`); nor is the line through only 2 points, which
nothing tests (a cost flat in truth came out 60x at 1,000 nodes from two noisy points).

Pure numpy, no I/O: tested against series whose law is known."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Design = Callable[[np.ndarray], np.ndarray]

# simplest first: a tie goes to the earlier
MODELS: dict[str, Design] = {
    "constant": lambda x: np.ones((len(x), 1)),
    "log": lambda x: np.c_[np.ones(len(x)), np.log(x)],
    "linear": lambda x: np.c_[np.ones(len(x)), x],
    "quadratic": lambda x: np.c_[np.ones(len(x)), x, x * x],
}
FORMULAS = {
    "constant": "a",
    "log": "a + b ln x",
    "linear": "a + b x",
    "quadratic": "a + b x + c x^2",
}
QUADRATIC_FROM = 5  # points: fewer, and a parabola through noise passes for a law
AS_GOOD = (0.05, 3.0)  # a miss within 5 points, or 3 noise widths, of the best


@dataclass(frozen=True)
class Fit:
    model: str
    params: tuple[float, ...]
    rms: float
    """Root mean square of the kept law's residuals over every point, in y's unit."""
    misses: dict[str, float]
    """Each candidate's relative miss predicting the largest size from the others."""
    off_by: float = 0.0
    """How far (relatively) the kept law, fitted to every point, is from the largest
    size's value: past the tolerance, no law describes the series where it matters most
    (:attr:`trusted` is False) and nothing should be carried out from it."""
    tolerance: float = 1.0

    @property
    def checked(self) -> bool:
        """The law was chosen by predicting the largest size from the others: 3 or more
        points. Through 2 there is only the line, which nothing has tested."""
        return bool(self.misses)

    @property
    def trusted(self) -> bool:
        return self.checked and self.off_by <= self.tolerance

    @property
    def refusal(self) -> str:
        """Why an untrusted law is not carried out, in a line ('' when it is)."""
        if not self.checked:
            return (
                "not modelled: 2 sizes, and a law is only carried out when it predicts "
                "the largest from the others (3 or more)"
            )
        if not self.trusted:
            return (
                f"not modelled: the {self.model} law misses the largest size by "
                f"{100 * self.off_by:.0f}% (tolerance {100 * self.tolerance:.0f}%)"
            )
        return ""

    def at(self, x: float) -> float:
        return float((MODELS[self.model](np.array([float(x)])) @ np.array(self.params))[0])

    @property
    def formula(self) -> str:
        text = FORMULAS[self.model]
        for name, value in zip("abc", self.params, strict=False):
            text = text.replace(name, f"{value:.4g}", 1)
        return text

    @property
    def superlinear(self) -> bool:
        """Grows faster than a line over the sizes fitted (a quadratic, c > 0)."""
        return self.model == "quadratic" and self.params[2] > 0

    @classmethod
    def from_dict(cls, d: dict) -> Fit:
        """The law :meth:`to_dict` wrote (bench-scale.json's ``fit``)."""
        return cls(d["model"], tuple(d["params"]), d["rms"], d["misses"],
                   d.get("off_by", 0.0), d.get("tolerance", 1.0))  # fmt: skip

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "formula": FORMULAS[self.model],
            "params": list(self.params),
            "fitted": self.formula,
            "rms": self.rms,
            "misses": self.misses,
            "off_by": self.off_by,
            "tolerance": self.tolerance,
            "trusted": self.trusted,
        }


def _solve(model: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    params, *_ = np.linalg.lstsq(MODELS[model](x), y, rcond=None)
    return params


def _scatter(model: str, x: np.ndarray, y: np.ndarray) -> float:
    """The points' standard deviation about ``model`` fitted to all of them."""
    a = MODELS[model](x)
    residuals = a @ _solve(model, x, y) - y
    return math.sqrt(float((residuals**2).sum()) / max(1, len(x) - a.shape[1]))


def _opens_upward(xs: np.ndarray, ys: np.ndarray) -> bool:
    """Whether the parabola through every point, and the one through every point but the
    largest, both open upward (c > 0). One opening downward turns over past its vertex,
    close to the sizes measured: carried out 100x further it gives a cost that falls,
    then goes negative (a 300M-parameter checkpoint's write, 4.3 s, came out at -8.9 s
    for 1B parameters). Such a series is sublinear or noisy there: a line or a log,
    not a parabola, is its law."""
    return bool(_solve("quadratic", xs, ys)[2] > 0 and _solve("quadratic", xs[:-1], ys[:-1])[2] > 0)


def fit(x: list[float], y: list[float]) -> Fit:
    """The law of ``y`` over ``x`` that extrapolates best (see the module docstring)."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"a fit needs 2 or more (x, y) pairs, got {len(xs)} x and {len(ys)} y")
    if (xs <= 0).any() or not np.isfinite(ys).all():
        raise ValueError(f"sizes must be positive and values finite: x={list(x)}, y={list(y)}")
    order = np.argsort(xs, kind="stable")
    xs, ys = xs[order], ys[order]
    n = len(xs)
    if n == 2:  # nothing to choose by: the line through both, not trusted (see checked)
        params = _solve("linear", xs, ys)
        return Fit("linear", tuple(float(p) for p in params), 0.0, {})
    params_of = {m: MODELS[m](xs[:1]).shape[1] for m in MODELS}
    candidates = [
        m for m, k in params_of.items() if k < n and (m != "quadratic" or n >= QUADRATIC_FROM)
    ]
    if "quadratic" in candidates and not _opens_upward(xs, ys):
        candidates.remove("quadratic")
    scale = max(float(np.abs(ys).max()), 1e-300)
    misses: dict[str, float] = {}
    for m in candidates:
        predicted = float((MODELS[m](xs[-1:]) @ _solve(m, xs[:-1], ys[:-1]))[0])
        misses[m] = abs(predicted - ys[-1]) / max(abs(float(ys[-1])), 1e-3 * scale)
    scatter = min(_scatter(m, xs, ys) for m in ("constant", "log", "linear"))
    points, widths = AS_GOOD
    tolerance = max(points, widths * scatter / max(abs(float(ys[-1])), 1e-3 * scale))
    best = min(misses.values())
    kept = next(m for m in candidates if misses[m] <= best + tolerance)
    params = _solve(kept, xs, ys)
    fitted = MODELS[kept](xs) @ params
    rms = math.sqrt(float(np.mean((fitted - ys) ** 2)))
    off_by = abs(float(fitted[-1] - ys[-1])) / max(abs(float(ys[-1])), 1e-3 * scale)
    return Fit(kept, tuple(float(p) for p in params), rms, misses, off_by, tolerance)
