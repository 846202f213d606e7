"""ingest: rows/s delivered into 2 Ray Train workers by elastic's pipeline as training
reads (each rank's row groups of the epoch's plan -> Ray Data read tasks -> decode in
map_batches -> read-ahead, kept in the worker once read when the decoded split fits
data.cache_mb -> the rank's slice of every global batch, with the loop's agreement on
its steps; no model), and streamed every epoch (a split larger than the cache), vs a
torch DataLoader with 2 worker processes reading the same shards with pyarrow and the
same decode functions, into one process. Per dataset (synthetic arrays, images, protein
contact maps, CBED patterns, at
scale from their synthetic generators), alternated, rounds take turns going first; the
ratio is of the medians. Then the data-wait share of step time of each dataset's
experiment (steady state: the log intervals after the first step). Writes
bench-ingest.json."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch.utils.data

from elastic_bench.common import train

if TYPE_CHECKING:
    from elastic.config.schema import DataConfig

HELP = "rows/s into 2 workers vs a torch DataLoader"
STREAMED_RATIO_TARGET = 0.5  # streamed every epoch: elastic's rows/s over the DataLoader's
CACHED_BEFORE = {  # cached, the ratio before world-size-independent batches (the baseline)
    "synthetic": 0.49,
    "images": 1.08,
    "protein": 0.79,
    "cbed": 0.55,
}
CACHED_NOISE = 0.15  # the cached ratio is "not worse" within this much (rounds swing +-15%)
DATA_WAIT_TARGET = 0.02  # share of step time waiting for data, steady state, at most
INGEST_DATASETS = {
    # name: (experiment, config overrides, what the rows are)
    "synthetic": ("smoke", [], "float32[256] + target[16]"),
    "images": ("images_resnet", ["data.image.size=32"], "32x32 PNG bytes, decoded + resized"),
    "protein": ("protein_cvae", [], "214-residue contact maps, 22,791 bits unpacked"),
    "cbed": ("cbed_cnn", [], "float32[64x64] patterns"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--wait-steps", type=int, default=100)
    p.add_argument("--data-dir", default="data/bench-ingest", help="generated once, reused")
    p.add_argument("--only", nargs="*", choices=sorted(INGEST_DATASETS), help="some datasets")


def _ingest_data(root: Path, names: list[str]) -> dict[str, DataConfig]:
    """Each dataset at scale from its synthetic generator (same schema as the real one)
    and its DataConfig, written once under ``root``."""
    from elastic.config.compose import compose, typed_config

    made = {}
    for name in names:
        experiment, extra, _ = INGEST_DATASETS[name]
        d = root / name
        if not (d / "train").is_dir():
            if name == "synthetic":
                from elastic.datasets.synthetic import generate

                generate(str(d / "train"), None, 65536, 0, 16, 256, 16, seed=0)
            elif name == "images":
                from elastic.datasets.images import convert, synthetic_folders

                synthetic_folders(d / "raw", 20000, 10, 32, seed=0)
                convert(d / "raw", d, val_fraction=0.0, shards=16)
            elif name == "protein":
                from elastic.datasets import protein

                protein.synthetic(d / "train", 4000, shards=16)
            else:
                from elastic.datasets import cbed

                cbed.synthetic(d, 16000, val_fraction=0.0, shards=16)
        overrides = [f"+experiment={experiment}", f"data.path={d}/train", "data.val_path=null"]
        cfg, exp = compose([*overrides, *extra])
        data = typed_config(cfg, exp).data
        data.val_path = None
        made[name] = data
    return made


def _consume(config: dict) -> None:
    """A Ray Train worker that only takes its rows, the way the training loop does (its
    row groups of each epoch's plan read through Ray Data ahead of training, kept after
    they are read when the decoded split fits data.cache_mb, else streamed every epoch;
    assembled into this rank's slice of every global batch, with the loop's lock-step
    agreement on its steps, :class:`~elastic.train.control.SyncPace`)."""
    import ray.train
    import torch
    import torch.distributed as dist

    from elastic.config.schema import TrainerConfig
    from elastic.data.reader import PlannedReader, epoch_plan
    from elastic.train.control import SyncPace

    data, epochs = config["data"], config["epochs"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    reader = PlannedReader(
        data, config["files"], config["layout"], rank, world, epochs=epochs, cache=config["cache"]
    )

    def count(rows: int, pace: int = 0) -> tuple[int, int]:
        t = torch.tensor([rows, pace], dtype=torch.int64)
        dist.all_reduce(t)
        return int(t[0]), int(t[1])

    # the loop's agreement on its steps, at the loop's pace: forced where the loop forces
    # one (its first step, every log step at the default interval, an epoch's last)
    log_every = TrainerConfig().log_every_steps
    rows, start, step, unsynced = 0, None, 0, 0
    sync = SyncPace()
    epoch_ends = []  # seconds from the first rows to each epoch's end
    for epoch in range(epochs):
        last = step + epoch_plan(data, config["layout"], epoch).steps
        for batch in reader.epoch(epoch):
            step, unsynced = step + 1, unsynced + batch.rows
            if sync.due(step, forced=step == 1 or step % log_every == 0 or step == last):
                _, paces = count(unsynced, sync.proposal())
                sync.agreed(step, paces, world)
                unsynced = 0
            if start is None:  # from the first rows: not Ray Train's start-up
                start = time.perf_counter()
            else:
                rows += batch.rows
        epoch_ends.append(time.perf_counter() - (start or time.perf_counter()))
    dist.barrier()  # the slower worker ends the measurement
    elapsed = time.perf_counter() - (start or time.perf_counter())
    reader.close()
    total, _ = count(rows)
    if rank == 0:  # Ray Train 2.60 keeps only metrics reported with a checkpoint
        Path(config["out"]).write_text(
            json.dumps(
                {
                    "rows": total,
                    "seconds": elapsed,
                    "data_ready_s": reader.first_batch_ready_s,
                    "epoch_ends_s": epoch_ends,
                }
            )
        )


def _elastic_ingest(data, epochs: int, workdir: str, cache: bool) -> tuple[float, float]:
    """Rows/s from the first rows, and after the first epoch (the worker group's Ray
    Data start behind it)."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from elastic.cluster.bootstrap import WORKER_POOL
    from elastic.cluster.connect import WORKER_ENV
    from elastic.data.order import Layout
    from elastic.data.pipeline import warm_up
    from elastic.data.shards import check_dataset
    from elastic.train.trainer import interruptible

    split = check_dataset(data)["train"]
    out = Path(workdir) / f"ingest-{time.time_ns()}.json"
    ray.init(
        address="local",
        num_cpus=4,
        object_store_memory=512 * 2**20,
        include_dashboard=False,
        runtime_env={"env_vars": dict(WORKER_ENV)},
        log_to_driver=False,
        _system_config=WORKER_POOL,  # as elastic's own Ray clusters
    )
    layout = Layout(split.row_groups)
    f, g, _ = layout.groups()[0]
    # the cluster's first Ray Data execution (~5 s on a fresh one) before the clock: the
    # driver overlaps it with Ray Train's start (pipeline.warm_up); what a worker group
    # waits for its first batch is bench chaos's data_ready_s
    warm_up(data, split.files, (f, g), processes=2).join()
    try:
        # the trainer training runs (its node-drain watcher started before the workers)
        trainer = interruptible(TorchTrainer)(
            _consume,
            train_loop_config={
                "data": data,
                "epochs": epochs,
                "files": split.files,
                "layout": layout,
                "cache": cache,
                "out": str(out),
            },
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name=f"ingest-{time.time_ns()}", storage_path=workdir),
            torch_config=TorchConfig(backend="gloo"),
        )
        trainer.fit()
    finally:
        ray.shutdown()
    m = json.loads(out.read_text())
    ends = m["epoch_ends_s"]
    later = (epochs - 1) * sum(n for *_, n in layout.groups())
    return m["rows"] / m["seconds"], later / (m["seconds"] - ends[0]) if epochs > 1 else 0.0


