"""Simulate convergent-beam electron diffraction (CBED) patterns as Parquet shards.

    python datasets/cbed/prepare.py OUT [--materials Si,Cu,...] [--positions 16]
        [--max-thickness-nm 20] [--thickness-step-nm 2.5] [--size 64] [--cpus N]
    python datasets/cbed/prepare.py --synthetic OUT [--rows 100000]

abTEM multislice at 200 kV, 10 mrad convergence, [001], for cubic crystals of six
structure types; Ray tasks on a local Ray cluster of this command's own, with a progress
bar. OUT/train and OUT/val (held-out (material, thickness) groups). --synthetic writes
the same schema without abTEM, for scale tests. See README.md.
"""

import argparse

from elastic.data.shards import OutputError, check_split_dir
from elastic.datasets.cbed import MATERIALS, CBEDError, Settings, generate, synthetic
from elastic.errors import one_line_errors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", help="output folder (train/ and val/ go there)")
    p.add_argument("--synthetic", metavar="OUT", help="generated patterns, write to OUT")
    p.add_argument("--rows", type=int, default=10000, help="--synthetic: how many")
    p.add_argument("--materials", default=",".join(MATERIALS), help="comma-separated")
    p.add_argument("--positions", type=int, default=16, help="probe positions per material")
    p.add_argument("--max-thickness-nm", type=float, default=20.0)
    p.add_argument("--thickness-step-nm", type=float, default=2.5)
    p.add_argument("--size", type=int, default=64, help="pattern pixels a side")
    p.add_argument("--val-fraction", type=float, default=0.25)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpus", type=int, default=None, help="Ray CPUs (default: all)")
    a = p.parse_args()
    settings = Settings(
        size=a.size,
        max_thickness_nm=a.max_thickness_nm,
        thickness_step_nm=a.thickness_step_nm,
    )
    with one_line_errors(CBEDError, OutputError):
        for split in ("train", "val"):  # before simulating: a file, or foreign shards
            if a.synthetic or a.out:
                check_split_dir(f"{a.synthetic or a.out}/{split}")
        if a.synthetic:
            out = a.synthetic
            train, val = synthetic(out, a.rows, settings, a.val_fraction, a.shards, a.seed)
        elif a.out:
            out = a.out
            materials = [m.strip() for m in a.materials.split(",") if m.strip()]
            train, val = generate(
                out,
                materials,
                a.positions,
                settings,
                a.val_fraction,
                a.shards,
                a.seed,
                num_cpus=a.cpus,
            )
        else:
            p.error("give OUT, or --synthetic OUT")
    print(f"wrote {train} train and {val} val patterns to {out}/train and {out}/val")


if __name__ == "__main__":
    main()
