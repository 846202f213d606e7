"""The image and CBED converters refuse an output they would damage, before any work:
one line, exit 2, the user's files kept (the protein converter: tests/test_protein_trust.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = {
    "images": ("PIL", ["--synthetic"]),
    "cbed": ("abtem", ["--rows", "4", "--synthetic"]),
}


@pytest.mark.parametrize("dataset", sorted(SCRIPTS))
def test_an_output_that_is_a_file_or_holds_foreign_shards_is_refused(dataset, tmp_path):
    module, args = SCRIPTS[dataset]
    pytest.importorskip(module, reason=f"the {dataset} extra is not installed")
    script = str(REPO / "datasets" / dataset / "prepare.py")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    mine = tmp_path / "out" / "train" / "mydata.parquet"
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"PAR1 user data")
    for out, needle in ((a_file, "is a file"), (tmp_path / "out", "mydata.parquet")):
        proc = subprocess.run(
            [sys.executable, script, *args, str(out)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=300,
        )
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert a_file.read_text() == "mine" and mine.read_bytes() == b"PAR1 user data"
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == ["mydata.parquet", "train"]