class _ShardBatches(torch.utils.data.IterableDataset):
    """Each DataLoader worker reads its share of the files with pyarrow and yields
    batches as the model takes them (the same decode and finish functions as elastic's:
    contact maps unpacked in the DataLoader's workers, as a DataLoader user would)."""

    def __init__(self, data, batch_rows: int) -> None:
        from elastic.data.shards import list_shards

        self.data, self.batch_rows, self.files = data, batch_rows, list_shards(data.path)

    def __iter__(self):
        import pyarrow as pa
        import pyarrow.parquet as pq

        from elastic.data.pipeline import decoder, finisher

        d = self.data
        info = torch.utils.data.get_worker_info()
        files = self.files[info.id :: info.num_workers] if info else self.files
        decode, kwargs = decoder(d, self.files[0])
        finish = finisher(d, self.files[0])
        columns = ["sample_id", d.input_column, d.target_column]
        for f in files:
            for rb in pq.ParquetFile(f).iter_batches(self.batch_rows, columns=columns):
                batch = decode(pa.Table.from_batches([rb]), **kwargs)
                yield {**batch, "x": finish(batch["x"])}  # the model's inputs, as elastic's


def _as_is(batch):
    return batch


def _dataloader_ingest(data, epochs: int) -> tuple[float, float]:
    """Rows/s from the first batch, and after the first epoch."""
    loader = torch.utils.data.DataLoader(
        _ShardBatches(data, data.global_batch_size),
        batch_size=None,
        collate_fn=_as_is,  # numpy batches as they are, like elastic's
        num_workers=2,
        prefetch_factor=4,
        persistent_workers=True,
    )
    rows, start, first_end, first_rows = 0, None, 0.0, 0
    for epoch in range(epochs):
        for batch in loader:
            if start is None:
                start = time.perf_counter()
            else:
                rows += len(batch["sample_id"])
        if epoch == 0:
            first_end, first_rows = time.perf_counter(), rows
    end = time.perf_counter()
    later = (rows - first_rows) / (end - first_end) if epochs > 1 else 0.0
    return rows / (end - (start or end)), later


