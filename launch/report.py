"""A scaling study's report: ``python launch/report.py DIR [DIR ...] [--out DIR]``.

DIR: a Hydra multirun directory (``python launch/run.py -m +experiment=X
scaling.workers=1,2 ...`` prints where it is), run output directories, or summary.json
files. Writes report.md, report.json and PNG figures (throughput and scaling
efficiency, time breakdown per world size, validation metric vs time with restarts
marked, learning speedup T1/TN) into --out (default: the first DIR).
"""

from __future__ import annotations

import argparse

from elastic.errors import one_line_errors
from elastic.observe.report import write_report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", help="multirun dir, run output dirs or summary.json files")
    p.add_argument("--out", help="where report.md and the figures go (default: first path)")
    args = p.parse_args()
    with one_line_errors(FileNotFoundError, ValueError):
        path = write_report(args.paths, args.out)
    print(f"[elastic] report: {path}")


if __name__ == "__main__":
    main()
