"""Protein converter inputs whose labels could come out silently wrong, and bad inputs:
right labels (checked against an independent computation) or one line, exit 2.
Real GROMACS AdK data from MDAnalysisTests (skipped without the protein extra)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

mda = pytest.importorskip("MDAnalysis", reason="the protein extra is not installed")
D = pytest.importorskip("MDAnalysisTests.datafiles", reason="the protein extra is not installed")

from elastic.datasets.protein import ProteinError, convert  # noqa: E402
from elastic_harness.localcluster import REPO  # noqa: E402

PREPARE = str(REPO / "datasets" / "protein" / "prepare.py")


def by_frame(path):
    return pq.read_table(sorted(path.glob("*.parquet"))).sort_by("frame")


def test_a_periodic_run_read_with_a_bondless_gro_gets_the_labels_of_its_tpr(tmp_path):
    """GROMACS AdK in water, read with the .gro (no bonds) and with the .tpr (bonds): the
    same contacts, radius of gyration and RMSD. The reference is the .gro itself, frame 0
    of the run: RMSD ~0 at frame 0 (broken across the box it read 21.8 A)."""
    kw = dict(references={"first": D.GRO}, extra_selections={"lid": "resid 122-159"})
    convert(D.TPR, [D.XTC], tmp_path / "tpr", **kw)
    convert(D.GRO, [D.XTC], tmp_path / "gro", **kw)
    tpr, gro = by_frame(tmp_path / "tpr"), by_frame(tmp_path / "gro")
    assert tpr["rmsd_first"][0].as_py() < 0.01 and gro["rmsd_first"][0].as_py() < 0.01
    for col in ("rg", "rg_lid", "rmsd_first"):
        np.testing.assert_allclose(gro[col].to_numpy(), tpr[col].to_numpy(), atol=1e-3)
    assert gro["contacts"].to_pylist() == tpr["contacts"].to_pylist()
    # and the tpr's labels are those of the whole protein, computed afresh here
    u = mda.Universe(D.TPR, D.XTC)
    ca = u.select_atoms("name CA")
    u.trajectory.add_transformations(mda.transformations.unwrap(ca.fragments[0]))
    rg = [ca.radius_of_gyration() for _ in u.trajectory]
    np.testing.assert_allclose(gro["rg"].to_numpy(), rg, rtol=1e-5)
    assert min(rg) > 19.0 and max(rg) < 20.0


def test_a_periodic_structure_that_cannot_be_made_whole_is_refused(tmp_path):
    """C-alphas only (3.8 A apart: no bond can be guessed) in a periodic box: the chain
    cannot be put back together, so no labels are written."""
    u = mda.Universe(D.TPR, D.XTC)
    ca = u.select_atoms("name CA")
    ca.write(tmp_path / "ca.gro")
    with mda.Writer(str(tmp_path / "ca.xtc"), len(ca)) as w:
        for _ in u.trajectory[:2]:
            w.write(ca)
    with pytest.raises(ProteinError, match="ca.gro has a periodic box but no bonds .* with bonds"):
        convert(str(tmp_path / "ca.gro"), [str(tmp_path / "ca.xtc")], tmp_path / "out")
    with pytest.raises(ProteinError, match="reference first=.*ca.gro has a periodic box"):
        convert(D.TPR, [D.XTC], tmp_path / "out", {"first": str(tmp_path / "ca.gro")})
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "setting",
    [{"cutoff": -1}, {"cutoff": 0}, {"cutoff": float("nan")}, {"shards": 0}, {"shards": -3}],
)
def test_settings_that_would_write_a_useless_dataset_are_refused(tmp_path, setting):
    name = next(iter(setting))
    with pytest.raises(ProteinError, match=f"{name} .* is not valid"):
        convert(D.PSF, [D.DCD], tmp_path / "out", **setting)
    assert not (tmp_path / "out").exists()


def test_the_converter_replaces_its_own_shards_and_nothing_else(tmp_path):
    out = tmp_path / "out"
    convert(D.PSF, [D.DCD], out, shards=4)
    (out / "notes.txt").write_text("mine")
    convert(D.PSF, [D.DCD], out, shards=2)  # a rerun: the 4 old shards go
    assert sorted(p.name for p in out.iterdir()) == [
        "notes.txt",
        "part-00000.parquet",
        "part-00001.parquet",
    ]
    assert by_frame(out).num_rows == 98
    # a Parquet file of the user's would be deleted, or read as part of the dataset
    pq.write_table(by_frame(out).slice(0, 5), out / "mydata.parquet")
    with pytest.raises(ProteinError, match="holds mydata.parquet, not written by this conv"):
        convert(D.PSF, [D.DCD2], out)
    assert pq.read_table(out / "mydata.parquet").num_rows == 5
    assert len(list(out.glob("part-*.parquet"))) == 2


def cli(*args):
    return subprocess.run(
        [sys.executable, PREPARE, *map(str, args)], capture_output=True, text=True
    )


def test_bad_command_lines_get_one_line_and_exit_2(tmp_path):
    (tmp_path / "afile").write_text("not a structure\n")
    (tmp_path / "empty.dcd").write_bytes(b"")
    u = mda.Universe(D.PSF, D.DCD)
    with mda.Writer(str(tmp_path / "zero.dcd"), len(u.atoms)):
        pass  # a DCD header and no frames
    out = ["--out", tmp_path / "out"]
    cases = {
        "selection 'name CA and' is not a valid MDAnalysis selection": [
            D.PSF, D.DCD, *out, "--selection", "name CA and",
        ],
        "rg selection lid='name ZZ' picks no atoms": [D.PSF, D.DCD, *out, "--rg", "lid=name ZZ"],
        "afile cannot be read": [D.PSF, D.DCD, *out, "--ref", f"first={tmp_path}/afile"],
        "afile is a file, not a directory": [D.PSF, D.DCD, "--out", tmp_path / "afile"],
        "--ref 'nosep' is not NAME=VALUE": [D.PSF, D.DCD, *out, "--ref", "nosep"],
        "empty.dcd has no frames": [D.PSF, tmp_path / "empty.dcd", *out],
        "zero.dcd has no frames": [D.PSF, tmp_path / "zero.dcd", *out],
    }  # fmt: skip
    for message, args in cases.items():
        done = cli(*args)
        lines = done.stderr.strip().splitlines()
        assert (done.returncode, len(lines)) == (2, 1), (message, done.stderr)
        assert lines[0].startswith("error: ") and message in lines[0], (message, lines)
    assert not (tmp_path / "out").exists()