def _steady_data_wait(experiment: str, data, steps: int, workdir: str) -> dict:
    """Train the dataset's experiment for ``steps`` on the bench data; the data-wait
    share of step time over the log intervals after the first step (the first holds the
    pipeline's start) and over the whole run."""
    overrides = [f"+experiment={experiment}", f"data.path={data.path}", "data.val_path=null"]
    if data.format == "image":
        from elastic.data.formats import data_format

        overrides.append(f"data.image.size={data_format('image').settings_of(data).size}")
    records, summary = train(overrides, steps, workdir, "ingest-wait")
    recs = [r for r in records if "train/data_wait_share" in r]
    waited = total = 0.0
    for a, b in zip(recs[:-1], recs[1:], strict=True):
        if a["step"] >= 1:
            dt = b["time"] - a["time"]
            waited += b["train/data_wait_share"] * dt
            total += dt
    return {
        "steady": waited / total if total else None,
        "whole_run": summary["time_breakdown"]["data_wait"],
        "samples_per_s": summary["samples_per_s"],
    }


def measure(args: argparse.Namespace) -> dict:
    root = Path(args.data_dir)
    datasets = _ingest_data(root, args.only or list(INGEST_DATASETS))
    workdir = tempfile.mkdtemp(prefix="elastic-bench-")
    report: dict = {
        "datasets": {},
        "target_streamed_ratio": STREAMED_RATIO_TARGET,
        "cached_before": CACHED_BEFORE,
        "target_data_wait": DATA_WAIT_TARGET,
    }
    try:
        for name, data in datasets.items():
            from elastic.data.pipeline import fits_cache
            from elastic.data.shards import check_dataset

            # as training reads it: each row group kept once read when the split, decoded,
            # fits data.cache_mb; else streamed every epoch
            cached = fits_cache(data, check_dataset(data)["train"])
            rounds = []
            for r in range(args.rounds):
                result = {}
                order = ["elastic", "elastic_streamed", "dataloader"]
                for who in order if r % 2 == 0 else order[::-1]:
                    if who == "dataloader":
                        result[who], result[who + "_later"] = _dataloader_ingest(data, args.epochs)
                    elif who == "elastic_streamed" and not cached:
                        continue  # the same run as "elastic"
                    else:
                        cache = cached and who == "elastic"
                        result[who], result[who + "_later"] = _elastic_ingest(
                            data, args.epochs, workdir, cache
                        )
                result.setdefault("elastic_streamed", result["elastic"])
                result.setdefault("elastic_streamed_later", result["elastic_later"])
                rounds.append(result)
                print(
                    f"{name} round {r + 1}: elastic {result['elastic']:,.0f} rows/s "
                    f"({'cached after the first epoch' if cached else 'streamed'}; streamed "
                    f"every epoch {result['elastic_streamed']:,.0f}), DataLoader "
                    f"{result['dataloader']:,.0f} rows/s",
                    flush=True,
                )
            el = statistics.median(x["elastic"] for x in rounds)
            streamed = statistics.median(x["elastic_streamed"] for x in rounds)
            dl = statistics.median(x["dataloader"] for x in rounds)
            # after the first epoch: the worker group's Ray Data start (task processes
            # started for the workers' reads: ~4 s on 2 cores) is behind
            streamed_later = statistics.median(x["elastic_streamed_later"] for x in rounds)
            dl_later = statistics.median(x["dataloader_later"] for x in rounds)
            experiment = INGEST_DATASETS[name][0]
            wait = _steady_data_wait(experiment, data, args.wait_steps, workdir)
            report["datasets"][name] = {
                "rows": INGEST_DATASETS[name][2],
                "cached": cached,
                "elastic_rows_per_s": el,
                "elastic_streamed_rows_per_s": streamed,
                "dataloader_rows_per_s": dl,
                "ratio": el / dl,
                "ratio_streamed": streamed / dl,
                "elastic_streamed_later_rows_per_s": streamed_later,
                "dataloader_later_rows_per_s": dl_later,
                "ratio_streamed_later": streamed_later / dl_later if dl_later else None,
                "rounds": rounds,
                "experiment": experiment,
                "data_wait": wait,
            }
            print(
                f"{name}: elastic {el:,.0f} rows/s vs DataLoader {dl:,.0f} rows/s: ratio "
                f"{el / dl:.2f} (before: {CACHED_BEFORE.get(name)}); streamed every epoch "
                f"{streamed:,.0f} rows/s, ratio {streamed / dl:.2f} (target >= "
                f"{STREAMED_RATIO_TARGET}); after the first epoch {streamed_later:,.0f} vs "
                f"{dl_later:,.0f} rows/s ({streamed_later / max(dl_later, 1e-9):.2f}); "
                f"{experiment} data wait "
                f"{100 * (wait['steady'] or 0):.1f}% of step time in steady state (target <= "
                f"{100 * DATA_WAIT_TARGET:.0f}%), {100 * wait['whole_run']:.1f}% over the whole "
                "run",
                flush=True,
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report["setup"] = {"epochs": args.epochs, "rounds": args.rounds, "cpus": os.cpu_count()}
    return report
