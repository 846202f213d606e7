"""One measurement for ``bench.py memory``: model-state bytes per rank of elastic's
DeepSpeed engine at one ZeRO stage, precision and world size.

    torchrun --standalone --nproc-per-node N launch/peers/zero_memory.py --stage S ...

The engine is elastic's own (``elastic.train.engine.build_engine``, gloo, CPU). After three
optimizer steps and one more backward pass (gradients and optimizer moments both alive:
the peak of the model states), every live tensor storage in the process is counted once
and put under what holds it: the module's parameters and gradients, or an attribute of
DeepSpeed's optimizer or of the torch optimizer inside it (Adam's moments, fp32 master
partitions, gradient partitions). Storages nothing names are reported apart as
``other_bytes``: communication buffers (ZeRO-3's reduce bucket of ``reduce_bucket_size``
elements, allocated whole), not model state. Rank 0 prints one JSON line with every
rank's figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from elastic.config.schema import DataConfig, StrategyConfig, TrainConfig
from elastic.models.mlp import MLPConfig
from elastic.train.batch import BatchPlan
from elastic.train.engine import build_engine, init_distributed


def _storages() -> dict[int, int]:
    """Every live tensor storage in the process: data pointer -> bytes."""
    found: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            storage = obj.untyped_storage()
            if storage.data_ptr():
                found[storage.data_ptr()] = max(found.get(storage.data_ptr(), 0), storage.nbytes())
    return found


def _holders(engine: Any) -> dict[int, str]:
    """Data pointer -> what holds that storage: param, grad, optimizer.<attribute>."""
    names: dict[int, str] = {}

    def walk(obj: Any, name: str, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.untyped_storage().data_ptr():
                names.setdefault(obj.untyped_storage().data_ptr(), name)
        elif depth < 4 and isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item, name, depth + 1)
        elif depth < 4 and isinstance(obj, dict):
            for key, item in obj.items():
                # torch optimizer state is keyed by parameter: name it by the moment
                walk(item, name if isinstance(key, torch.Tensor) else f"{name}.{key}", depth + 1)

    for p in engine.module.parameters():
        walk(p, "param", 0)
        walk(getattr(p, "ds_tensor", None), "param", 0)  # ZeRO-3: this rank's partition
        walk(p.grad, "grad", 0)
    inner = getattr(engine.optimizer, "optimizer", None)
    if inner is not None:
        walk(inner.state, "adam", 0)
    walk(vars(engine.optimizer), "optimizer", 0)
    return names


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--precision", choices=["fp32", "bf16"], required=True)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    a = p.parse_args()

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    init_distributed(False)
    global_batch = 12  # splits over 1, 2 and 3 ranks
    cfg = TrainConfig(
        model=MLPConfig(input_dim=512, hidden_dims=[a.hidden] * a.layers, output_dim=8),
        data=DataConfig(path="unused", global_batch_size=global_batch),
        strategy=StrategyConfig(zero_stage=a.stage, precision=a.precision),
    )
    plan = BatchPlan.for_world(global_batch, world)
    torch.manual_seed(0)
    model = cfg.model.build()
    psi = sum(q.numel() for q in model.parameters())
    engine = build_engine(cfg, plan, model)
    dtype = torch.bfloat16 if a.precision == "bf16" else torch.float32
    x = torch.randn(plan.micro_batch_size, 512, dtype=dtype)
    y = torch.randn(plan.micro_batch_size, 8, dtype=dtype)
    for step in range(4):
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        if step < 3:
            engine.step()
    del x, y, loss
    gc.collect()
    storages, holders = _storages(), _holders(engine)
    parts: dict[str, int] = {}
    other = 0
    for ptr, size in storages.items():
        name = holders.get(ptr)
        if name is None:
            other += size
        else:
            parts[name] = parts.get(name, 0) + size
    mine = {"model_state_bytes": sum(parts.values()), "other_bytes": other, "parts": parts}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        print(json.dumps({"psi": psi, "ranks": every}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # as in tests/reshard_worker.py: skip the interpreter's teardown, where a gloo /
    # DeepSpeed thread still joinable now and then aborts a process whose work is done
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
