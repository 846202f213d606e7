"""The layout the architecture promises, checked: modules a reader can hold (none in
elastic/ over 500 lines), the class that owns the training step small (its parts live in
their own modules), and no dated measurement in the code or the configs (a docstring
says what and why; figures and their dates live in docs/performance.md and git)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATED = re.compile(r"\b(19|20)\d\d-[01]\d-[0-3]\d\b")


def test_no_module_of_the_product_is_over_500_lines():
    long = {
        str(p.relative_to(REPO)): n
        for p in (REPO / "elastic").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, f"split these modules along their sections: {long}"


def test_the_class_that_owns_the_step_stays_small():
    tree = ast.parse((REPO / "elastic/train/step_loop.py").read_text())
    (loop,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StepLoop"]
    methods = [f.name for f in loop.body if isinstance(f, ast.FunctionDef)]
    attributes = {
        n.attr
        for n in ast.walk(loop)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
        and isinstance(n.ctx, ast.Store)
    }
    lines = (loop.end_lineno or 0) - loop.lineno + 1
    assert lines <= 250, f"StepLoop is {lines} lines: move a part of the step out"
    assert len(methods) <= 14, f"StepLoop has {len(methods)} methods: {methods}"
    assert len(attributes) <= 22, f"StepLoop has {len(attributes)}: {sorted(attributes)}"


def test_no_dated_measurement_in_the_code_or_the_configs():
    found = [
        f"{p.relative_to(REPO)}:{i}: {line.strip()}"
        for folder, pattern in (("elastic", "*.py"), ("conf", "*.yaml"))
        for p in (REPO / folder).rglob(pattern)
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if DATED.search(line)
    ]
    assert not found, "dated figures belong in docs/performance.md: " + "; ".join(found)
