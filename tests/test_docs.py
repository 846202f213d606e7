"""What the docs promise stays true of the code: every summary.json key is documented,
every config key with its default and choices, and the README's code map names every
part of the package."""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from elastic.config.schema import TrainConfig
from elastic.data.formats import FORMATS
from elastic.fields import choices_of
from elastic.models import MODEL_SCHEMAS
from elastic.observe.summary import SUMMARY_KEYS
from elastic.plugins import load_plugins

REPO = Path(__file__).resolve().parent.parent


def test_every_summary_key_is_documented():
    outputs = (REPO / "docs" / "outputs.md").read_text()
    missing = [k for k in SUMMARY_KEYS if f"`{k}`" not in outputs]
    assert not missing, f"summary.json keys not in docs/outputs.md: {missing}"


def test_the_code_map_names_every_package_and_module():
    readme = (REPO / "README.md").read_text()
    code_map = readme.split("## Code map", 1)[1].split("\n## ", 1)[0]
    package = REPO / "elastic"
    parts = [f"elastic/{p.name}/" for p in package.iterdir() if (p / "__init__.py").exists()]
    parts += [f"elastic/{p.name}" for p in package.glob("*.py") if p.name != "__init__.py"]
    missing = [p for p in parts if f"`{p}`" not in code_map]
    assert not missing, f"README code map lacks {missing}"
    for sub in package.iterdir():
        for module in sub.glob("*.py") if sub.is_dir() else []:
            if module.name != "__init__.py":
                assert f"`{module.stem}" in code_map, f"code map lacks {sub.name}/{module.name}"


def _keys(schema: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field[Any]]]:
    """Every key of the dataclass ``schema`` with its field: a section's keys, not the
    section itself (unless it may be null, as data.synthetic: then it is a key too)."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        kinds = typing.get_args(hints[f.name]) or (hints[f.name],)
        section = next((k for k in kinds if dataclasses.is_dataclass(k)), None)
        if section is None or f.default is None:
            yield key, f
        if isinstance(section, type):
            yield from _keys(section, f"{key}.")


def _schema_tables() -> dict[str, dict[str, dataclasses.Field[Any]]]:
    """The library's config keys by table: "" for the sections (run, data with its
    formats' data.<format>.*, optim, strategy, ...), a model family's name for its
    model.* keys. A plugin's format or family that another test loaded is not the
    library's."""
    load_plugins()
    tables = {"": dict(_keys(TrainConfig))}
    for name, fmt in FORMATS.items():
        if fmt.settings is not None and fmt.settings.__module__.startswith("elastic."):
            tables[""].update(_keys(fmt.settings, f"data.{name}."))
    for name, family in MODEL_SCHEMAS.items():
        if family.__module__.startswith("elastic."):
            tables[name] = dict(_keys(family, "model."))
    return tables


def _doc_tables() -> dict[str, dict[str, tuple[str, str]]]:
    """docs/config.md's rows, key -> (default, choices), by table: those under a
    heading that names `model=NAME` are that family's, the rest are the sections'."""
    tables: dict[str, dict[str, tuple[str, str]]] = {"": {}}
    table = tables[""]
    for line in (REPO / "docs" / "config.md").read_text().splitlines():
        if line.startswith("#"):
            name = line.split("`model=", 1)[1].split("`")[0] if "`model=" in line else ""
            table = tables.setdefault(name, {})
        elif line.startswith("| `"):
            key, default, choices, _ = (c.strip() for c in line.strip("|").split("|", 3))
            assert key.count("`") == 2 and key.strip("`") not in table, f"one key a row: {line}"
            table[key.strip("`")] = (default, choices)
    return tables


def _states(cell: str, value: object) -> bool:
    """Whether a docs default ``cell`` states ``value``, spelled as in YAML (backticks
    allowed; a number in any spelling: 1e-3 for 0.001, 10 for 10.0)."""
    cell = cell.strip().strip("`")
    if value == MISSING:  # no default: the cell says where the value comes from
        return bool(cell)
    if value is None or isinstance(value, bool):
        return cell == {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, (list, tuple)):
        items = [c for c in cell.removeprefix("[").removesuffix("]").split(",") if c.strip()]
        return (
            cell.startswith("[")
            and cell.endswith("]")
            and len(items) == len(value)
            and all(_states(c, v) for c, v in zip(items, value, strict=True))
        )
    if isinstance(value, float):
        try:
            return float(cell) == value
        except ValueError:
            return False
    return cell == (str(value) if value != "" else '""')


def test_every_config_key_is_documented_with_its_default_and_choices():
    """docs/config.md lists every key of the schemas (the sections, the formats'
    settings, each model family's), with the schema's default and, for a key with a
    fixed set of values, exactly that set; and no key the schemas do not have."""
    docs = _doc_tables()
    problems = []
    tables = _schema_tables()
    for table, keys in tables.items():
        rows = docs.get(table, {})
        where = f"the model={table} table" if table else "docs/config.md"
        for key, f in keys.items():
            if key not in rows:
                problems.append(f"{key} is not in {where}")
                continue
            default_cell, choices_cell = rows[key]
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            if not _states(default_cell, default):
                problems.append(
                    f"{key}: the docs say default {default_cell!r}, the schema {default!r}"
                )
            documented = tuple(c.strip().strip("`") for c in choices_cell.split(",") if c.strip())
            if documented != (choices_of(f) or ()):
                problems.append(
                    f"{key}: the docs give choices {documented}, the schema {choices_of(f) or ()}"
                )
        problems += [f"{key} in {where} is no key of the schema" for key in rows.keys() - keys]
    problems += [
        f"docs/config.md has a table for model={t}, no family" for t in docs.keys() - tables
    ]
    assert not problems, "docs/config.md is out of date:\n" + "\n".join(problems)


def test_the_readme_stays_a_manual():
    """A manual, not a lab notebook: short (~350 lines), one benchmark table, no timing
    diary in the Test section (figures and their history live in docs/performance.md)."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 350, "move detail to docs/: the README is a manual"
    assert readme.count("| figure | elastic | peer | ratio | target | verdict |") == 1
    test_section = readme.split("## Test", 1)[1].split("\n## ", 1)[0]
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", test_section), "no dated timings in Test"
