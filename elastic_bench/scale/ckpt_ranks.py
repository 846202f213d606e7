"""One point of ``bench.py scale``'s model-size series, on every rank under torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m elastic_bench.scale.ckpt_ranks --params P --dir DIR --mode save|load

elastic's own DeepSpeed engine (ZeRO-3, gloo, CPU, AdamW) of an MLP with about ``P``
parameters in :data:`LAYERS` equal hidden layers (a model's state spread over many
tensors of one size, as a transformer's blocks spread it; one matrix holding nearly
all of it would leave a conversion nothing to split), through elastic's own checkpoint
code (:mod:`elastic.train.checkpoint`):

- ``save``: one optimizer step, then the checkpoint written to DIR (every rank's part,
  as a run writes it) and read back at the same world size;
- ``load``: DIR (written at another world size) restored here: converted to a
  universal checkpoint, then loaded resharded, as a resized run does.

Rank 0 prints one JSON line: the seconds of each (the slowest rank's: every rank waits
for it), the checkpoint's bytes, and the parameters.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

INPUT, OUTPUT = 64, 4
LAYERS = 16


def hidden_for(params: float) -> int:
    """The width h of an MLP 64 -> h -> ... (:data:`LAYERS` layers) -> 4 with about
    ``params`` parameters ((LAYERS - 1) h^2 + (LAYERS + 68) h + 4)."""
    a, b = LAYERS - 1, LAYERS + INPUT + OUTPUT
    return max(1, round((-b + math.sqrt(b * b + 4 * a * params)) / (2 * a)))


def _config(hidden: int):
    from elastic.config.schema import DataConfig, StrategyConfig, TrainConfig
    from elastic.models.mlp import MLPConfig

    return TrainConfig(
        model=MLPConfig(input_dim=INPUT, hidden_dims=[hidden] * LAYERS, output_dim=OUTPUT),
        data=DataConfig(path="unused", global_batch_size=12),
        strategy=StrategyConfig(zero_stage=3),
    )


def _slowest(t0: float) -> float:
    """Seconds since ``t0`` on the slowest rank (after a barrier)."""
    dist.barrier()
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def _bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--params", type=float, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--mode", choices=["save", "load"], required=True)
    a = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    from elastic.train import checkpoint as ckpt
    from elastic.train.batch import BatchPlan
    from elastic.train.engine import build_engine, init_distributed

    init_distributed(False)
    cfg = _config(hidden_for(a.params))
    plan = BatchPlan.for_world(cfg.data.global_batch_size, world)
    torch.manual_seed(0)
    out: dict = {"world": world, "mode": a.mode}
    if a.mode == "save":
        engine = build_engine(cfg, plan, cfg.model.build())
        x = torch.randn(plan.micro_batch_size, INPUT)
        engine.backward(engine(x).square().mean())
        engine.step()
        state = ckpt.TrainerState(step=1, world_sizes=[world])
        t0 = time.perf_counter()
        ckpt.write(engine, state, rank, a.dir)
        out["save_s"] = _slowest(t0)
        t0 = time.perf_counter()
        ckpt.restore(engine, a.dir, rank)
        out["load_s"] = _slowest(t0)
        out["bytes"] = _bytes(a.dir)
    else:
        state = ckpt.read_state(a.dir)
        universal = ckpt.needs_reshard(state, world, 3)
        engine = build_engine(cfg, plan, cfg.model.build(), load_universal=universal)
        t0 = time.perf_counter()
        ckpt.restore(engine, a.dir, rank, universal=universal)
        out["reshard_load_s"] = _slowest(t0)
        out["universal"] = universal
        out["from_world"] = state.world_sizes[-1]
    out["params"] = sum(int(getattr(q, "ds_numel", q.numel())) for q in engine.module.parameters())
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as tests/reshard_worker.py: ZeRO-3's threads can abort a normal exit


if __name__ == "__main__":
    main()
