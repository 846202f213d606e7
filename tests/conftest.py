"""Shared fixtures: one small synthetic dataset and one real local Ray per session."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(1, os.path.dirname(__file__))  # tests/wandb_records.py; never first

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


def own_processes(title: str, root: int | None = None) -> list[int]:
    """Pids of the processes under ``root`` (default: this test process, whose session
    Ray cluster is its child) whose title starts with ``title``. Not the machine's:
    other Ray clusters may run beside the suite (another user's, another suite's)."""
    import psutil

    found = []
    for p in psutil.Process(root).children(recursive=True):
        try:
            if (p.cmdline() or [""])[0].startswith(title):
                found.append(p.pid)
        except psutil.Error:
            continue
    return found


@pytest.fixture(scope="session")
def small_data(tmp_path_factory):
    """1,000 training rows (not a multiple of the batch: the last step is partial)."""
    from elastic.datasets.synthetic import generate

    root = tmp_path_factory.mktemp("data")
    generate(str(root / "train"), str(root / "val"), 1000, 256, 5, 32, 4, seed=0)
    return root


@pytest.fixture(scope="session")
def ray_session():
    """A real embedded Ray cluster shared by the end-to-end tests (start-up is seconds)."""
    import ray

    from elastic.cluster.bootstrap import WORKER_POOL, quiet_log_monitor
    from elastic.cluster.connect import USAGE_STATS, WORKER_ENV
    from elastic.cluster.ray_internals import fast_worker_start

    fast_worker_start()  # as elastic's own Ray clusters: fast worker starts, a log
    quiet_log_monitor()  # monitor that lists its folder twice a second, not ten times
    os.environ.setdefault(USAGE_STATS, "0")
    ray.init(
        address="local",
        num_cpus=4,
        object_store_memory=512 * 1024 * 1024,
        include_dashboard=False,
        runtime_env={"env_vars": dict(WORKER_ENV)},
        _system_config=WORKER_POOL,  # as elastic's own Ray clusters
    )
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture
def cpus_held(ray_session):
    """An actor that holds all but one of the session cluster's 4 CPUs: a worker group
    of 2 cannot be placed (Ray Train retries its start, for ever)."""
    import ray

    @ray.remote(num_cpus=3)
    class Holder:
        def ready(self) -> bool:
            return True

    holder = Holder.remote()
    ray.get(holder.ready.remote())
    yield
    ray.kill(holder)


# Ray Train's controller takes a worker's reported checkpoint only when it polls the
# workers (scaling.health_check_interval_s, 1 s) and a worker's next report waits for
# that: a test checkpointing every few millisecond-steps would spend most of its time
# there. A faster poll changes no outcome, only the wait.
FAST_POLL = "scaling.health_check_interval_s=0.25"


def small_overrides(data_root, storage, *extra: str) -> list[str]:
    return [
        FAST_POLL,
        "+experiment=smoke",
        f"run.storage_path={storage}",
        f"data.path={data_root}/train",
        f"data.val_path={data_root}/val",
        "model.input_dim=32",
        "model.output_dim=4",
        "data.global_batch_size=64",
        "model.hidden_dims=[64,64]",
        "trainer.log_every_steps=1",
        *extra,
    ]


def cluster_data(root, rows: int, seed: int):
    """The multi-node tests' dataset: ``rows`` training rows of 64 features, 4 classes,
    in shards of 256 rows and row groups of 64."""
    from elastic.datasets.synthetic import generate

    generate(str(root / "train"), str(root / "val"), rows, 256, 8, 64, 4, seed=seed)
    return root


def cluster_overrides(data, hidden: int, batch: int, epochs: int, *extra: str) -> list[str]:
    """The multi-node tests' run: a checkpoint every 5 steps, a log line every step.
    Ray Train's default 1 s poll of the workers paces it (a checkpoint waits for the
    poll): the Slurm tests' failures and joins land while it trains. With
    :data:`FAST_POLL` (the elastic tests pass it) its 2 epochs take ~4 s, and a join
    (~10 s) came after the end (2026-12-06)."""
    return [
        "+experiment=smoke",
        f"data.path={data}/train",
        f"data.val_path={data}/val",
        "model.input_dim=64",
        "model.output_dim=4",
        f"model.hidden_dims=[{hidden},{hidden}]",
        f"data.global_batch_size={batch}",
        "trainer.max_steps=0",
        f"trainer.max_epochs={epochs}",
        "trainer.log_every_steps=1",
        "checkpoint.every_steps=5",
        "logger=none",
        "scaling.resize_interval_s=2",
        *extra,
    ]


def train(overrides: list[str]) -> dict:
    """Compose, validate and train in-process, as ``launch/run.py`` does (with the
    controller's fast poll, :data:`FAST_POLL`, unless the overrides set the poll)."""
    from elastic.config.compose import compose, plain, typed_config
    from elastic.train.driver import train as driver_train

    if not any(o.startswith("scaling.health_check_interval_s=") for o in overrides):
        overrides = [FAST_POLL, *overrides]
    cfg, experiment = compose(overrides)
    typed = typed_config(cfg, experiment)
    return driver_train(typed, plain(cfg))


def assert_every_epoch_once(summary: dict, train_dir, epochs: int, rows: int) -> None:
    """Every sample of every epoch trained exactly once, and the run's last checkpoint's
    bitmap of the last closed epoch holds exactly the ids of the dataset in train_dir."""
    import numpy as np
    import pyarrow.parquet as pq

    from elastic.train.checkpoint import read_state

    assert summary["samples_exactly_once"] is True
    assert summary["epochs_closed"] == [
        {"epoch": e, "trained": rows, "duplicates": 0} for e in range(epochs)
    ]
    state = read_state(summary["checkpoint"])
    trained = state.ledger.trained_ids(state.ledger.last_closed_bitmap)
    ids = pq.read_table(train_dir, columns=["sample_id"])["sample_id"].to_numpy()
    np.testing.assert_array_equal(trained, np.sort(ids))


def planned_digests(train_dir, data_settings: dict, steps: int) -> dict[int, int]:
    """What every step's ``train/batch_digest`` must be, computed apart from any run: each
    epoch's plan applied to the shards' sample ids, read with pyarrow (``data_settings``:
    the run's DataConfig values that fix the row order, e.g. global_batch_size, lanes)."""
    import numpy as np
    import pyarrow.parquet as pq

    from elastic.config.schema import DataConfig
    from elastic.data.ids import ids_digest
    from elastic.data.order import Layout
    from elastic.data.reader import epoch_plan
    from elastic.data.shards import check_dataset

    cfg = DataConfig(path=str(train_dir), **data_settings)
    split = check_dataset(cfg)["train"]
    layout = Layout(split.row_groups)
    ids = [
        [pq.ParquetFile(f).read_row_group(g)["sample_id"].to_numpy() for g in range(len(groups))]
        for f, groups in zip(split.files, split.row_groups, strict=True)
    ]
    out: dict[int, int] = {}
    step = epoch = 0
    while step < steps:
        plan = epoch_plan(cfg, layout, epoch)
        for s in range(min(plan.steps, steps - step)):
            step += 1
            out[step] = ids_digest(np.array([ids[f][g][r] for f, g, r in plan.batch(s)]))
        epoch += 1
    return out


@pytest.fixture
def tmpfs(tmp_path):
    """``mount(name, size_kb, read_only=False)``: a real small filesystem of its own at
    ``tmp_path/name`` (a full disk, a read-only run folder), unmounted at the end. Needs
    root (CI runs as root); skipped without."""
    import subprocess

    mounted = []

    def mount(name: str, size_kb: int, read_only: bool = False):
        path = tmp_path / name
        path.mkdir(parents=True, exist_ok=True)
        options = f"size={size_kb}k" + (",ro" if read_only else "")
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode()}")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path) -> None:
    """Fill the filesystem ``path`` is on to the last byte."""
    with open(os.path.join(path, ".filler"), "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


@pytest.fixture
def cluster():
    """``cluster(n)``: a real multi-raylet Ray cluster (a head and ``n`` one-worker
    nodes), shut down after the test."""
    from elastic_harness.localcluster import RayCluster

    clusters: list[RayCluster] = []

    def make(worker_nodes: int) -> RayCluster:
        clusters.append(RayCluster(worker_nodes))
        return clusters[-1]

    yield make
    for c in clusters:
        c.shutdown()
