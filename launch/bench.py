"""Benchmarks, each measured side by side with its peer in one run, reported as a ratio.

    python launch/bench.py overhead [--rounds 3] [--steps 600] [--zero-stage 0]
    python launch/bench.py recovery [--rounds 1]
    python launch/bench.py chaos [--seed 0] [--epochs 20]
    python launch/bench.py ingest [--rounds 2] [--epochs 3]
    python launch/bench.py memory [--stages 0 1 2 3] [--worlds 1 2 3]
    python launch/bench.py hetero [--rounds 2] [--steps 120]
    python launch/bench.py gpu [--steps 300] [--cpu-check]
    python launch/bench.py startup [--rounds 2] [--steps 20]
    python launch/bench.py scale [--quick] [--worlds 2 4 8 16 24] [--points bench-scale.json]
    python launch/bench.py all [--quick] [--skip NAME ...]

Each benchmark, what it measures and its targets: its module in elastic_bench/ (the
method and results: docs/performance.md). Each writes bench-NAME.json; ``all`` runs
overhead, ingest, recovery, chaos, hetero, memory and scale and writes the table to
bench-all.md and bench-all.json (--quick: fewer rounds and steps).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from elastic_bench.table import ALL_ORDER, BENCHES, run_all


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="bench", required=True)
    for name, module in BENCHES.items():
        module.add_arguments(sub.add_parser(name, help=module.HELP))
    a = sub.add_parser("all", help="every benchmark, one table: bench-all.md, bench-all.json")
    a.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    a.add_argument("--skip", nargs="*", default=[], choices=ALL_ORDER)
    args = p.parse_args()
    report = run_all(p, args) if args.bench == "all" else BENCHES[args.bench].measure(args)
    out = Path(f"bench-{args.bench}.json")
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out.resolve()}")
    if args.bench == "all" and report["errors"]:
        sys.exit(f"bench all: {', '.join(report['errors'])} failed (see above)")


if __name__ == "__main__":
    main()
