"""Convert MD trajectories to contact-map Parquet shards for elastic.

    python datasets/protein/prepare.py TOPOLOGY TRAJ [TRAJ ...] --out DIR
        [--ref NAME=STRUCTURE ...] [--cutoff 8.0] [--selection "name CA"] [--distances]
        [--rg NAME=SELECTION ...] [--shards 4] [--first-sample-id 0]
    python datasets/protein/prepare.py --adk DIR
    python datasets/protein/prepare.py --synthetic DIR [--frames 100000] [--residues 214]

Any topology/trajectory pair MDAnalysis reads. --adk converts the adenylate kinase data
that ships in MDAnalysisTests: the two closed->open DIMS transition paths to DIR/train,
the NAMD implicit-solvent run to DIR/val (a held-out trajectory), with RMSD to the open
and closed structures as labels. --synthetic writes DIR/train and DIR/val of the same
schema without MDAnalysis (a chain morphing between two folds), for scale tests.
See README.md.
"""

import argparse

from elastic.datasets.protein import ProteinError, convert, synthetic
from elastic.errors import one_line_errors


def pairs(values: list[str], what: str, example: str) -> dict[str, str]:
    out = {}
    for v in values or []:
        name, sep, value = v.partition("=")
        if not sep or not name or not value:
            raise ProteinError(f"{what} {v!r} is not NAME=VALUE: give e.g. {what} {example}")
        out[name] = value
    return out


def adk(out: str) -> None:
    from MDAnalysisTests import datafiles as D

    refs = {"open": D.CRD, "closed": D.PDB_closed}
    train = convert(D.PSF, [D.DCD, D.DCD2], f"{out}/train", refs)
    # sample ids continue after the training frames: unique across the splits
    val = convert(
        D.PSF_NAMD_GBIS, [D.DCD_NAMD_GBIS], f"{out}/val", refs, first_sample_id=train.rows
    )
    print(
        f"wrote {train.rows} train frames (2 DIMS paths) to {out}/train and {val.rows} val "
        f"frames (NAMD) to {out}/val: {train.residues} residues"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("topology", nargs="?")
    p.add_argument("trajectories", nargs="*")
    p.add_argument("--out")
    p.add_argument("--adk", metavar="DIR", help="the AdK example from MDAnalysisTests")
    p.add_argument("--synthetic", metavar="DIR", help="generated frames of the same schema")
    p.add_argument("--frames", type=int, default=10000, help="--synthetic: training frames")
    p.add_argument("--residues", type=int, default=214, help="--synthetic: chain length")
    p.add_argument("--ref", action="append", help="NAME=STRUCTURE: label rmsd_NAME")
    p.add_argument("--rg", action="append", help="NAME=SELECTION: label rg_NAME")
    p.add_argument("--cutoff", type=float, default=8.0, help="contact cutoff (angstrom)")
    p.add_argument("--selection", default="name CA")
    p.add_argument("--distances", action="store_true", help="also store the distance map")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--first-sample-id", type=int, default=0)
    a = p.parse_args()
    with one_line_errors(ProteinError):
        if a.adk:
            adk(a.adk)
            return
        if a.synthetic:
            tr = synthetic(f"{a.synthetic}/train", a.frames, a.residues, a.cutoff, 0, a.shards)
            va = synthetic(f"{a.synthetic}/val", max(1, a.frames // 10), a.residues, a.cutoff, 1,
                           a.shards, first_sample_id=tr.rows)  # fmt: skip
            print(f"wrote {tr.rows} train and {va.rows} val synthetic frames to {a.synthetic}")
            return
        if not (a.topology and a.trajectories and a.out):
            p.error("give TOPOLOGY TRAJ [TRAJ ...] --out DIR, or --adk DIR")
        refs = pairs(a.ref, "--ref", "open=open.pdb")
        rgs = pairs(a.rg, "--rg", "lid='resid 122-159'")
        done = convert(
            a.topology, a.trajectories, a.out, refs, a.cutoff, a.selection, a.distances, rgs,
            a.shards, a.first_sample_id,
        )  # fmt: skip
    print(f"wrote {done.rows} frames of {done.trajectories} trajectories to {a.out}")


if __name__ == "__main__":
    main()
