"""A peer for ``bench.py overhead``: DeepSpeed under torchrun, data in memory.

    torchrun --standalone --nproc-per-node 2 launch/peers/ds_step.py --steps 600 -- OVERRIDES

The engine is the one elastic builds (:func:`elastic.train.engine.build_engine`: the
same config, ZeRO stage and buckets, from the same composed experiment and overrides),
with DeepSpeed's own gradient all-reduce whatever ``strategy.overlap_reduce`` says (a
user running DeepSpeed under torchrun gets that one; elastic's overlapped one at fp32
ZeRO-0, :mod:`elastic.train.reduce`, is counted on elastic's side), the model the same
(same seed), the per-rank batch the same; no Ray, no streaming, no elastic loop.
Against the elastic run it measures what elastic adds above DeepSpeed; against the
plain-DDP peer (``ddp_step.py``), what DeepSpeed adds above DDP. Rank 0 prints one JSON
line with the steady-state step time.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from elastic.config.compose import compose, typed_config
from elastic.data.formats import column_to_numpy
from elastic.data.shards import list_shards
from elastic.train.batch import BatchPlan
from elastic.train.engine import build_engine, init_distributed
from elastic_bench.common import StepClock


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("overrides", nargs="*", help="config overrides, as for launch/run.py")
    a = p.parse_args()

    cfg = typed_config(*compose(a.overrides))
    dist.init_process_group("gloo")
    init_distributed(use_gpu=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    table = pq.read_table(list_shards(cfg.data.path), columns=["x", "y"])
    x = torch.from_numpy(column_to_numpy(table["x"])[rank::world].copy())
    y = torch.from_numpy(column_to_numpy(table["y"])[rank::world].copy())
    plan = BatchPlan.for_world(cfg.data.global_batch_size, world, cfg.data.micro_batch_size)
    per_rank = cfg.data.global_batch_size // world

    torch.manual_seed(cfg.trainer.seed)
    engine = build_engine(cfg, plan, cfg.model.build())
    dtype = torch.bfloat16 if cfg.strategy.precision == "bf16" else torch.float32
    batches = len(x) // per_rank
    started = 0.0
    clock = StepClock(a.warmup)  # 10-step intervals, as the elastic run's are read
    for step in range(a.steps):
        if step == a.warmup:
            dist.barrier()
            started = time.time()
        clock.before(step)
        i = step % batches
        xb = x[i * per_rank : (i + 1) * per_rank].to(dtype)
        yb = y[i * per_rank : (i + 1) * per_rank]
        loss = torch.nn.functional.mse_loss(engine(xb).float(), yb)
        engine.backward(loss)  # DeepSpeed's all-reduce, after the backward pass
        engine.step()
    clock.before(a.steps)
    dist.barrier()
    window = [started, time.time()]  # the timed steps, for a CPU count from outside
    if rank == 0:
        print(
            json.dumps(
                {
                    "step_s": clock.median_step_s(),  # what bench overhead compares
                    "mean_step_s": clock.mean_step_s(),  # every timed step, hiccups in
                    "window": window,
                    "steps": a.steps - a.warmup,
                    "world_size": world,
                    "zero_stage": cfg.strategy.zero_stage,
                    "threads": torch.get_num_threads(),
                    "omp": os.environ.get("OMP_NUM_THREADS"),
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
