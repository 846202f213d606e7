"""Benchmarks, each measured side by side with its peer in one run, reported as a ratio.

    python launch/bench.py overhead [--rounds 3] [--steps 600] [--zero-stage 0]
    python launch/bench.py recovery [--rounds 1]
    python launch/bench.py chaos [--seed 0] [--epochs 20]
    python launch/bench.py ingest [--rounds 2] [--epochs 3]
    python launch/bench.py memory [--stages 0 1 2 3] [--worlds 1 2 3]
    python launch/bench.py gpu [--steps 300] [--cpu-check]
    python launch/bench.py all [--quick] [--skip NAME ...]

overhead: steady-state step time of the smoke experiment through ``elastic`` (Ray Train
+ DeepSpeed + streamed Parquet) vs plain ``torchrun --nproc-per-node 2`` DDP on the same
model and the same data held in memory. Steady state is after the first epoch (the
split then comes from each worker's cache); the first epoch, while Ray Data reads and
decodes the shards on the same cores, is reported apart. Rounds alternate which goes
first; the ratio is of the medians. Writes bench-overhead.json.

recovery: on a local multi-raylet cluster (a head and 2 one-worker nodes), seconds from
a worker SIGKILL / a node kill / a node joining to the first training step after it,
with elastic's recovery defaults and, as the peer, with Ray Train's own defaults; and
the checkpoint share of the smoke run's wall time at the default interval. Writes
bench-recovery.json.

ingest: rows/s delivered into 2 Ray Train workers by elastic's pipeline as training
reads (read_parquet -> decode in map_batches -> streaming split -> read-ahead, kept in
the worker after the first epoch when the decoded split fits data.cache_mb -> shuffle
buffer -> per-step batches with the row-count all-reduce; no model), and streamed every
epoch (a split larger than the cache), vs a torch DataLoader with 2 worker
processes reading the same shards with pyarrow and the same decode functions, into one
process. Per dataset (synthetic arrays, images, protein contact maps, CBED patterns, at
scale from their synthetic generators), alternated, rounds take turns going first; the
ratio is of the medians. Then the data-wait share of step time of each dataset's
experiment (steady state: the log intervals after the first step). Writes
bench-ingest.json.

chaos: one run with 10 random worker kills, 2 node removals and 2 node additions, beside
a clean run with the same seed; exactly-once samples and the final validation loss.
Writes bench-chaos.json.

memory: model-state bytes per rank of elastic's DeepSpeed engines (ZeRO 0-3, bf16 and
fp32 Adam, 1-3 gloo ranks), measured from the live tensors after a backward pass,
against the ZeRO paper's formulas (the peer); within 10%. Writes bench-memory.json.

gpu: cbed_vit at ViT-L size (~300M parameters) in bf16, one worker per visible NVIDIA
GPU (NCCL): steady-state samples/s and model FLOPs utilisation (FLOPs counted by torch's
FlopCounterMode, over the GPU's dense bf16 peak). Needs a GPU; --cpu-check runs the same
path small on CPU. Writes bench-gpu.json.

all: overhead, ingest, recovery, chaos and memory in one run, each beside its peer and
target in one Markdown table (bench-all.md) and bench-all.json; --quick takes fewer
rounds and steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch.utils.data

from elastic.observe.metrics import read_records

REPO = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 20


def _smoke_config(extra: list[str]):
    from elastic.config.compose import compose, typed_config

    cfg, name = compose(["+experiment=smoke", *extra])
    return typed_config(cfg, name)


def _train(overrides: list[str], steps: int, workdir: str, label: str) -> tuple[list, dict]:
    """Train ``steps`` steps through launch/run.py (log every 10, no checkpoints, no
    W&B) under ``workdir``; the run's metrics.jsonl records and its summary.json."""
    name = f"{label}-{time.time_ns()}"
    out = Path(workdir) / name
    cmd = [
        sys.executable, str(REPO / "launch/run.py"), *overrides, f"trainer.max_steps={steps}",
        "trainer.log_every_steps=10", "checkpoint.every_steps=0", "logger=none",
        "trainer.progress=off", f"run.storage_path={workdir}", f"run.name={name}",
        f"hydra.run.dir={out}/hydra",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return read_records(str(out)), json.loads((out / "hydra" / "summary.json").read_text())


def _elastic_step_s(overrides: list[str], steps: int, workdir: str) -> dict[str, float]:
    """Step times of one elastic run after warm-up, from its 10-step log intervals.

    ``steady``: the median over the intervals after the first epoch (the train split
    then comes from each worker's cache, or from the read-ahead buffer when it streams
    every epoch): what the rest of a long run costs per step. ``first_epoch``: the median
    over the first epoch's intervals, while Ray Data reads and decodes the Parquet shards
    on the same two cores. ``with_epoch_starts``: the mean over every step after warm-up
    (intervals holding an epoch start included)."""
    records, _ = _train(["+experiment=smoke", *overrides], steps, workdir, "bench")
    times, epochs = {}, {}
    for rec in records:
        if "train/loss" in rec:
            times[rec["step"]], epochs[rec["step"]] = rec["time"], rec["train/epoch"]
    logged = sorted(s for s in times if s >= WARMUP_STEPS)
    first, later = [], []  # an interval holding the first epoch's end is in neither
    for a, b in zip(logged[:-1], logged[1:], strict=True):
        per_step = (times[b] - times[a]) / (b - a)
        if epochs[b] == 0:
            first.append(per_step)
        elif epochs[a] >= 1:
            later.append(per_step)
    if not first or not later:
        raise SystemExit(
            f"bench overhead: --steps {steps} does not reach past the first epoch after "
            f"{WARMUP_STEPS} warm-up steps; give more steps"
        )
    return {
        "steady": statistics.median(later),
        "first_epoch": statistics.median(first),
        "with_epoch_starts": (times[logged[-1]] - times[logged[0]]) / (logged[-1] - logged[0]),
    }


def _torchrun_json(world: int, script: str, args: list[str]) -> dict:
    """Run a peer script under torchrun with ``world`` ranks on this machine (one thread
    each, as Ray gives a 1-CPU worker); the JSON line its rank 0 prints last."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={world}", str(REPO / "launch/peers" / script), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def _torchrun_step_s(cfg, steps: int) -> float:
    args = [
        "--data", cfg.data.path, "--input-dim", str(cfg.model.input_dim),
        "--hidden-dims", ",".join(map(str, cfg.model.hidden_dims)),
        "--output-dim", str(cfg.model.output_dim),
        "--global-batch", str(cfg.data.global_batch_size), "--lr", str(cfg.optim.lr),
        "--steps", str(steps), "--warmup", str(WARMUP_STEPS),
    ]  # fmt: skip
    return float(_torchrun_json(cfg.scaling.max_workers, "ddp_step.py", args)["step_s"])


def overhead(args: argparse.Namespace) -> dict:
    from elastic.train.driver import prepare_data

    overrides = [f"strategy.zero_stage={args.zero_stage}", *args.overrides]
    cfg = _smoke_config(overrides)
    prepare_data(cfg)
    rounds = []
    workdir = tempfile.mkdtemp(prefix="elastic-bench-")
    try:
        for r in range(args.rounds):
            result: dict[str, float] = {}
            order = ["elastic", "torchrun"] if r % 2 == 0 else ["torchrun", "elastic"]
            for who in order:
                if who == "elastic":
                    el = _elastic_step_s(overrides, args.steps, workdir)
                    result["elastic"] = el["steady"]
                    result["elastic_first_epoch"] = el["first_epoch"]
                    result["elastic_with_epoch_starts"] = el["with_epoch_starts"]
                else:
                    result[who] = _torchrun_step_s(cfg, args.steps)
            result["ratio"] = result["elastic"] / result["torchrun"]
            rounds.append(result)
            print(
                f"round {r + 1}: elastic {result['elastic'] * 1e3:.2f} ms/step (first epoch "
                f"{result['elastic_first_epoch'] * 1e3:.2f}), torchrun DDP "
                f"{result['torchrun'] * 1e3:.2f} ms/step: ratio {result['ratio']:.3f}",
                flush=True,
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    el, tr = median("elastic"), median("torchrun")
    first, with_starts = median("elastic_first_epoch"), median("elastic_with_epoch_starts")
    report = {
        "ratio": el / tr,
        "elastic_step_s": el,
        "torchrun_step_s": tr,
        "ratio_per_round_median": median("ratio"),
        "elastic_first_epoch_step_s": first,
        "ratio_first_epoch": first / tr,
        "elastic_step_s_with_epoch_starts": with_starts,
        "ratio_with_epoch_starts": with_starts / tr,
        "target": 1.10,
        "rounds": rounds,
        "setup": {
            "experiment": "smoke",
            "overrides": overrides,
            "steps": args.steps,
            "warmup_steps": WARMUP_STEPS,
            "workers": cfg.scaling.max_workers,
            "global_batch_size": cfg.data.global_batch_size,
            "steps_per_epoch": -(-cfg.data.synthetic.rows // cfg.data.global_batch_size)
            if cfg.data.synthetic
            else None,
            "cpus": os.cpu_count(),
        },
    }
    print(
        f"overhead: elastic {el * 1e3:.2f} ms/step vs torchrun DDP {tr * 1e3:.2f} ms/step: "
        f"ratio {el / tr:.3f} (target <= 1.10); first epoch (Parquet read and decoded on "
        f"the same cores) {first * 1e3:.2f} ms/step, ratio {first / tr:.3f}; with epoch "
        f"starts {with_starts * 1e3:.2f} ms/step, ratio {with_starts / tr:.3f}"
    )
    return report


# -- recovery and chaos: a real multi-raylet cluster on this machine -------------------

ELASTIC_MODEL = [  # big enough that a step is real work, small enough for 2 cores
    "model.input_dim=64",
    "model.output_dim=4",
    "model.hidden_dims=[1024,1024]",
    "data.global_batch_size=64",
    "trainer.log_every_steps=1",
    "checkpoint.every_steps=5",
    "logger=none",
    "scaling.min_workers=1",
    "scaling.max_workers=2",
    "scaling.cpus_per_worker=3",  # = a worker node's CPUs: one training worker per node
]
RAY_DEFAULT_KNOBS = [  # Ray Train 2.60's own values of the knobs elastic tunes
    "scaling.start_timeout_s=60",
    "scaling.health_check_interval_s=2",
    "scaling.worker_health_check_timeout_s=600",
    "scaling.resize_interval_s=60",
    "scaling.node_refresh_s=20",
    "scaling.drain_poll_interval_s=5",
]


def _elastic_data(workdir: str, seed: int = 1) -> list[str]:
    from elastic.datasets.synthetic import generate

    root = os.path.join(workdir, "data")
    if not os.path.isdir(root):
        generate(f"{root}/train", f"{root}/val", 2048, 256, 8, 64, 4, seed=seed)
    return [f"data.path={root}/train", f"data.val_path={root}/val"]


def _wait_step(
    run, since: float, world: int | None = None, restarted: bool = False, timeout: float = 300
) -> float:
    """Time of the first training step logged after ``since`` (at ``world`` workers;
    ``restarted``: by a worker group started after ``since``, not a step that was already
    in flight when a worker was killed)."""

    def first() -> float | None:
        records = run.records()
        start = since
        if restarted:
            marks = [r["time"] for r in records if r.get("event") == "restart"]
            marks = [m for m in marks if m > since]
            if not marks:
                return None
            start = marks[0]
        for r in records:
            ok = world is None or r.get("train/world_size") == world
            if "train/loss" in r and r["time"] > start and ok:
                return r["time"]
        return None

    return run.wait_for(f"a step at world size {world or 'any'}", first, timeout=timeout)


def _wait_checkpoint(run, timeout: float = 300) -> None:
    """Until Ray has registered a checkpoint newer than the step trained now."""
    now = run.last_step()
    run.wait_for("a checkpoint", lambda: any(s > now for s in run.registered_steps()), timeout)


def _recovery_round(workdir: str, knobs: list[str], label: str) -> dict:
    from elastic.cluster.localcluster import RayCluster, Run

    overrides = [
        "+experiment=smoke",
        *ELASTIC_MODEL,
        "trainer.max_steps=0",
        "trainer.max_epochs=1000",
        *_elastic_data(workdir),
        *knobs,
    ]
    cluster = RayCluster(2)
    run = Run(Path(workdir), f"recovery-{label}-{time.time_ns()}", overrides, cluster.address)
    out: dict = {}
    try:
        run.wait_for("a checkpoint", lambda: run.registered_steps())
        t = time.time()
        os.kill(cluster.train_worker_pids()[0], signal.SIGKILL)
        out["worker_kill_s"] = _wait_step(run, t, restarted=True) - t

        _wait_checkpoint(run)
        t = time.time()
        cluster.remove_node(cluster.nodes[0])
        out["shrink_s"] = _wait_step(run, t, world=1) - t

        _wait_checkpoint(run)
        t = time.time()
        cluster.add_node()
        out["grow_s"] = _wait_step(run, t, world=2) - t
        run.signal(signal.SIGTERM)  # checkpoint and stop: the benchmark has what it needs
        run.finish()
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
        cluster.shutdown()
    print(f"{label}: " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()), flush=True)
    return out


def _checkpoint_share(workdir: str) -> dict:
    """Checkpoint share of wall time of the smoke run at the default interval."""
    from elastic.cluster.localcluster import Run

    run = Run(Path(workdir), f"ckpt-{time.time_ns()}", ["+experiment=smoke", "logger=none"])
    if run.finish() != 0:
        raise RuntimeError("the smoke run failed:\n" + run.output()[-5000:])
    summary = run.summary()
    return {
        "checkpoint_overhead": summary["time_breakdown"]["checkpoint"],
        "checkpoint_every_steps": _smoke_config([]).checkpoint.every_steps,
        "steps": summary["steps"],
    }


def recovery(args: argparse.Namespace) -> dict:
    workdir = tempfile.mkdtemp(prefix="elastic-bench-")
    rounds = []
    try:
        for r in range(args.rounds):
            order = [("elastic", []), ("ray_defaults", RAY_DEFAULT_KNOBS)]
            if r % 2:
                order.reverse()
            rounds.append({label: _recovery_round(workdir, knobs, label) for label, knobs in order})
        ckpt = _checkpoint_share(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    keys = ("shrink_s", "grow_s", "worker_kill_s")
    med = {
        who: {k: statistics.median(r[who][k] for r in rounds) for k in keys}
        for who in ("elastic", "ray_defaults")
    }
    report = {
        **{k: med["elastic"][k] for k in keys},
        **{f"{k}_ray_defaults": med["ray_defaults"][k] for k in keys},
        **{f"{k}_ratio": med["elastic"][k] / med["ray_defaults"][k] for k in keys},
        **ckpt,
        "targets": {
            "shrink_s": 15.0,
            "grow_s": "resize_interval_s + 10 = 20.0",
            "checkpoint_overhead": 0.02,
        },
        "rounds": rounds,
        "setup": {
            "cluster": "ray.cluster_utils.Cluster: head (2 CPUs) + 2 worker nodes (3 CPUs, "
            "one training worker each); GCS health check 1 s x 3",
            "model": ELASTIC_MODEL,
            "ray_default_knobs": RAY_DEFAULT_KNOBS,
            "cpus": os.cpu_count(),
        },
    }
    print(
        "recovery (elastic vs Ray defaults): "
        + ", ".join(
            f"{k} {med['elastic'][k]:.1f} s vs {med['ray_defaults'][k]:.1f} s" for k in keys
        )
        + f"; checkpoint overhead {100 * ckpt['checkpoint_overhead']:.2f}% of wall time"
    )
    return report


def chaos(args: argparse.Namespace) -> dict:
    """10 worker kills, 2 node removals, 2 node additions, in a seeded random order, each
    once the run has checkpointed past the previous one's restart."""
    import random

    rng = random.Random(args.seed)
    actions = ["kill"] * 10 + ["remove"] * 2 + ["add"] * 2
    while True:  # never fewer than one worker node, never more than two
        rng.shuffle(actions)
        nodes, ok = 2, True
        for a in actions:
            nodes += {"remove": -1, "add": 1}.get(a, 0)
            ok = ok and 1 <= nodes <= 2
        if ok:
            break
    workdir = tempfile.mkdtemp(prefix="elastic-bench-")
    overrides = [
        "+experiment=smoke",
        *ELASTIC_MODEL,
        # a cosine decay to 0 over the run: the final loss then reflects the training,
        # not the last steps' noise (which differs with the batch order resizes bring)
        f"trainer.max_steps={args.epochs * 2048 // 64}",  # the data's rows / global batch
        "trainer.max_epochs=0",
        "optim.schedule=cosine",
        "optim.warmup_steps=20",
        "scaling.max_failures=-1",  # 14 failures on purpose
        *_elastic_data(workdir),
    ]
    try:
        results = {
            label: _chaos_run(workdir, label, overrides, todo, rng)
            for label, todo in (("chaos", actions), ("clean", []))
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    chaotic, clean = results["chaos"], results["clean"]
    val_gap = abs(chaotic["val_loss"] - clean["val_loss"]) / clean["val_loss"]
    train_gap = abs(chaotic["loss_last"] - clean["loss_last"]) / clean["loss_last"]
    report = {
        "finished": chaotic["status"] == "finished" and chaotic["exit_code"] == 0,
        "samples_exactly_once": chaotic["samples_exactly_once"],
        "val_loss_gap": val_gap,
        "train_loss_gap": train_gap,
        "target_loss_gap": 0.02,
        "actions": {a: actions.count(a) for a in ("kill", "remove", "add")},
        "runs": results,
        "setup": {"model": ELASTIC_MODEL, "epochs": args.epochs, "seed": args.seed},
    }
    print(
        f"chaos: finished={report['finished']} exactly_once={report['samples_exactly_once']} "
        f"val loss {chaotic['val_loss']:.5f} vs clean {clean['val_loss']:.5f} "
        f"(gap {100 * val_gap:.2f}%), last train loss gap {100 * train_gap:.2f}%, "
        f"wall {chaotic['wall_s']:.0f} s vs {clean['wall_s']:.0f} s"
    )
    return report


def _chaos_run(workdir: str, label: str, overrides: list[str], actions: list[str], rng) -> dict:
    from elastic.cluster.localcluster import RayCluster, Run

    cluster = RayCluster(2)
    run = Run(Path(workdir), label, overrides, cluster.address)
    done = []
    try:
        for action in actions:
            _wait_checkpoint(run)
            if action == "kill":
                pids = run.wait_for("training workers", cluster.train_worker_pids)
                os.kill(rng.choice(pids), signal.SIGKILL)
            elif action == "remove":
                cluster.remove_node(rng.choice(cluster.nodes))
            else:
                cluster.add_node()
            done.append((action, run.last_step()))
            print(f"chaos: {action} at step {run.last_step()}", flush=True)
            _wait_step(run, time.time())  # the next action only once it trains again
        rc = run.finish(timeout=1800)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
        cluster.shutdown()
    summary = run.summary()
    return {
        "exit_code": rc,
        "status": summary["status"],
        "samples_exactly_once": summary["samples_exactly_once"],
        "world_sizes": summary["world_sizes"],
        "loss_last": summary["loss_last"],
        "val_loss": summary["val"]["loss"],
        "wall_s": summary["wall_s"],
        "actions": done,
        "restarts": [e for e in summary["events"] if e["event"] == "restart"],
    }


# -- ingest: elastic's data path vs a torch DataLoader ---------------------------------

INGEST_DATASETS = {
    # name: (experiment, DataConfig overrides, what the rows are)
    "synthetic": ("smoke", {}, "float32[256] + target[16]"),
    "images": ("images_resnet", {"image_size": 32}, "32x32 PNG bytes, decoded + resized"),
    "protein": ("protein_cvae", {}, "214-residue contact maps, 22,791 bits unpacked"),
    "cbed": ("cbed_cnn", {}, "float32[64x64] patterns"),
}


def _ingest_data(root: Path, names: list[str]) -> dict[str, object]:
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
                from elastic.datasets.protein import synthetic

                synthetic(d / "train", 4000, shards=16)
            else:
                from elastic.datasets.cbed import synthetic

                synthetic(d, 16000, val_fraction=0.0, shards=16)
        overrides = [f"+experiment={experiment}", f"data.path={d}/train", "data.val_path=null"]
        cfg, exp = compose(overrides)
        data = typed_config(cfg, exp).data
        data.val_path = None
        for key, value in extra.items():
            setattr(data, key, value)
        made[name] = data
    return made


def _consume(config: dict) -> None:
    """A Ray Train worker that only takes its rows, the way the training loop does
    (read-ahead, the split cached in memory after the first epoch when it fits
    data.cache_mb, or streamed every epoch when ``cache`` is false; shuffle buffer; cut
    into per-step batches with the lock-step row-count all-reduce every step does)."""
    import ray.train
    import torch
    import torch.distributed as dist

    from elastic.data.stream import EpochPrefetcher, StepStream, shuffled

    data, epochs, rows_per_step = config["data"], config["epochs"], config["rows_per_step"]
    rank = ray.train.get_context().get_world_rank()
    prefetcher = EpochPrefetcher(
        ray.train.get_dataset_shard("train"),
        int(data.prefetch_mb * 2**20),
        epochs=epochs,
        cache=config["cache"],
        block_order=(data.seed, rank) if data.shuffle_files else None,
    )

    def count(rows: int) -> int:
        t = torch.tensor([rows], dtype=torch.int64)
        dist.all_reduce(t)
        return int(t[0])

    rows, start = 0, None
    for epoch in range(epochs):
        blocks = prefetcher.epoch(epoch)
        blocks = shuffled(blocks, data.shuffle_buffer_rows, data.seed, epoch, rank)
        for batch in StepStream(blocks, rows_per_step, count):
            if start is None:  # from the first rows: not Ray Train's start-up
                start = time.perf_counter()
            else:
                rows += batch.rows
    dist.barrier()  # the slower worker ends the measurement
    elapsed = time.perf_counter() - (start or time.perf_counter())
    prefetcher.close()
    total = count(rows)
    if rank == 0:  # Ray Train 2.60 keeps only metrics reported with a checkpoint
        Path(config["out"]).write_text(json.dumps({"rows": total, "seconds": elapsed}))


def _elastic_ingest(data, epochs: int, workdir: str, cache: bool) -> float:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from elastic.cluster.connect import WORKER_ENV
    from elastic.data.pipeline import build_datasets, data_config
    from elastic.data.shards import check_dataset

    splits = check_dataset(data)
    out = Path(workdir) / f"ingest-{time.time_ns()}.json"
    ray.init(
        address="local",
        num_cpus=4,
        object_store_memory=512 * 2**20,
        include_dashboard=False,
        runtime_env={"env_vars": dict(WORKER_ENV)},
        log_to_driver=False,
    )
    try:
        import ray.data

        ray.data.DataContext.get_current().enable_progress_bars = False
        trainer = TorchTrainer(
            _consume,
            train_loop_config={
                "data": data,
                "epochs": epochs,
                "rows_per_step": data.global_batch_size // 2,
                "cache": cache,
                "out": str(out),
            },
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name=f"ingest-{time.time_ns()}", storage_path=workdir),
            datasets=build_datasets(data, splits, 2),
            # streamed: each epoch's file order, as the driver sets it (epoch 0 here)
            dataset_config=data_config(None if cache else lambda: 0),
            torch_config=TorchConfig(backend="gloo"),
        )
        trainer.fit()
    finally:
        ray.shutdown()
    m = json.loads(out.read_text())
    return m["rows"] / m["seconds"]


class _ShardBatches(torch.utils.data.IterableDataset):
    """Each DataLoader worker reads its share of the files with
    pyarrow and yields decoded batches (the same decode functions as elastic's)."""

    def __init__(self, data, batch_rows: int) -> None:
        from elastic.data.shards import list_shards

        self.data, self.batch_rows, self.files = data, batch_rows, list_shards(data.path)

    def __iter__(self):
        import pyarrow as pa
        import pyarrow.parquet as pq

        from elastic.data.pipeline import decoder

        d = self.data
        info = torch.utils.data.get_worker_info()
        files = self.files[info.id :: info.num_workers] if info else self.files
        decode, kwargs = decoder(d, self.files[0])
        columns = ["sample_id", d.input_column, d.target_column]
        for f in files:
            for rb in pq.ParquetFile(f).iter_batches(self.batch_rows, columns=columns):
                yield decode(pa.Table.from_batches([rb]), **kwargs)


def _as_is(batch):
    return batch


def _dataloader_ingest(data, epochs: int) -> float:
    loader = torch.utils.data.DataLoader(
        _ShardBatches(data, data.global_batch_size),
        batch_size=None,
        collate_fn=_as_is,  # numpy batches as they are, like elastic's
        num_workers=2,
        prefetch_factor=4,
        persistent_workers=True,
    )
    rows, start = 0, None
    for _ in range(epochs):
        for batch in loader:
            if start is None:
                start = time.perf_counter()
            else:
                rows += len(batch["sample_id"])
    return rows / (time.perf_counter() - (start or time.perf_counter()))


def _steady_data_wait(experiment: str, data, steps: int, workdir: str) -> dict:
    """Train the dataset's experiment for ``steps`` on the bench data; the data-wait
    share of step time over the log intervals after the first step (the first holds the
    pipeline's start) and over the whole run."""
    overrides = [f"+experiment={experiment}", f"data.path={data.path}", "data.val_path=null"]
    if data.format == "image":
        overrides.append(f"data.image_size={data.image_size}")
    records, summary = _train(overrides, steps, workdir, "ingest-wait")
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


def ingest(args: argparse.Namespace) -> dict:
    root = Path(args.data_dir)
    datasets = _ingest_data(root, args.only or list(INGEST_DATASETS))
    workdir = tempfile.mkdtemp(prefix="elastic-bench-")
    report: dict = {"datasets": {}, "target_ratio": 1.0, "target_data_wait": 0.05}
    try:
        for name, data in datasets.items():
            from elastic.data.pipeline import fits_cache
            from elastic.data.shards import check_dataset

            # as training reads it: cached after the first epoch when the split, decoded,
            # fits data.cache_mb at 2 workers; else streamed every epoch
            cached = fits_cache(data, check_dataset(data)["train"], 2)
            rounds = []
            for r in range(args.rounds):
                result = {}
                order = ["elastic", "elastic_streamed", "dataloader"]
                for who in order if r % 2 == 0 else order[::-1]:
                    if who == "dataloader":
                        result[who] = _dataloader_ingest(data, args.epochs)
                    elif who == "elastic_streamed" and not cached:
                        continue  # the same run as "elastic"
                    else:
                        cache = cached and who == "elastic"
                        result[who] = _elastic_ingest(data, args.epochs, workdir, cache)
                result.setdefault("elastic_streamed", result["elastic"])
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
                "rounds": rounds,
                "experiment": experiment,
                "data_wait": wait,
            }
            print(
                f"{name}: elastic {el:,.0f} rows/s vs DataLoader {dl:,.0f} rows/s: ratio "
                f"{el / dl:.2f} (target >= 1.0); streamed every epoch {streamed:,.0f} rows/s, "
                f"ratio {streamed / dl:.2f}; {experiment} data wait "
                f"{100 * (wait['steady'] or 0):.1f}% of step time in steady state, "
                f"{100 * wait['whole_run']:.1f}% over the whole run (target <= 5%)",
                flush=True,
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report["setup"] = {"epochs": args.epochs, "rounds": args.rounds, "cpus": os.cpu_count()}
    return report


# ZeRO paper (Rajbhandari et al. 2020), model-state bytes per parameter on one rank, Adam:
# mixed precision: 2 (bf16 params) + 2 (bf16 grads) + K=12 (fp32 master, momentum,
# variance), partitioned by stage. fp32 equivalents: 4 + 4 + K, where DeepSpeed keeps an
# fp32 master partition even for fp32 params at stages 1-3 (K=12) and stage 0 is the
# plain torch Adam (K=8: moments only).
ZERO_BYTES_PER_PARAM = {
    "bf16": {
        0: lambda n: 16.0,
        1: lambda n: 4 + 12 / n,
        2: lambda n: 2 + 14 / n,
        3: lambda n: 16 / n,
    },
    "fp32": {
        0: lambda n: 16.0,
        1: lambda n: 8 + 12 / n,
        2: lambda n: 4 + 16 / n,
        3: lambda n: 20 / n,
    },
}
MEMORY_TOLERANCE = 0.10


def _zero_memory(stage: int, precision: str, world: int, hidden: int, layers: int) -> dict:
    args = ["--stage", str(stage), "--precision", precision, "--hidden", str(hidden),
            "--layers", str(layers)]  # fmt: skip
    return _torchrun_json(world, "zero_memory.py", args)


def memory(args: argparse.Namespace) -> dict:
    """Model-state bytes per rank of elastic's engines vs the ZeRO paper's formulas."""
    rows = []
    for precision in args.precision:
        for stage in args.stages:
            for world in args.worlds:
                m = _zero_memory(stage, precision, world, args.hidden, args.layers)
                psi = m["psi"]
                worst = max(m["ranks"], key=lambda r: r["model_state_bytes"])
                measured = worst["model_state_bytes"] / psi
                formula = ZERO_BYTES_PER_PARAM[precision][stage](world)
                row = {
                    "precision": precision,
                    "stage": stage,
                    "world": world,
                    "params": psi,
                    "measured_bytes_per_param": measured,
                    "formula_bytes_per_param": formula,
                    "ratio": measured / formula,
                    "within_tolerance": abs(measured / formula - 1) <= MEMORY_TOLERANCE,
                    "note": "",
                    "other_bytes_per_param": worst["other_bytes"] / psi,
                    "parts_bytes_per_param": {k: v / psi for k, v in worst["parts"].items()},
                }
                if stage == 1 and world > 1:
                    # DeepSpeed runs stage 1 in its stage-2 optimizer: gradients are
                    # reduce-scattered into partitions too, so stage 1 takes less than the
                    # paper's P_os formula; the stage-2 formula is what it implements
                    like2 = measured / ZERO_BYTES_PER_PARAM[precision][2](world)
                    row["ratio_to_stage2_formula"] = like2
                    row["note"] = f"gradients partitioned too: {like2:.2f}x the stage-2 formula"
                rows.append(row)
                print(
                    f"{precision} ZeRO-{stage} x{world}: {measured:.2f} bytes/param measured vs "
                    f"{formula:.2f} formula ({measured / formula:.2f}x; "
                    f"{'within' if row['within_tolerance'] else 'OUTSIDE'} "
                    f"{MEMORY_TOLERANCE:.0%}), other tensors {row['other_bytes_per_param']:.1f}"
                    f" bytes/param {row['note']}",
                    flush=True,
                )
    return {
        "rows": rows,
        "tolerance": MEMORY_TOLERANCE,
        "model": f"MLP 512-{args.hidden}x{args.layers}-8",
        "all_within_tolerance": all(r["within_tolerance"] for r in rows),
    }


# -- gpu: the largest experiment at ViT-L size on NVIDIA GPUs ---------------------------

# dense bf16 tensor-core peak per GPU (vendor datasheets, TFLOP/s), matched in the name
GPU_PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
)
VIT_L = ["model.dim=1024", "model.depth=24", "model.heads=16"]
VIT_CPU_CHECK = ["model.dim=64", "model.depth=2", "model.heads=4"]


