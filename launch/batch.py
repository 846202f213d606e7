"""The samples of one global batch of a run: ``python launch/batch.py RUN_DIR STEP --data DIR``.

Prints JSON: the step's epoch, its step in the epoch, its sample ids and where each row
lies (shard file, row group, row). Batches are the same at any world size, so this is
what the run trained at that step, however many workers it had then.
"""

from __future__ import annotations

import argparse
import json

from elastic.errors import CheckpointError, ConfigError, one_line_errors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="the run's folder: run.storage_path/run.name")
    p.add_argument("step", type=int, help="the step, as the run logs it (from 1)")
    p.add_argument("--data", required=True, help="the train split's directory (data.path)")
    args = p.parse_args()
    with one_line_errors(ConfigError, CheckpointError):
        from elastic.data.replay import step_batch

        print(json.dumps(step_batch(args.run_dir, args.data, args.step), indent=1))


if __name__ == "__main__":
    main()
