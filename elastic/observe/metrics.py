"""The seed studies' run metrics, from a run's own record (``metrics.jsonl``).

*Time to target*: the run's time until a validation first met ``metrics.target`` (e.g.
``val/accuracy>=0.9``), which counts convergence, not only samples/s. A run's time is
counted only while one of its driver sessions ran: a run stopped and re-run later (a
requeued batch job) does not count the queue; restarts, failures and lost work inside
a session do count, as they cost the user time.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from elastic.errors import ConfigError
from elastic.observe.tracking import HISTORY_FILE, json_text

SESSION_START, SESSION_END = "session_start", "session_end"

_TARGET = re.compile(r"^\s*([A-Za-z0-9_.\-]+/[A-Za-z0-9_.\-/]+)\s*(>=|<=)\s*(\S+)\s*$")


@dataclass(frozen=True)
class Target:
    """A goal on one logged metric: ``key`` ``op`` ``value``."""

    key: str
    op: str
    value: float

    def met(self, value: float) -> bool:
        return value >= self.value if self.op == ">=" else value <= self.value

    def __str__(self) -> str:
        return f"{self.key}{self.op}{self.value:g}"


def parse_target(text: str) -> Target:
    """``metrics.target`` -> Target, or a ConfigError naming the key and the fix."""
    m = _TARGET.match(text)
    value = None
    if m:
        try:
            value = float(m.group(3))
        except ValueError:
            value = None
    if m is None or value is None:
        raise ConfigError(
            f"metrics.target={text!r} is not valid: write METRIC>=NUMBER or METRIC<=NUMBER "
            "with a logged metric, e.g. 'metrics.target=val/accuracy>=0.9' (quote it in the "
            "shell)"
        )
    return Target(m.group(1), m.group(2), value)


def read_records(run_dir: str) -> list[dict[str, Any]]:
    """Every record of the run's history, in the order written (all sessions). A line
    that is not a record (cut off by a full disk or a kill) is left out here; the next
    start of the run moves it aside and says so (:func:`repair_records`)."""
    path = os.path.join(run_dir, HISTORY_FILE)
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        records = [_record(line) for line in f if line.strip()]
    return [r for r in records if r is not None]


def _record(line: bytes) -> dict[str, Any] | None:
    try:
        found = json.loads(line)
    except ValueError:  # a torn line, or bytes that are no UTF-8 JSON
        return None
    return found if isinstance(found, dict) else None


def repair_records(run_dir: str) -> str | None:
    """Before a run (re)starts: a history whose lines are not all records (its last one
    cut off when the disk filled, or a kill in the middle of a write; the next record
    would be appended to the torn one) gets those lines moved to ``metrics.jsonl.damaged``
    and the rest kept as written. Returns the warning to print, None when the history is
    whole."""
    path = os.path.join(run_dir, HISTORY_FILE)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    if lines and not lines[-1].endswith(b"\n") and _record(lines[-1]) is not None:
        with open(path, "ab") as f:  # a whole record, only its newline lost: end it
            f.write(b"\n")
        lines[-1] += b"\n"
    bad = [i for i, line in enumerate(lines) if line.strip() and _record(line) is None]
    if not bad:
        return None
    with open(path + ".damaged", "ab") as f:
        f.writelines(lines[i].rstrip(b"\n") + b"\n" for i in bad)
    tmp = path + ".tmp"
    skip = set(bad)
    with open(tmp, "wb") as f:
        f.writelines(line for i, line in enumerate(lines) if i not in skip)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    where = ", ".join(str(i + 1) for i in bad[:5]) + (" ..." if len(bad) > 5 else "")
    return (
        f"{path}: {len(bad)} line(s) that are not whole records (line {where}: cut off, e.g. "
        f"by a full disk) moved to {HISTORY_FILE}.damaged; the other records are kept"
    )


def append_record(run_dir: str, record: dict[str, Any]) -> None:
    """One record from the driver (rank 0 appends and flushes its own records as well;
    the driver writes only before its workers start and after they end)."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, HISTORY_FILE), "a") as f:
        f.write(json_text(record) + "\n")


def sessions(records: Iterable[dict[str, Any]]) -> list[tuple[float, float]]:
    """(start, end) wall-clock times of the run's driver sessions. A session ends at its
    end record, or (a driver killed outright) at its last record."""
    out: list[list[float]] = []
    for r in records:
        if r.get("event") == SESSION_START:
            out.append([r["time"], r["time"]])
        elif out and "time" in r:
            out[-1][1] = max(out[-1][1], r["time"])
    return [(a, b) for a, b in out]


def run_seconds(spans: list[tuple[float, float]], at: float) -> float:
    """Seconds of the run's sessions before wall-clock time ``at``."""
    return sum(max(0.0, min(end, at) - start) for start, end in spans if start <= at)


def time_to_target(records: list[dict[str, Any]], target: Target) -> float | None:
    """Run seconds until the first record whose ``target.key`` met the target; None if
    none did. A validation that left rows out (``val/rows_left_out``: their loss was not
    finite, or their labels beyond the model's) does not count: its metrics are not
    the split's."""
    spans = sessions(records)
    for r in records:
        if target.key.startswith("val/") and r.get("val/rows_left_out"):
            continue
        value = r.get(target.key)
        if isinstance(value, (int, float)) and target.met(value):
            return run_seconds(spans, r["time"]) if spans else None
    return None