def flops_per_sample(overrides: list[str]) -> tuple[float, int]:
    """Training FLOPs (forward + backward) per sample of the composed experiment's model,
    counted by torch's FlopCounterMode on the meta device (no memory, no data), and its
    parameter count."""
    from torch.utils.flop_counter import FlopCounterMode

    from elastic.config.compose import compose
    from elastic.config.validate import to_typed

    cfg = to_typed(compose(overrides)[0])
    with torch.device("meta"):
        model = cfg.model.build()
    width = getattr(cfg.model, "input_dim", None)
    shape = (8, width) if width else (8, cfg.model.in_channels, cfg.model.side, cfg.model.side)
    with FlopCounterMode(display=False) as counter:
        model(torch.empty(shape, device="meta")).float().sum().backward()
    return counter.get_total_flops() / 8, sum(p.numel() for p in model.parameters())


def gpu(args: argparse.Namespace) -> dict:
    """Samples/s and model FLOPs utilisation of cbed_vit at ViT-L size, bf16, one worker
    per GPU, steady state (log intervals after the warm-up steps)."""
    import torch.cuda

    from elastic.datasets.cbed import Settings, synthetic

    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.cpu_check:
        raise SystemExit(
            "bench gpu: no CUDA GPU here (torch.cuda.is_available() is False): run it on a "
            "GPU node, or add --cpu-check to run the same path small on CPU"
        )
    gpus = torch.cuda.device_count() if on_gpu else 1
    name = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    peak = args.peak_tflops or next((t for k, t in GPU_PEAK_BF16_TFLOPS if k in name), None)
    data = Path(args.data_dir)
    if not (data / "train").is_dir():
        synthetic(data, args.rows, Settings(size=64), val_fraction=0.0, shards=16)
    model = VIT_L if on_gpu else VIT_CPU_CHECK
    overrides = [
        "+experiment=cbed_vit", *model, f"data.path={data}/train", "data.val_path=null",
        f"data.global_batch_size={args.batch_per_gpu * gpus}", f"scaling.workers={gpus}",
        f"scaling.use_gpu={str(on_gpu).lower()}", "strategy.precision=bf16",
        f"strategy.zero_stage={args.zero_stage}", f"scaling.cpus_per_worker={args.cpus_per_gpu}",
        f"data.cache_mb={args.cache_mb}",
    ]  # fmt: skip
    flops, params = flops_per_sample(overrides)
    steps = args.steps if on_gpu else 40
    workdir = tempfile.mkdtemp(prefix="elastic-bench-")
    try:
        records, summary = _train(overrides, steps, workdir, "gpu")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    records = [r for r in records if "train/loss" in r]
    warm = [r for r in records if r["step"] >= min(args.warmup_steps, steps // 2)]
    span_s = warm[-1]["time"] - warm[0]["time"]
    samples_per_s = (warm[-1]["step"] - warm[0]["step"]) * args.batch_per_gpu * gpus / span_s
    achieved = samples_per_s * flops
    report = {
        "device": name,
        "gpus": gpus,
        "params": params,
        "model": "cbed_vit " + " ".join(model),
        "flops_per_sample": flops,
        "samples_per_s": samples_per_s,
        "achieved_tflops_per_gpu": achieved / gpus / 1e12,
        "peak_bf16_tflops_per_gpu": peak,
        "mfu": achieved / (gpus * peak * 1e12) if peak and on_gpu else None,
        "data_wait": summary["time_breakdown"]["data_wait"],
        "time_breakdown": summary["time_breakdown"],
        "setup": {"overrides": overrides, "steps": steps, "warmup_steps": args.warmup_steps},
        "date": time.strftime("%Y-%m-%d"),
    }
    mfu = f"{100 * report['mfu']:.1f}%" if report["mfu"] is not None else "n/a (no GPU peak)"
    print(
        f"gpu: {name} x{gpus}, {params / 1e6:.1f}M params, {flops / 1e9:.3g} GFLOP/sample: "
        f"{samples_per_s:,.0f} samples/s, {report['achieved_tflops_per_gpu']:.3g} TFLOP/s per "
        f"device, MFU {mfu}; data wait {100 * report['data_wait']:.1f}% of the run"
    )
    return report


# -- all: every benchmark in one run, one table -----------------------------------------

ALL_ORDER = ("overhead", "ingest", "recovery", "chaos", "memory")
QUICK = {  # --quick: fewer rounds and steps, same figures (noisier)
    "overhead": ["--rounds", "1", "--steps", "400"],
    "ingest": ["--rounds", "1", "--wait-steps", "60"],
    "recovery": ["--rounds", "1"],
    "chaos": ["--epochs", "10"],
    "memory": ["--precision", "bf16"],
}
ISSUE_TARGETS = {"step_ratio": 1.05, "ingest_ratio": 1.0, "data_wait": 0.02, "checkpoint": 0.02}


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "NOT met")


def _table_rows(results: dict) -> list[tuple[str, str, str, str, str, str]]:
    """(figure, elastic, peer, ratio, target, verdict) for every measured figure."""
    rows: list[tuple[str, str, str, str, str, str]] = []
    t = ISSUE_TARGETS
    if o := results.get("overhead"):
        rows.append((
            "step time, steady state (smoke, 2 workers)", f"{o['elastic_step_s'] * 1e3:.1f} ms",
            f"{o['torchrun_step_s'] * 1e3:.1f} ms (torchrun DDP)", f"{o['ratio']:.2f}",
            f"<= {t['step_ratio']}", _verdict(o["ratio"] <= t["step_ratio"]),
        ))  # fmt: skip
        rows.append((
            "step time, first epoch (Parquet decoded on the same cores)",
            f"{o['elastic_first_epoch_step_s'] * 1e3:.1f} ms",
            f"{o['torchrun_step_s'] * 1e3:.1f} ms (torchrun DDP)",
            f"{o['ratio_first_epoch']:.2f}", "", "n/a",
        ))  # fmt: skip
    for name, d in (results.get("ingest") or {}).get("datasets", {}).items():
        how = "cached after epoch 1" if d["cached"] else "streamed"
        rows.append((
            f"ingest {name}, rows/s into 2 workers ({how})", f"{d['elastic_rows_per_s']:,.0f}",
            f"{d['dataloader_rows_per_s']:,.0f} (DataLoader, 2 procs)", f"{d['ratio']:.2f}",
            f">= {t['ingest_ratio']}", _verdict(d["ratio"] >= t["ingest_ratio"]),
        ))  # fmt: skip
        if d["cached"]:
            rows.append((
                f"ingest {name}, streamed every epoch (larger than data.cache_mb)",
                f"{d['elastic_streamed_rows_per_s']:,.0f}",
                f"{d['dataloader_rows_per_s']:,.0f} (DataLoader, 2 procs)",
                f"{d['ratio_streamed']:.2f}", f">= {t['ingest_ratio']}",
                _verdict(d["ratio_streamed"] >= t["ingest_ratio"]),
            ))  # fmt: skip
        steady = d["data_wait"]["steady"]
        rows.append((
            f"data wait, {d['experiment']} (steady state)",
            "n/a" if steady is None else f"{100 * steady:.1f}%", "", "",
            f"<= {100 * t['data_wait']:.0f}%",
            _verdict(None if steady is None else steady <= t["data_wait"]),
        ))  # fmt: skip
    if r := results.get("recovery"):
        for key, label, target in (
            ("shrink_s", "node killed -> first step at 1 worker", 15.0),
            ("grow_s", "node added -> first step at 2 workers", 20.0),
            ("worker_kill_s", "worker SIGKILL -> next step", None),
        ):
            rows.append((
                label, f"{r[key]:.1f} s", f"{r[key + '_ray_defaults']:.1f} s (Ray Train defaults)",
                f"{r[key + '_ratio']:.2f}", "" if target is None else f"<= {target:.0f} s",
                _verdict(None if target is None else r[key] <= target),
            ))  # fmt: skip
        rows.append((
            f"checkpoint share of wall time (every {r['checkpoint_every_steps']} steps)",
            f"{100 * r['checkpoint_overhead']:.2f}%", "", "", f"<= {100 * t['checkpoint']:.0f}%",
            _verdict(r["checkpoint_overhead"] <= t["checkpoint"]),
        ))  # fmt: skip
    if c := results.get("chaos"):
        clean = c["runs"]["clean"]["val_loss"]
        rows.append((
            f"val loss after {sum(c['actions'].values())} kills/removals/additions",
            f"{c['runs']['chaos']['val_loss']:.4f}", f"{clean:.4f} (the same run, undisturbed)",
            f"{1 + c['val_loss_gap']:.3f}", f"within {100 * c['target_loss_gap']:.0f}%, "
            "every sample once",
            _verdict(c["finished"] and c["samples_exactly_once"]
                     and c["val_loss_gap"] <= c["target_loss_gap"]),
        ))  # fmt: skip
    if m := results.get("memory"):
        by: dict[tuple[str, int], list[dict]] = {}
        for row in m["rows"]:
            by.setdefault((row["precision"], row["stage"]), []).append(row)
        for (precision, stage), cells in by.items():
            worlds = "/".join(str(c["world"]) for c in cells)
            worst = max(cells, key=lambda c: abs(c["ratio"] - 1))
            to2 = [
                f"{c['ratio_to_stage2_formula']:.2f}"
                for c in cells
                if "ratio_to_stage2_formula" in c
            ]
            notes = f"gradients partitioned too: {'/'.join(to2)}x the stage-2 formula"
            notes = notes if to2 else ""
            verdict = _verdict(all(c["within_tolerance"] for c in cells))
            outside = [c for c in cells if not c["within_tolerance"]]
            if outside and all(c["ratio"] < 1 and "ratio_to_stage2_formula" in c for c in outside):
                verdict = "below the formula"  # stage 1: DeepSpeed partitions more
            rows.append((
                f"model-state bytes/param, ZeRO-{stage} {precision}, N={worlds}",
                " / ".join(f"{c['measured_bytes_per_param']:.2f}" for c in cells),
                " / ".join(f"{c['formula_bytes_per_param']:.2f}" for c in cells)
                + " (ZeRO formula)",
                f"{worst['ratio']:.2f}", f"within {100 * m['tolerance']:.0f}%",
                verdict + (f" ({notes})" if notes else ""),
            ))  # fmt: skip
    return rows


def markdown_table(results: dict) -> str:
    lines = [
        "| figure | elastic | peer | ratio | target | verdict |",
        "|---|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in _table_rows(results)]
    return "\n".join(lines) + "\n"


def run_all(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """Every benchmark in turn with its own defaults (``--quick``: fewer rounds); each
    writes its own bench-NAME.json as well; one failing does not stop the others."""
    results: dict = {}
    errors: dict[str, str] = {}
    for name in ALL_ORDER:
        if name in args.skip:
            continue
        sub_args = parser.parse_args([name, *(QUICK[name] if args.quick else [])])
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        try:
            results[name] = BENCHES[name](sub_args)
        except Exception as e:  # report it and go on: the table shows what was measured
            errors[name] = f"{type(e).__name__}: {e}"
            print(f"{name} failed: {errors[name]}", flush=True)
            continue
        results[name]["bench_s"] = time.perf_counter() - start
        Path(f"bench-{name}.json").write_text(json.dumps(results[name], indent=2) + "\n")
    table = markdown_table(results)
    Path("bench-all.md").write_text(table)
    print(table)
    return {
        "results": results,
        "errors": errors,
        "table": table,
        "quick": args.quick,
        "date": time.strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
    }


BENCHES = {
    "overhead": overhead,
    "recovery": recovery,
    "chaos": chaos,
    "ingest": ingest,
    "memory": memory,
    "gpu": gpu,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="bench", required=True)
    o = sub.add_parser("overhead", help="step time vs plain torchrun DDP")
    o.add_argument("--rounds", type=int, default=3)
    o.add_argument("--steps", type=int, default=600)
    o.add_argument(
        "--zero-stage",
        type=int,
        default=0,
        help="0 is DeepSpeed's plain data parallelism: like for like with DDP",
    )
    o.add_argument("overrides", nargs="*", help="extra config overrides for the elastic run")
    r = sub.add_parser("recovery", help="shrink/grow/worker-kill recovery vs Ray defaults")
    r.add_argument("--rounds", type=int, default=1)
    c = sub.add_parser("chaos", help="random kills, removals and additions vs a clean run")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--epochs", type=int, default=20)
    i = sub.add_parser("ingest", help="rows/s into 2 workers vs a torch DataLoader")
    i.add_argument("--rounds", type=int, default=2)
    i.add_argument("--epochs", type=int, default=3)
    i.add_argument("--wait-steps", type=int, default=100)
    i.add_argument("--data-dir", default="data/bench-ingest", help="generated once, reused")
    i.add_argument("--only", nargs="*", choices=sorted(INGEST_DATASETS), help="some datasets")
    m = sub.add_parser("memory", help="model-state bytes per rank vs the ZeRO formulas")
    m.add_argument("--stages", type=int, nargs="*", default=[0, 1, 2, 3])
    m.add_argument("--worlds", type=int, nargs="*", default=[1, 2, 3])
    m.add_argument("--precision", nargs="*", choices=["bf16", "fp32"], default=["bf16", "fp32"])
    m.add_argument("--hidden", type=int, default=1024, help="MLP width")
    m.add_argument("--layers", type=int, default=12, help="MLP hidden layers")
    g = sub.add_parser("gpu", help="samples/s and MFU of cbed_vit at ViT-L size on GPUs")
    g.add_argument("--steps", type=int, default=300)
    g.add_argument("--warmup-steps", type=int, default=50)
    g.add_argument("--batch-per-gpu", type=int, default=64)
    g.add_argument("--zero-stage", type=int, default=2)
    g.add_argument("--cpus-per-gpu", type=float, default=2)
    g.add_argument("--cache-mb", type=float, default=4096)
    g.add_argument("--rows", type=int, default=16384)
    g.add_argument("--data-dir", default="data/bench-gpu", help="generated once, reused")
    g.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, if unknown")
    g.add_argument("--cpu-check", action="store_true", help="the same path, small, on CPU")
    a = sub.add_parser("all", help="every benchmark, one table: bench-all.md, bench-all.json")
    a.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    a.add_argument("--skip", nargs="*", default=[], choices=ALL_ORDER)
    args = p.parse_args()
    report = run_all(p, args) if args.bench == "all" else BENCHES[args.bench](args)
    out = Path(f"bench-{args.bench}.json")
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out.resolve()}")
    if args.bench == "all" and report["errors"]:
        sys.exit(f"bench all: {', '.join(report['errors'])} failed (see above)")


if __name__ == "__main__":
    main()
