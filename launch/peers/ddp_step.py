"""The peer for ``bench.py overhead``: plain PyTorch DDP under torchrun, data in memory.

    torchrun --standalone --nproc-per-node 2 launch/peers/ddp_step.py --data DIR ...

Same model (built from the same config class, same seed), same per-rank batch, same
optimizer as the elastic run; no Ray, no DeepSpeed, no streaming. Rank 0 prints one JSON
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
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic.data.formats import column_to_numpy
from elastic.data.shards import list_shards
from elastic.models.mlp import MLPConfig
from elastic_bench.common import StepClock


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--input-dim", type=int, required=True)
    p.add_argument("--hidden-dims", type=str, required=True, help="comma separated")
    p.add_argument("--output-dim", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    table = pq.read_table(list_shards(a.data), columns=["x", "y"])
    x = torch.from_numpy(column_to_numpy(table["x"])[rank::world].copy())
    y = torch.from_numpy(column_to_numpy(table["y"])[rank::world].copy())
    per_rank = a.global_batch // world

    torch.manual_seed(0)
    hidden = [int(h) for h in a.hidden_dims.split(",")]
    model = DDP(
        MLPConfig(input_dim=a.input_dim, hidden_dims=hidden, output_dim=a.output_dim).build()
    )
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    batches = len(x) // per_rank
    started = 0.0
    clock = StepClock(a.warmup)  # 10-step intervals, as the elastic run's are read
    for step in range(a.steps):
        if step == a.warmup:
            dist.barrier()
            started = time.time()
        clock.before(step)
        i = step % batches
        xb, yb = x[i * per_rank : (i + 1) * per_rank], y[i * per_rank : (i + 1) * per_rank]
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
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
