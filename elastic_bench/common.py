"""What the benchmarks share: a training run through ``launch/run.py``, a peer script
under ``torchrun``, and the small model and data the cluster benchmarks (recovery,
chaos) train."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from elastic.observe.metrics import read_records
from elastic_harness.localcluster import REPO


class StepClock:
    """A peer's step time read as an elastic run's is (:func:`train` logs every 10
    steps; ``bench overhead`` takes the median over those intervals): rank 0's clock at
    every ``every``-th step from ``start`` on. :meth:`median_step_s`, the median
    seconds a step over those intervals; :meth:`mean_step_s`, the mean over all of
    them."""

    def __init__(self, start: int, every: int = 10) -> None:
        self.start, self.every = start, every
        self.marks: list[tuple[int, float]] = []

    def before(self, step: int) -> None:
        """Call before step ``step`` (0-based) begins, and with the step count after
        the last one."""
        if step >= self.start and (step - self.start) % self.every == 0:
            self.marks.append((step, time.perf_counter()))

    def _per_step(self) -> list[float]:
        pairs = zip(self.marks[:-1], self.marks[1:], strict=False)
        return [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in pairs]

    def median_step_s(self) -> float:
        per_step = self._per_step()
        if not per_step:
            raise SystemExit(f"bench peer: fewer than {self.every} timed steps; give more")
        return statistics.median(per_step)

    def mean_step_s(self) -> float:
        (s0, t0), (s1, t1) = self.marks[0], self.marks[-1]
        return (t1 - t0) / (s1 - s0)


def smoke_config(extra: list[str]):
    from elastic.config.compose import compose, typed_config

    cfg, name = compose(["+experiment=smoke", *extra])
    return typed_config(cfg, name)


def train(
    overrides: list[str],
    steps: int,
    workdir: str,
    label: str,
    log_every: int = 10,
    checkout: Path | None = None,
) -> tuple[list, dict]:
    """Train ``steps`` steps through launch/run.py (log every ``log_every``, no
    checkpoints, no W&B) under ``workdir``; the run's metrics.jsonl records and its
    summary.json. ``checkout``: another source checkout of elastic whose launch/run.py and
    package run (the code before a change, beside it), on the driver and the workers."""
    name = f"{label}-{time.time_ns()}"
    out = Path(workdir) / name
    env = None
    if checkout is not None:  # its package first on the path, for Ray's workers too
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(checkout), *filter(None, [os.environ.get("PYTHONPATH")])]
        )}  # fmt: skip
    cmd = [
        sys.executable, str((checkout or REPO) / "launch/run.py"), *overrides,
        f"trainer.max_steps={steps}",
        f"trainer.log_every_steps={log_every}", "checkpoint.every_steps=0", "logger=none",
        "trainer.progress=off", f"run.storage_path={workdir}", f"run.name={name}",
        f"hydra.run.dir={out}/hydra",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return read_records(str(out)), json.loads((out / "hydra" / "summary.json").read_text())


def torchrun_json(
    world: int, script: str, args: list[str], env: dict[str, str] | None = None
) -> dict:
    """Run a peer script (``launch/peers/NAME.py``) or a module (``package.module``)
    under torchrun with ``world`` ranks on this machine (one thread each, as Ray gives a
    1-CPU worker; ``env`` added to this process's environment); the JSON line its rank 0
    prints last."""
    target = [str(REPO / "launch/peers" / script)] if script.endswith(".py") else ["-m", script]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={world}", *target, *args,
    ]  # fmt: skip
    full = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=full).stdout
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


# -- the cluster benchmarks (recovery, chaos): a small model on a multi-raylet cluster --

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


def elastic_data(workdir: str, seed: int = 1) -> list[str]:
    from elastic.datasets.synthetic import generate

    root = os.path.join(workdir, "data")
    if not os.path.isdir(root):
        generate(f"{root}/train", f"{root}/val", 2048, 256, 8, 64, 4, seed=seed)
    return [f"data.path={root}/train", f"data.val_path={root}/val"]
