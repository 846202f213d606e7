"""Every experiment composes; every bad input fails before Ray with one line and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import fill

from elastic.config.compose import CONF_DIR, compose, preflight, quote_target, typed_config
from elastic.config.schema import TrainConfig
from elastic.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_validates(experiment, tmp_path):
    data = []
    if experiment.startswith("images"):
        # a dataset that must be prepared first: a tiny one, converted for real
        pytest.importorskip("PIL", reason="the images extra is not installed")
        from PIL import Image

        from elastic.datasets.images import convert

        for label in ("a", "b"):
            (tmp_path / "src" / label).mkdir(parents=True)
            Image.new("L", (8, 8), 40 if label == "a" else 200).save(
                tmp_path / "src" / label / "0.png"
            )
        convert(tmp_path / "src", tmp_path / "img", val_fraction=0)
        data = [f"data.path={tmp_path}/img/train", "data.val_path=null"]
    if experiment.startswith("protein"):
        from elastic.datasets.protein import synthetic

        synthetic(tmp_path / "protein", frames=8, shards=1)
        data = [f"data.path={tmp_path}/protein", "data.val_path=null"]
    if experiment.startswith("cbed"):
        from elastic.datasets.cbed import Settings, synthetic

        synthetic(tmp_path / "cbed", 8, Settings(), val_fraction=0.0, shards=1)
        data = [f"data.path={tmp_path}/cbed/train", "data.val_path=null"]
    cfg, name = compose([f"+experiment={experiment}", f"run.storage_path={tmp_path}", *data])
    typed = typed_config(cfg, name)
    assert isinstance(typed, TrainConfig)
    assert typed.run.experiment == experiment
    assert os.path.isabs(typed.data.path) and os.path.isabs(typed.run.storage_path)
    # the batch plan holds at every world size the experiment allows
    from elastic.train.batch import BatchPlan

    for w in range(typed.scaling.min_workers, typed.scaling.max_workers + 1):
        plan = BatchPlan.for_world(typed.data.global_batch_size, w, typed.data.micro_batch_size)
        assert plan.micro_batch_size * plan.grad_accum_steps * w == typed.data.global_batch_size


def test_a_missing_image_dataset_says_how_to_prepare_it(tmp_path):
    cfg, name = compose(["+experiment=images_resnet", f"data.path={tmp_path}/nothing"])
    with pytest.raises(ConfigError, match="python datasets/images/prepare.py SRC OUT"):
        typed_config(cfg, name)


def test_public_keys_reach_the_typed_config(tmp_path):
    cfg, name = compose(
        [
            "+experiment=smoke",
            "strategy.zero_stage=3",
            "strategy.precision=bf16",
            "scaling.min_workers=1",
            "scaling.max_workers=3",
            "data.global_batch_size=96",
            "trainer.max_steps=7",
            "trainer.max_epochs=2",
            "optim.lr=0.01",
            "checkpoint.every_steps=3",
            "checkpoint.keep=4",
            "run.name=abc",
            f"run.storage_path={tmp_path}",
            "logger=none",
            "cluster.address=10.0.0.1:6379",
        ]
    )
    t = typed_config(cfg, name)
    assert (t.strategy.zero_stage, t.strategy.precision) == (3, "bf16")
    assert (t.scaling.min_workers, t.scaling.max_workers) == (1, 3)
    assert (t.data.global_batch_size, t.trainer.max_steps, t.trainer.max_epochs) == (96, 7, 2)
    assert (t.optim.lr, t.checkpoint.every_steps, t.checkpoint.keep) == (0.01, 3, 4)
    assert (t.run.name, t.logger.kind, t.cluster.address) == ("abc", "none", "10.0.0.1:6379")
    # a fixed world size for a sweep; a target in the shell's spelling (quote_target)
    cfg, name = compose(
        quote_target(
            [
                "+experiment=smoke",
                "scaling.workers=3",
                "data.global_batch_size=96",
                "trainer.val_every_steps=5",
                "metrics.target=val/r2>=0.5",
            ]
        )
    )
    t = typed_config(cfg, name)
    assert (t.scaling.min_workers, t.scaling.max_workers) == (3, 3)
    assert t.metrics.target == "val/r2>=0.5"


def _shards(tmp_path: Path, table: pa.Table, name: str = "part-0.parquet") -> Path:
    d = tmp_path / "shards"
    d.mkdir(exist_ok=True)
    pq.write_table(table, d / name)
    return d


def _bad_inputs(tmp_path: Path) -> list[tuple[list[str], str]]:
    empty = tmp_path / "empty"
    empty.mkdir()
    x = pa.FixedSizeListArray.from_arrays(pa.array([0.0] * 128, pa.float32()), 128)
    no_target = _shards(tmp_path, pa.table({"sample_id": [0], "x": x}))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "part-0.parquet").write_bytes(b"PAR1 this is not parquet")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    y = pa.FixedSizeListArray.from_arrays(pa.array([0.0] * 16, pa.float32()), 16)
    pq.write_table(pa.table({"sample_id": [0], "x": x, "y": y}), mixed / "part-0.parquet")
    x64 = pa.FixedSizeListArray.from_arrays(pa.array([0.0] * 128, pa.float64()), 128)
    pq.write_table(pa.table({"sample_id": [1], "x": x64, "y": y}), mixed / "part-1.parquet")
    real = ["data.synthetic=null"]
    labels, wide = tmp_path / "labels", tmp_path / "wide"
    labels.mkdir()
    wide.mkdir()
    pq.write_table(
        pa.table({"sample_id": [0, 1], "x": pa.concat_arrays([x, x]), "y": [0, 9]}),
        labels / "part-0.parquet",
    )
    pq.write_table(pa.table({"sample_id": [0], "x": x, "y": y}), wide / "part-0.parquet")
    flat = ["model.input_dim=128", "data.val_path=null"]
    # a FIFO named like a shard blocked the start-up check (and every signal) forever
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    pq.write_table(pa.table({"sample_id": [0], "x": x, "y": y}), fifo / "part-0.parquet")
    os.mkfifo(fifo / "part-1.parquet")
    # a split of no rows: ZeroDivisionError in every worker, retried 10 times
    no_rows = tmp_path / "no_rows"
    no_rows.mkdir()
    pq.write_table(pa.table({"sample_id": [0], "x": x, "y": y}).slice(0, 0), no_rows / "p.parquet")
    # ids that repeat (across shards, unordered: the statistics cannot prove them unique)
    # or are negative: trained twice an epoch, or indexing the ledger from its end
    twice = tmp_path / "twice"
    twice.mkdir()
    xs = pa.concat_arrays([x, x])
    pq.write_table(pa.table({"sample_id": [3, 1], "x": xs, "y": [y[0], y[0]]}), twice / "a.parquet")
    pq.write_table(pa.table({"sample_id": [2, 3], "x": xs, "y": [y[0], y[0]]}), twice / "b.parquet")
    negative = tmp_path / "negative"
    negative.mkdir()
    pq.write_table(pa.table({"sample_id": [-1], "x": x, "y": y}), negative / "a.parquet")
    wide_rows = [*real, "model.input_dim=128", "model.output_dim=16", "data.val_path=null"]
    # ids that are no integers, or missing in a row: a traceback from the statistics
    texts, holes = tmp_path / "texts", tmp_path / "holes"
    texts.mkdir()
    holes.mkdir()
    pq.write_table(pa.table({"sample_id": ["a"], "x": x, "y": y}), texts / "a.parquet")
    two = pa.table({"sample_id": pa.array([0, None], pa.int64()), "x": xs, "y": [y[0], y[0]]})
    pq.write_table(two, holes / "a.parquet")
    # labels out of range in shards written without statistics: found only by the loss in
    # every worker, retried (176 s; in the validation split 275 s, no final checkpoint)
    unstated = tmp_path / "unstated"
    unstated.mkdir()
    labelled = pa.table({"sample_id": [0, 1], "x": pa.concat_arrays([x, x]), "y": [0, 9]})
    pq.write_table(labelled, unstated / "part-0.parquet", write_statistics=False)
    fine = tmp_path / "fine"
    fine.mkdir()
    pq.write_table(labelled.set_column(2, "y", pa.array([0, 1])), fine / "part-0.parquet")
    classes = [*real, "model.input_dim=128", "model.task=classification", "model.output_dim=5"]
    return [
        (["strategy.zero_stgae=2"], "strategy.zero_stgae"),
        (["strategy.zero_stage=abc"], "strategy.zero_stage"),
        (["strategy.zero_stage=4"], "strategy.zero_stage=4"),
        (["scaling.min_workers=3", "scaling.max_workers=2"], "scaling.min_workers=3"),
        (["scaling.min_workers=0"], "scaling.min_workers=0"),
        (["data.global_batch_size=1"], "scaling.max_workers=2 > data.global_batch_size=1"),
        (["data.lanes=129"], "data.lanes=129 is not valid: use 1..data.global_batch_size"),
        (["data.shuffle_window_rows=0"], "data.shuffle_window_rows=0 is not valid"),
        ([*real, "data.path=/nonexistent/shards"], "data.path=/nonexistent/shards"),
        ([*real, f"data.path={empty}"], "no .parquet files"),
        ([*real, f"data.path={no_target}", "data.val_path=null"], "no column 'y'"),
        ([*real, f"data.path={corrupt}", "data.val_path=null"], "not a readable Parquet"),
        ([*real, f"data.path={mixed}", "data.val_path=null"], "part-1.parquet has column 'x'"),
        (["strategy.precision=fp8"], "strategy.precision"),
        # tasks: a name no module registers; one the model family cannot do; the family's
        # own keys named before the task's needs
        (["model.task=segmentation"], "model.task='segmentation' is not valid: use one of"),
        (["model.task=multitask"], "model.task=multitask needs a model family with model.cl"),
        (["model.task=classification", "model.output_dim=0"], "model.output_dim=0 is not val"),
        # keys of the data path before world-size-independent batches, named with their fate
        (["scaling.batch_policy=adjust"], "'scaling.batch_policy' is retired: it is gone"),
        (["+data.shuffle_buffer_rows=5"], "data.shuffle_buffer_rows is retired: it is data.shu"),
        (["scaling.max_failures=-2"], "scaling.max_failures=-2"),
        (["scaling.start_timeout_s=0"], "scaling.start_timeout_s=0"),
        (
            ["optim.schedule=cosine", "trainer.max_steps=0", "trainer.max_epochs=1"],
            "optim.schedule=cosine",
        ),
        (["scaling.workers=0"], "scaling.workers=0"),
        (["trainer.progress=fancy"], "trainer.progress"),
        (["metrics.target='val/r2=0.5'", "trainer.val_every_steps=5"], "METRIC>=NUMBER"),
        (["metrics.target='val/r2>=0.5'"], "set trainer.val_every_steps"),
        (["metrics.target='val/r2>=0.5'", "data.val_path=null"], "set data.val_path"),
        (["model=vit"], "Key 'input_dim' not in 'ViTConfig' (model.input_dim)"),
        # non-finite and out-of-range optimizer values (optim.lr=inf trained at loss nan)
        (["optim.lr=nan"], "optim.lr=nan is not valid: it must be a finite number"),
        (["optim.lr=inf"], "optim.lr=inf"),
        (["optim.betas=[2.0,3.0]"], "optim.betas=[2.0, 3.0] is not valid"),
        (["optim.eps=0"], "optim.eps=0.0"),
        (["optim.weight_decay=-1"], "optim.weight_decay=-1.0"),
        (["strategy.gradient_clipping=nan"], "strategy.gradient_clipping=nan"),
        # a typo added with '+' was dropped without a word
        (["+strategy.zero_stag=2"], "unknown config key strategy.zero_stag"),
        (["+model.hiden_dims=[8]"], "unknown config key model.hiden_dims"),
        # a run folder outside run.storage_path (stale-checkpoint clean-up runs there)
        (["run.name=.."], "run.name='..' is not valid"),
        (["cluster.num_cpus=0"], "cluster.num_cpus=0 cannot run"),
        (["cluster.address=headnode"], "cluster.address='headnode' is not valid: use HOST:PORT"),
        (["cluster.object_store_memory_mb=1"], "cluster.object_store_memory_mb=1"),
        (["run.storage_path=/proc/x"], "run.storage_path=/proc/x is not writable"),
        (["run.storage_path=/dev/null/x"], "run.storage_path=/dev/null/x is not writable"),
        # the target against the model's task and outputs (failed at the first step)
        (
            [
                *real,
                *flat,
                f"data.path={labels}",
                "model.task=classification",
                "model.output_dim=5",
            ],
            "holds class labels 0..9 but model.output_dim=5",
        ),
        ([*real, *flat, f"data.path={labels}"], "model.task=regression but column 'y'"),
        ([*real, *flat, f"data.path={wide}", "model.output_dim=4"], "holds 16 target value(s)"),
        ([*wide_rows, f"data.path={fifo}"], "part-1.parquet is not a regular file"),
        (
            [*classes, f"data.path={unstated}", "data.val_path=null"],
            "holds class labels 0..9 but model.output_dim=5",
        ),
        (
            [*classes, f"data.path={fine}", f"data.val_path={unstated}"],
            "holds class labels 0..9 but model.output_dim=5",
        ),
        ([*wide_rows, f"data.path={no_rows}"], f"data.path={no_rows} holds no rows"),
        ([*wide_rows, f"data.path={twice}"], "holds sample_id 3 more than once (1 repeated ids;"),
        ([*wide_rows, f"data.path={negative}"], "holds sample_id -1: ids must be >= 0"),
        ([*wide_rows, f"data.path={texts}"], "has column 'sample_id' of type string: it must"),
        ([*wide_rows, f"data.path={holes}"], "a.parquet has rows without a sample_id"),
        # a mistyped data path under a synthetic experiment would get data of its own
        ([f"data.path={tmp_path}/smok/train"], "synthetic data is generated only at"),
        # stragglers.*
        (["stragglers.threshold=1.0"], "stragglers.threshold=1.0 is not valid: it must be > 1"),
        (["stragglers.threshold=0.5"], "stragglers.threshold=0.5 is not valid"),
        (["stragglers.window=0"], "stragglers.window=0 is not valid: it must be >= 1"),
        (["stragglers.policy=fastest"], "stragglers.policy='fastest' is not valid: use one of"),
        (
            ["stragglers.policy=evict", "stragglers.max_evictions=0"],
            "stragglers.policy=evict with stragglers.max_evictions=0 evicts nothing",
        ),
        (["stragglers.max_evictions=-1"], "stragglers.max_evictions=-1 is not valid"),
        (["stragglers.cooldown_s=-1"], "stragglers.cooldown_s=-1.0 is not valid"),
        # scaling.live: what live recovery does not do yet
        (["scaling.live=true"], "scaling.live=true needs strategy.zero_stage=0 for now"),
        (
            ["scaling.live=true", "strategy.zero_stage=0", "strategy.precision=bf16"],
            "needs strategy.precision=fp32 for now (each worker a replica group of its own), "
            "not bf16: set strategy.precision=fp32 or scaling.live=false",
        ),
        (
            ["scaling.live=true", "strategy.zero_stage=0", "strategy.overlap_reduce=false"],
            "needs strategy.overlap_reduce=true",
        ),
        (
            ["scaling.live=true", "strategy.zero_stage=0", "stragglers.policy=rebalance"],
            "scaling.live=true with stragglers.policy=rebalance: not yet",
        ),
        (
            ["scaling.live=true", "strategy.zero_stage=0", "scaling.max_failures=0"],
            "scaling.live=true with scaling.max_failures=0",
        ),
        (
            ["scaling.live=true", "strategy.zero_stage=0", "scaling.use_gpu=true"],
            "scaling.live=true with scaling.use_gpu=true",
        ),
    ]


def test_each_bad_input_fails_with_one_line_naming_key(tmp_path, capsys, tmpfs):
    full = tmpfs("full", 256)  # a disk already full: the probe folder it made passed
    fill(full)
    read_only = tmpfs("runs_ro/r", 256, read_only=True)  # a run folder that takes nothing
    storage = [
        (["run.name=" + "x" * 300], "run.name='xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...' is"),
        (["run.name='a\nb'"], "run.name='a\\nb' is not valid: use a plain folder name"),
        ([f"run.storage_path={full}"], f"run.storage_path={full} is full ({full}: No space"),
        (
            [f"run.storage_path={read_only.parent}", "run.name=r"],
            f"the run's folder {read_only} is not writable ({read_only}: Read-only file system)",
        ),
    ]
    for extra, needle in [*_bad_inputs(tmp_path), *storage]:
        with pytest.raises(SystemExit) as exc:
            preflight(["+experiment=smoke", f"run.storage_path={tmp_path}/runs", *extra])
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 2, extra
        assert err.count("\n") == 0 and err.startswith("error: "), (extra, err)
        assert needle in err, (extra, err)
    assert not (tmp_path / "runs").exists() and os.listdir(full) == [".filler"]


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["model.input_size=0"], "set model.input_size"),
        (["model.patch_size=6"], "model.patch_size=6 does not divide model.input_size=64"),
        (["model.dim=30"], "model.dim=30"),
        (["model.depth=0"], "model.depth=0"),
    ],
)
def test_bad_vision_transformer_shapes_fail_with_one_line(extra, needle, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        preflight(["+experiment=cbed_vit", f"run.storage_path={tmp_path}/runs", *extra])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and err.count("\n") == 0 and needle in err, err


def _keys_with_choices() -> list[tuple[str, tuple[str, ...]]]:
    import dataclasses
    import typing

    from elastic.fields import choices_of

    sections = typing.get_type_hints(TrainConfig)
    return [
        (f"{section.name}.{f.name}", choices_of(f) or ())
        for section in dataclasses.fields(TrainConfig)
        if dataclasses.is_dataclass(sections[section.name])
        for f in dataclasses.fields(sections[section.name])
        if choices_of(f)
    ]


@pytest.mark.parametrize("key, choices", _keys_with_choices())
def test_a_key_with_choices_takes_each_and_refuses_another_naming_them(key, choices):
    """The choices on the schema's field (schema.one_of) are what validation takes and
    what its message names (docs/config.md is held to the same, tests/test_docs.py)."""
    from elastic.config.validate import to_typed

    cfg, _ = compose(["+experiment=smoke"])
    section, name = key.split(".")
    for value in choices:
        cfg[section][name] = value
        assert getattr(getattr(to_typed(cfg), section), name) == value
    cfg[section][name] = "bogus"
    with pytest.raises(ConfigError) as e:
        to_typed(cfg)
    assert str(e.value) == f"{key}='bogus' is not valid: use one of {', '.join(choices)}"


def test_unknown_experiment_lists_the_available_ones(capsys):
    with pytest.raises(SystemExit) as exc:
        preflight(["+experiment=smokey"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and "\n" not in err
    assert "smokey" in err and "smoke" in err.split("use one of:")[1]


def test_multirun_sweeps_are_each_checked(capsys):
    with pytest.raises(SystemExit):
        preflight(["-m", "+experiment=smoke", "strategy.zero_stage=1,5"])
    assert "strategy.zero_stage=5" in capsys.readouterr().err


def test_cli_exits_2_before_ray_starts(tmp_path):
    """The real entry point: exit code 2, one stderr line, no output dir, no Ray."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "launch/run.py"),
            "+experiment=smoke",
            "strategy.zero_stage=7",
            f"run.storage_path={tmp_path}/runs",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: strategy.zero_stage=7 is not valid: use 0, 1, 2 or 3 (DeepSpeed ZeRO)"
    ]
    assert "Ray" not in proc.stdout + proc.stderr
    assert not (tmp_path / "runs").exists()


