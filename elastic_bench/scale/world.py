"""The world-size series of ``bench.py scale``: one real elastic run a world size on a
local multi-raylet Ray cluster (raylets as nodes, ``per_node`` training workers a node),
through ``launch/run.py``, timed from its own records:

- ``start``: session start -> the first step (Ray Train's worker group, the workers'
  imports, DeepSpeed, the data's first batch);
- ``step``: a steady step (the median log interval after the first two), and what each
  rank spends on it beyond the same model's forward, backward and optimizer step alone
  (``framework``: DeepSpeed, gloo, elastic's loop);
- ``epoch_start``: the extra data wait of a log interval holding an epoch's start;
- ``worker_kill``: a training worker SIGKILLed -> the first step of the restarted group;
- ``node_kill``: a worker node killed -> the first step at the smaller size (a ZeRO-2
  checkpoint resharded to it) and ``node_join``: a node added -> the first step at the
  larger size (both from two nodes up).

Each is timed twice: wall seconds here, and the CPU seconds of the head side and of the
worker side over the same window (:class:`~elastic_harness.localcluster.CpuClock`). With
2 cores for up to 32 workers, wall times here stretch with the worker count; the CPU
seconds are what each side would spend on machines of its own.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

CPUS_PER_WORKER = 3  # logical: more than the head's 2, so no training worker lands there
GLOBAL_BATCH = 96  # the same global batch at every world size (up to 96 workers)
LOG_EVERY = 8
CHECKPOINT_EVERY = 64
STEADY_S = 20.0  # seconds of steady steps measured after the first two log intervals


def overrides(world: int, per_node: int, data: list[str]) -> list[str]:
    smaller = world - per_node if world > per_node else world
    return [
        "+experiment=smoke",
        "model.input_dim=64",
        "model.output_dim=4",
        "model.hidden_dims=[64,64]",
        f"data.global_batch_size={GLOBAL_BATCH}",
        "trainer.max_steps=0",
        "trainer.max_epochs=100000",
        f"trainer.log_every_steps={LOG_EVERY}",
        f"checkpoint.every_steps={CHECKPOINT_EVERY}",
        "logger=none",
        "trainer.progress=off",
        f"scaling.min_workers={smaller}",
        f"scaling.max_workers={world}",
        f"scaling.cpus_per_worker={CPUS_PER_WORKER}",
        *data,
    ]


def compute_alone_s(world: int) -> float:
    """CPU seconds of one rank's forward, backward and AdamW step on its slice of the
    global batch (``GLOBAL_BATCH / world`` rows), in this process, one thread, nothing
    distributed: what a step costs without any framework."""
    import torch

    from elastic_bench.common import smoke_config

    cfg = smoke_config(overrides(world, 1, [])[1:5])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = cfg.model.build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        rows = max(1, GLOBAL_BATCH // world)
        x, y = torch.randn(rows, 64), torch.randn(rows, 4)
        for _ in range(20):  # warm
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        n, t0 = 300, time.process_time()
        for _ in range(n):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return (time.process_time() - t0) / n
    finally:
        torch.set_num_threads(threads)


START_TIMEOUT = "WorkerGroupStartupTimeoutError"  # Ray Train gave up placing a group


def _window(clock: Any, t0: float, t1: float, workers: int, log: str = "") -> dict[str, float]:
    """Wall and CPU seconds from ``t0`` to ``t1`` (one worker's: the worker side's over
    ``workers``); ``log``: the driver's output meanwhile, for the group starts Ray Train
    gave up on (``scaling.start_timeout_s``) and retried."""
    head, worker = clock.between(t0, t1)
    return {
        "wall_s": t1 - t0,
        "head_cpu_s": head,
        "worker_cpu_s": worker / workers,
        "head_cpu_by_process": dict(list(clock.head_by_kind(t0, t1).items())[:6]),
        "start_timeouts": log.count(START_TIMEOUT),
    }


def _steps(records: list[dict]) -> list[dict]:
    return [r for r in records if "train/loss" in r]


def _steady(records: list[dict], clock: Any, world: int) -> dict[str, float]:
    """The first group's steady steps: from its third log record to its last."""
    steps = _steps(records)[2:]
    a, b = steps[0], steps[-1]
    n = b["step"] - a["step"]
    intervals = [
        (y["time"] - x["time"]) / (y["step"] - x["step"])
        for x, y in zip(steps, steps[1:], strict=False)
    ]
    head, worker = clock.between(a["time"], b["time"])
    span = b["time"] - a["time"]
    by_process = list(clock.head_by_kind(a["time"], b["time"]).items())[:6]
    return {
        "step_s": statistics.median(intervals),
        "steps": n,
        "worker_cpu_per_step_s": worker / world / n,
        "head_cpu_per_s": head / span,
        "head_cpu_per_s_by_process": {k: v / span for k, v in by_process},
    }


