"""What the docs promise stays true of the code: every summary.json key is documented,
and the README's code map names every part of the package."""

from __future__ import annotations

from pathlib import Path

from elastic.observe.summary import SUMMARY_KEYS

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