def test_every_world_size_in_range_takes_the_global_batch_as_it_is(tmp_path):
    """No world size of 1..4 has to divide the global batch: slices differ by a row, and
    each is cut into micro batches no larger than data.micro_batch_size."""
    from elastic.train.batch import BatchPlan

    cfg, name = compose(
        [
            "+experiment=smoke",
            f"run.storage_path={tmp_path}",
            "scaling.min_workers=1",
            "scaling.max_workers=4",
            "data.micro_batch_size=20",
        ]
    )
    t = typed_config(cfg, name)
    assert t.data.lanes == 32  # data.lanes=0: 8 a worker at scaling.max_workers
    for world in range(1, 5):
        plan = BatchPlan.for_world(128, world, 20)
        largest = -(-128 // world)
        assert plan.micro_batch_size <= 20
        assert plan.micro_batch_size * plan.grad_accum_steps >= largest
        assert plan.micro_batch_size * (plan.grad_accum_steps - 1) < largest  # no idle micro


def test_recovery_knobs_become_ray_train_environment(tmp_path):
    cfg, name = compose(
        [
            "+experiment=smoke",
            f"run.storage_path={tmp_path}",
            "scaling.start_timeout_s=7",
            "scaling.health_check_interval_s=0.5",
        ]
    )
    env = typed_config(cfg, name).scaling.ray_env()
    assert env["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == "7.0"
    assert env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "0.5"


def test_a_run_carries_only_its_own_formats_settings(tmp_path, monkeypatch):
    """A process that has loaded a plugin format with settings (a notebook; this suite
    after test_extension) composes every later run's schema with them, but a run's
    typed config holds only its own format's settings: it unpickles where that plugin
    cannot be imported (a Ray worker of a run that does not use it)."""
    import pickle
    import subprocess
    import sys

    from elastic.config.compose import compose, typed_config
    from elastic.data.formats import FORMATS

    (tmp_path / "elsewhere_plugin.py").write_text(
        "from dataclasses import dataclass\n"
        "from elastic.data.formats import DataFormat, register_format\n"
        "@dataclass\nclass Knobs:\n    level: int = 3\n"
        "class Elsewhere(DataFormat):\n    name = 'elsewhere'\n    settings = Knobs\n"
        "register_format(Elsewhere())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import elsewhere_plugin  # noqa: F401  (registers the format, as a plugin would)

    try:
        cfg, name = compose(["+experiment=smoke", "data.elsewhere.level=4"])
        assert cfg.data.elsewhere.level == 4  # its keys exist in every run's schema
        typed = typed_config(cfg, name)
        assert not hasattr(typed.data, "elsewhere")
        blob = pickle.dumps(typed)
    finally:
        del FORMATS["elsewhere"]
    out = subprocess.run(
        [sys.executable, "-c", "import pickle, sys; c = pickle.loads(sys.stdin.buffer.read());"
         "print(type(c.data).__name__, c.data.format)"],
        input=blob, capture_output=True, cwd="/",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().split() == ["DataConfig", "array"]


def test_a_formats_settings_reach_the_run_as_set(tmp_path):
    """data.image.size=20 is what the image format decodes to in the run's typed config
    (not the default 32): the settings survive every step from Hydra to the workers."""
    import pickle

    from elastic.data.formats import data_format
    from elastic.datasets.images import convert, synthetic_folders

    synthetic_folders(tmp_path / "raw", 40, 2, 24, seed=0)
    convert(tmp_path / "raw", tmp_path / "img", val_fraction=0.25, shards=1)
    cfg, name = compose(
        [
            "+experiment=images_resnet",
            f"data.path={tmp_path}/img/train",
            f"data.val_path={tmp_path}/img/val",
            "data.image.size=20",
            "data.image.channels=3",
            "model.in_channels=3",
            "model.output_dim=2",
        ]
    )
    typed = pickle.loads(pickle.dumps(typed_config(cfg, name)))  # as a worker gets it
    settings = data_format("image").settings_of(typed.data)
    assert (settings.size, settings.channels, settings.augment_shift) == (20, 3, 1)


def test_a_head_that_does_not_answer_ends_the_run_in_one_line(tmp_path):
    """An unreachable cluster.address: Ray retried for more than 4 minutes, no word."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "launch/run.py"),
            "+experiment=smoke",
            f"run.storage_path={tmp_path}/runs",
            "cluster.address=127.0.0.1:9",  # nothing listens on the discard port
            "cluster.connect_timeout_s=2",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "error: cluster.address=127.0.0.1:9: nothing answers there (Connection refused) after "
        "2 s: check the head's address and that its Ray runs (a batch job's is in "
        "jobs/JOBID/), or raise cluster.connect_timeout_s"
    ]


def test_a_placement_the_nodes_cannot_give_fails_on_a_fixed_cluster_and_waits_on_another():
    """On the embedded cluster nothing will join: a strategy the nodes cannot give fails
    at once (STRICT_SPREAD on one node was retried 182 times in 16.5 minutes); on an
    explicit cluster nodes may be yet to join: a warning, and scaling.placement_timeout_s
    bounds the wait."""
    from elastic.cluster.placement import check_resources
    from elastic.config.schema import ScalingConfig

    nodes = [
        {"Alive": True, "Resources": {"CPU": 4.0}},
        {"Alive": False, "Resources": {"CPU": 8.0}},  # a dead node offers nothing
    ]
    sc = ScalingConfig(min_workers=2, max_workers=2, placement_strategy="STRICT_SPREAD")
    with pytest.raises(
        ConfigError, match=r"hold 1 of scaling.min_workers=2 \(1 node\(s\): 4 CPU\)"
    ):
        check_resources(sc, nodes)
    (warning,) = check_resources(sc, nodes, fixed=False)
    assert "the run waits for nodes to join, up to scaling.placement_timeout_s=600 s" in warning
    sc.placement_strategy, sc.cpus_per_worker = "STRICT_PACK", 3.0
    with pytest.raises(ConfigError, match="puts every worker on one node, but the cluster's"):
        check_resources(sc, nodes)
    sc.placement_strategy, sc.cpus_per_worker = "PACK", 2.0
    assert check_resources(sc, nodes) == []
