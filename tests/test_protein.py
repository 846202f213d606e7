"""Protein dynamics: real MD trajectories of adenylate kinase (AdK) from MDAnalysisTests
-> contact-map shards -> a model that predicts RMSD-to-open on a held-out trajectory.
Needs the ``protein`` extra (skipped without it)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

mda = pytest.importorskip("MDAnalysis", reason="the protein extra is not installed")
D = pytest.importorskip("MDAnalysisTests.datafiles", reason="the protein extra is not installed")

from conftest import train  # noqa: E402

from elastic.config.compose import compose, typed_config  # noqa: E402
from elastic.datasets.protein import (  # noqa: E402
    ContactsFormat,
    ProteinError,
    contact_width,
    convert,
    decode_contacts,
    synthetic,
)
from elastic.errors import ConfigError  # noqa: E402
from elastic_harness.localcluster import REPO  # noqa: E402

PREPARE = str(REPO / "datasets" / "protein" / "prepare.py")
BITS = 214 * 213 // 2


def model_inputs(table, shard):
    """The contact maps of ``table`` as the model gets them: decoded as Ray Data does
    (still packed, ceil(bits / 8) bytes a row), then unpacked as the training worker does."""
    packed = decode_contacts(table, "contacts", "rg", BITS)["x"]
    assert packed.dtype == np.uint8 and packed.shape == (table.num_rows, (BITS + 7) // 8)
    return ContactsFormat().finisher(None, shard)(packed)


def first_shard(path):
    return str(sorted(path.glob("*.parquet"))[0])


def read(path):
    return pq.read_table(sorted(path.glob("*.parquet")))


def test_adk_path_to_contact_maps_labels_and_metadata(tmp_path):
    refs = {"open": D.CRD, "closed": D.PDB_closed}
    done = convert(D.PSF, [D.DCD], tmp_path / "out", refs, distances=True, shards=3)
    assert (done.rows, done.residues) == (98, 214)
    t = read(tmp_path / "out")
    assert t.num_rows == 98 and sorted(t["sample_id"].to_pylist()) == list(range(98))
    meta = t.schema.metadata
    assert meta[b"elastic.residues"] == b"214" and meta[b"elastic.cutoff_angstrom"] == b"8.0"
    assert meta[b"elastic.selection"] == b"name CA"
    assert json.loads(meta[b"elastic.sources"])["trajectories"] == [D.DCD]
    assert contact_width(sorted((tmp_path / "out").glob("*.parquet"))[0]) == BITS
    # the contacts of a frame are the C-alpha pairs closer than 8 A, computed afresh here
    u = mda.Universe(D.PSF, D.DCD)
    ca = u.select_atoms("name CA")
    row = t.filter(t["frame"].to_numpy() == 40).to_pylist()[0]
    u.trajectory[40]
    p = ca.positions
    full = np.linalg.norm(p[:, None] - p[None], axis=-1)
    iu = np.triu_indices(214, 1)
    x = model_inputs(t.filter(t["frame"].to_numpy() == 40), first_shard(tmp_path / "out"))
    assert x.dtype == np.float32
    np.testing.assert_array_equal(x[0], (full[iu] < 8.0).astype(np.float32))
    dist = np.frombuffer(row["distances"], np.float16)
    np.testing.assert_allclose(dist, full[iu], rtol=2e-3, atol=2e-2)
    assert row["rg"] == pytest.approx(ca.radius_of_gyration(), rel=1e-4)
    # the DIMS path goes closed -> open: the labels say so at its two ends
    by_frame = {r["frame"]: r for r in t.select(["frame", "rmsd_open", "rmsd_closed"]).to_pylist()}
    assert by_frame[0]["rmsd_closed"] < 1.0 < by_frame[0]["rmsd_open"]
    assert by_frame[97]["rmsd_open"] < 1.0 < by_frame[97]["rmsd_closed"]


def test_the_synthetic_generator_writes_the_converters_schema(tmp_path):
    convert(D.PSF, [D.DCD], tmp_path / "real", {"open": D.CRD, "closed": D.PDB_closed}, shards=1)
    done = synthetic(tmp_path / "syn", frames=50, residues=214, shards=2)
    real, syn = read(tmp_path / "real"), read(tmp_path / "syn")
    assert syn.schema.remove_metadata() == real.schema.remove_metadata()
    assert set(syn.schema.metadata) == set(real.schema.metadata)
    assert syn.schema.metadata[b"elastic.contact_bits"] == str(BITS).encode()
    assert done.rows == 50 and sorted(syn["sample_id"].to_pylist()) == list(range(50))
    # labels that a model can learn: the further from "closed", the closer to "open"
    c, o = syn["rmsd_closed"].to_numpy(), syn["rmsd_open"].to_numpy()
    assert np.corrcoef(c, o)[0, 1] < -0.5
    x = model_inputs(syn, first_shard(tmp_path / "syn"))
    assert 0.01 < x.mean() < 0.5  # a chain has contacts, not everything touches


def test_a_protein_split_across_the_periodic_box_is_made_whole(tmp_path):
    """GROMACS run in explicit water: the raw frames have the protein broken across the
    box (consecutive C-alphas ~80 A apart); converted, it is whole."""
    u = mda.Universe(D.TPR, D.XTC)
    raw = u.select_atoms("name CA").positions
    assert np.linalg.norm(np.diff(raw, axis=0), axis=1).max() > 20
    convert(D.TPR, [D.XTC], tmp_path / "out", distances=True)
    t = read(tmp_path / "out")
    d = np.frombuffer(b"".join(t["distances"].to_pylist()), np.float16).reshape(t.num_rows, -1)
    iu = np.triu_indices(214, 1)
    assert d[:, iu[1] == iu[0] + 1].max() < 4.3  # bonded neighbours, every frame


def test_bad_inputs_name_the_file_and_the_problem(tmp_path):
    with pytest.raises(ProteinError, match="does not go with"):
        convert(D.PSF, [D.XTC], tmp_path / "a")  # 3,341-atom topology, 47,681-atom frames
    with pytest.raises(ProteinError, match="nothing.dcd does not exist"):
        convert(D.PSF, [str(tmp_path / "nothing.dcd")], tmp_path / "b")
    with pytest.raises(ProteinError, match="selection 'name ZZ' picks 0 atoms"):
        convert(D.PSF, [D.DCD], tmp_path / "c", selection="name ZZ")
    assert not list(tmp_path.glob("a/*.parquet")) and not list(tmp_path.glob("b/*.parquet"))
    # the command line: one line, exit 2
    out = subprocess.run(
        [sys.executable, PREPARE, D.PSF, D.XTC, "--out", str(tmp_path / "d")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 2
    assert [ln for ln in out.stderr.splitlines() if ln.startswith("error:")] == [
        ln for ln in out.stderr.splitlines() if "does not go with" in ln
    ]


def test_mixed_residue_counts_in_one_dataset_fail_at_config_time(tmp_path):
    convert(D.PSF, [D.DCD], tmp_path / "train", shards=1)
    convert(D.PSF, [D.DCD], tmp_path / "val", selection="name CA and resid 1-100", shards=1)
    cfg, name = compose(
        [
            "+experiment=protein_rmsd",
            f"data.path={tmp_path}/train",
            f"data.val_path={tmp_path}/val",
            "data.target_column=rg",
        ]
    )
    with pytest.raises(ConfigError, match="proteins of different residue counts"):
        typed_config(cfg, name)


@pytest.mark.slow
def test_adk_trains_a_model_that_predicts_rmsd_on_a_held_out_trajectory(tmp_path, ray_session):
    """prepare --adk (train: the two DIMS paths; val: the NAMD run), then the real
    pipeline: R^2 of RMSD-to-open on the held-out NAMD frames >= 0.5."""
    cmd = [sys.executable, PREPARE, "--adk", str(tmp_path / "adk")]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "200 train frames" in out.stdout and "100 val frames" in out.stdout
    summary = train(
        [
            "+experiment=protein_rmsd",
            f"data.path={tmp_path}/adk/train",
            f"data.val_path={tmp_path}/adk/val",
            f"run.storage_path={tmp_path}/runs",
            "checkpoint.every_steps=0",
            "logger=none",
        ]
    )
    assert summary["status"] == "finished" and summary["samples_exactly_once"] is True
    assert summary["val"]["samples"] == 100
    assert summary["val"]["r2"] >= 0.5, summary["val"]
