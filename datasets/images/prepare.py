"""Convert an ImageNet-style folder tree to Parquet shards for elastic.

    python datasets/images/prepare.py SRC OUT [--val-fraction 0.1] [--shards 8]
    python datasets/images/prepare.py --digits OUT
    python datasets/images/prepare.py --synthetic OUT [--images 100000] [--classes 10]

SRC/<class>/<image>.{png,jpg,...} -> OUT/train and OUT/val (sample_id, image bytes,
label, path; class names in the schema metadata). --digits first writes scikit-learn's
bundled digits as PNG class folders to OUT/raw, then converts those; --synthetic does the
same with generated images, for scale tests. See README.md.
"""

import argparse
from pathlib import Path

from elastic.data.shards import OutputError, check_split_dir
from elastic.datasets.images import ImageError, convert, digits_to_folders, synthetic_folders
from elastic.errors import one_line_errors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", nargs="?", help="folder of class sub-folders")
    p.add_argument("out", nargs="?", help="output folder (train/ and val/ go there)")
    p.add_argument("--digits", metavar="OUT", help="use scikit-learn's digits, write to OUT")
    p.add_argument("--synthetic", metavar="OUT", help="generated images, write to OUT")
    p.add_argument("--images", type=int, default=10000, help="--synthetic: how many")
    p.add_argument("--classes", type=int, default=10, help="--synthetic: how many classes")
    p.add_argument("--size", type=int, default=32, help="--synthetic: pixels a side")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    with one_line_errors(ImageError, OutputError):
        target = a.digits or a.synthetic or a.out
        for split in ("train", "val"):  # before any work: a file, or foreign shards
            if target:
                check_split_dir(Path(target) / split)
        if a.digits:
            src, out = Path(a.digits) / "raw", Path(a.digits)
            n = digits_to_folders(src)
            print(f"wrote {n} digit images as PNG class folders to {src}")
        elif a.synthetic:
            src, out = Path(a.synthetic) / "raw", Path(a.synthetic)
            n = synthetic_folders(src, a.images, a.classes, a.size, a.seed)
            print(f"wrote {n} generated images as PNG class folders to {src}")
        elif a.src and a.out:
            src, out = Path(a.src), Path(a.out)
        else:
            p.error("give SRC and OUT, or --digits OUT")
        done = convert(src, out, a.val_fraction, a.shards, a.seed)
    print(
        f"wrote {done.train_rows} train and {done.val_rows} val images of "
        f"{len(done.classes)} classes to {out}/train and {out}/val"
    )


if __name__ == "__main__":
    main()
