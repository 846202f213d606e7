"""Train: ``python launch/run.py +experiment=NAME [key=value ...]``.

Hydra composes conf/; the config is checked before anything starts (exit 2 and one line
on a mistake); then the driver runs Ray Train workers and writes summary.json into
Hydra's output directory.

A stop signal (SIGTERM, SIGUSR1: a batch system's warning) at any moment ends the run
with exit 75 after a checkpoint when training is under way (the same command resumes),
Ctrl-C with exit 130; either way Ray is shut down and nothing of the run keeps running.
"""

from __future__ import annotations

import sys

# first, before the slow imports: from here on a stop signal ends the run with exit 75
from elastic.cluster.connect import PREEMPTED, exit_on_stop, handle_stop_signals

handle_stop_signals()

with exit_on_stop():
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import DictConfig

    from elastic.config.compose import (
        CONF_DIR,
        fail,
        plain,
        preflight,
        quote_target,
        register_schemas,
        typed_config,
    )
    from elastic.errors import (
        ClusterUnavailableError,
        ConfigError,
        DataError,
        RunError,
        UserCodeError,
    )

    try:
        register_schemas()  # with the plugins' models: a plugin that fails to import is said here
    except ConfigError as e:
        fail(str(e))


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(cfg: DictConfig) -> None:
    from elastic.train.driver import train, write_summary

    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:
        # one run per job: the sweep's jobs share one ${now:} (Hydra resolves it once),
        # so the same run.name would make each job resume the one before; re-running
        # the sweep command maps each job to its run again (resume)
        cfg.run.name = f"{cfg.run.name}-{hc.job.num}"
    try:
        typed = typed_config(cfg, hc.runtime.choices.get("experiment") or "", hc.runtime.output_dir)
    except (ConfigError, UserCodeError) as e:
        fail(str(e))
    try:
        summary = train(typed, plain(cfg))
    except ConfigError as e:  # found once Ray is up: what the cluster's nodes offer
        fail(str(e))
    except ClusterUnavailableError as e:  # nodes gone: wait it out, then the same command
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(PREEMPTED)
    except RunError as e:
        # a bad row found on the driver (a worker's message names the dataset itself)
        where = f"data.path={typed.data.path}; " if isinstance(e, DataError) else ""
        fail(f"{e} ({where}the last complete checkpoint is kept)")
    path = write_summary(summary, typed.run.output_dir)
    print(
        f"[elastic] {summary['status']}: {summary.get('steps')} steps, "
        f"loss {summary.get('loss_first')} -> {summary.get('loss_last')}, val {summary.get('val')}"
    )
    print(f"[elastic] summary: {path}")
    if summary["status"] == "preempted":
        # EX_TEMPFAIL: checkpointed on a stop signal; the same command resumes
        print("[elastic] preempted: run the same command (same run.name) to resume")
        sys.exit(PREEMPTED)


if __name__ == "__main__":
    with exit_on_stop():
        sys.argv[1:] = quote_target(sys.argv[1:])
        preflight(sys.argv[1:])
        try:
            main()
        except KeyboardInterrupt:
            print(
                "\n[elastic] interrupted: the last complete checkpoint is kept; re-run with the "
                "same run.name to resume from it",
                file=sys.stderr,
            )
            sys.exit(130)