def epoch_start_s(records: list[dict], world: int) -> float | None:
    """The extra data wait of the slowest rank in a log interval that holds an epoch's
    first step, over the median interval's (median over such intervals); None when the
    records hold no epoch start past the first two intervals."""
    steps = _steps(records)[2:]
    starts = {e["step"] + 1 for e in records if e.get("event") == "epoch_end"}
    holds: list[float] = []
    plain: list[float] = []
    for x, y in zip(steps, steps[1:], strict=False):
        n = y["step"] - x["step"]
        wait = max(y.get(f"worker_data_wait_s/rank{r}", 0.0) for r in range(world)) * n
        (holds if any(x["step"] < s <= y["step"] for s in starts) else plain).append(wait)
    if not holds or not plain:
        return None
    return statistics.median(holds) - statistics.median(plain)


def _startup(run: Any, after: float) -> dict[str, float]:
    """The ``startup`` record (rank 0's seconds of its start) of the first group
    started after ``after`` (written just after the group's first step: waited for)."""

    def found() -> list[dict]:
        return [r for r in run.records() if r.get("event") == "startup" and r["time"] > after]

    record = run.wait_for("the group's startup record", found, timeout=120)[0]
    return {k: v for k, v in record.items() if k.endswith("_s")}


def measure_world(world: int, per_node: int, workdir: str, kills: bool = True) -> dict[str, Any]:
    """One run at ``world`` workers (``per_node`` a node); every figure of it."""
    from elastic_bench.common import elastic_data
    from elastic_harness.localcluster import CpuClock, RayCluster, Run

    os.environ["OMP_NUM_THREADS"] = "1"  # one thread a worker: 2 cores hold them all
    data = elastic_data(workdir)
    nodes = max(1, world // per_node)
    cluster = RayCluster(nodes, node_cpus=per_node * CPUS_PER_WORKER)
    clock = CpuClock(cluster)
    run = Run(Path(workdir), f"scale-{world}-{time.time_ns()}", overrides(world, per_node, data),
              cluster.address)  # fmt: skip
    out: dict[str, Any] = {"world": world, "nodes": nodes, "per_node": per_node}
    try:
        first = run.wait_for("the first step", lambda: _steps(run.records())[:1], timeout=900)[0]
        begun = next(r["time"] for r in run.records() if r.get("event") == "session_start")
        out["start"] = {**_window(clock, begun, first["time"], world, run.output()),
                        "startup": _startup(run, 0.0)}  # fmt: skip
        steady_from = time.time()
        run.wait_for(
            "steady steps",
            lambda: time.time() - steady_from > STEADY_S and len(_steps(run.records())) > 6,
            timeout=900,
        )
        records = run.records()
        out["step"] = _steady(records, clock, world)
        out["epoch_start_s"] = epoch_start_s(records, world)
        out["memory_used_gb"] = _memory_gb()
        if kills:
            run.wait_checkpoint(timeout=600)
            t, logged = time.time(), len(run.output())
            os.kill(cluster.train_worker_pids()[0], signal.SIGKILL)
            done = run.wait_step(t, restarted=True, timeout=900)
            out["worker_kill"] = {**_window(clock, t, done, world, run.output()[logged:]),
                                  "startup": _startup(run, t)}  # fmt: skip
        if kills and nodes > 1:
            for key, action, size in (
                ("node_kill", lambda: cluster.remove_node(cluster.nodes[0]), world - per_node),
                ("node_join", cluster.add_node, world),
            ):
                run.wait_checkpoint(timeout=600)
                t, logged = time.time(), len(run.output())
                action()
                done = run.wait_step(t, world=size, timeout=900)
                out[key] = {**_window(clock, t, done, size, run.output()[logged:]),
                            "startup": _startup(run, t)}  # fmt: skip
        run.signal(signal.SIGTERM)  # checkpoint and stop: everything is measured
        run.finish(timeout=600)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
        clock.stop()
        cluster.shutdown()
    return out


def _memory_gb() -> float:
    import psutil

    return psutil.virtual_memory().used / 2**30
