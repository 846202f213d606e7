"""Write the synthetic dataset: python datasets/synthetic/prepare.py OUT_DIR [options].

OUT_DIR/train and OUT_DIR/val receive Parquet shards (sample_id, x, y); see README.md.
"""

import argparse

from elastic.datasets.synthetic import generate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--val-rows", type=int, default=512)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--input-dim", type=int, default=64)
    p.add_argument("--output-dim", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    generate(
        f"{a.out_dir}/train",
        f"{a.out_dir}/val",
        a.rows,
        a.val_rows,
        a.shards,
        a.input_dim,
        a.output_dim,
        a.seed,
    )
    print(f"wrote {a.out_dir}/train and {a.out_dir}/val")


if __name__ == "__main__":
    main()
