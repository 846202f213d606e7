"""The driver: data ready -> Ray -> TorchTrainer.fit() -> summary.json."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

from elastic.config import TrainConfig
from elastic.data import Split, build_datasets, check_dataset, data_config, fits_cache


def prepare_data(cfg: TrainConfig) -> dict[str, Split]:
    """Generate synthetic data that is configured but missing, then check every shard."""
    syn = cfg.data.synthetic
    if syn is not None and not (
        os.path.isdir(cfg.data.path) and (not cfg.data.val_path or os.path.isdir(cfg.data.val_path))
    ):
        from elastic.synthetic import generate

        print(f"[elastic] generating synthetic data in {cfg.data.path}", flush=True)
        generate(
            cfg.data.path,
            cfg.data.val_path,
            syn.rows,
            syn.val_rows,
            syn.shards,
            syn.input_dim,
            syn.output_dim,
            syn.seed,
        )
    return check_dataset(cfg.data)


def _interruptible(trainer_cls: type) -> type:
    """TorchTrainer whose fit() stops on Ctrl-C with a KeyboardInterrupt.

    Ray Train's own SIGINT handler blocks on the controller's abort inside the signal
    handler and the process then exits 1 without a word. Ours asks the controller to
    abort without waiting and raises KeyboardInterrupt: Ray is shut down on the way out
    (only registered, complete checkpoints exist) and the entry point says so, exit 130."""

    class Trainer(trainer_cls):
        interrupted = False

        def _register_sigint_handler(self, controller: Any) -> None:
            def handler(signum: int, frame: Any) -> None:
                Trainer.interrupted = True
                controller.abort.remote()
                raise KeyboardInterrupt

            signal.signal(signal.SIGINT, handler)

        def fit(self) -> Any:
            try:
                result = super().fit()
            except Exception:
                if Trainer.interrupted:
                    raise KeyboardInterrupt from None
                raise
            if Trainer.interrupted:
                raise KeyboardInterrupt
            return result

    return Trainer


def run_dir(cfg: TrainConfig) -> str:
    return os.path.join(cfg.run.storage_path, cfg.run.name)


def train(cfg: TrainConfig, config_dict: dict[str, Any]) -> dict[str, Any]:
    """Run training to the end and return the summary (the entry point writes it out)."""
    import ray.data
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from elastic import cluster
    from elastic.loop import train_loop

    splits = prepare_data(cfg)
    out = run_dir(cfg)
    print(f"[elastic] run {cfg.run.name}: checkpoints and metrics in {out}", flush=True)
    rows = ", ".join(f"{s.rows} {name} rows" for name, s in splits.items())
    print(f"[elastic] dataset: {rows}")
    sc = cfg.scaling
    cache_train = fits_cache(splits["train"], cfg.data.cache_mb, sc.min_workers)
    if cache_train:
        print("[elastic] the train split fits data.cache_mb: read once, then from memory")
    workers: int | tuple[int, int] = (
        sc.min_workers if sc.min_workers == sc.max_workers else (sc.min_workers, sc.max_workers)
    )
    started = time.time()
    with cluster.connect(cfg.cluster, sc) as where:
        print(f"[elastic] connected to {where}", flush=True)
        ray.data.DataContext.get_current().enable_progress_bars = False
        trainer = _interruptible(TorchTrainer)(
            train_loop,
            train_loop_config={
                "cfg": cfg,
                "config_dict": config_dict,
                "run_dir": out,
                "cache_train": cache_train,
            },
            scaling_config=ScalingConfig(
                num_workers=workers,  # type: ignore[arg-type]  # (min, max) is elastic
                use_gpu=sc.use_gpu,
                resources_per_worker={"CPU": sc.cpus_per_worker},
            ),
            run_config=RunConfig(
                name=cfg.run.name,
                storage_path=cfg.run.storage_path,
                checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
                failure_config=FailureConfig(max_failures=0),
            ),
            datasets=build_datasets(cfg.data, splits, sc.max_workers),
            dataset_config=data_config(),
            torch_config=TorchConfig(backend="nccl" if sc.use_gpu else "gloo"),
        )
        result = trainer.fit()
    metrics = result.metrics or {}
    summary: dict[str, Any] = {
        "status": "finished",
        "experiment": cfg.run.experiment,
        "run_name": cfg.run.name,
        **(metrics.get("summary") or {}),
        "checkpoint": result.checkpoint.path if result.checkpoint else None,
        "wall_s": time.time() - started,
    }
    summary.setdefault("wandb_dir", None)
    return summary


def write_summary(summary: dict[str, Any], output_dir: str) -> str:
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "summary.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(tmp, path)
    return path
