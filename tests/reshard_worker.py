"""One rank of a resharding check, run by tests/test_reshard.py in forked processes
(tests/ranks.py).

Real DeepSpeed engines over a real gloo process group (no Ray: the engine and checkpoint
code are what is under test). A phase either trains a fresh model for a few steps and
writes a checkpoint, or restores a checkpoint written at another world size through
``elastic.train.checkpoint`` (universal conversion when the world size changed). Either way it
then dumps, from rank 0, the consolidated fp32 weights and Adam moments, and the losses of
two more training steps on fixed global batches.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

GLOBAL_BATCH = 12  # splits over 1, 2 and 3 workers
STEPS_BEFORE_SAVE = 3


def _config(stage: int):
    from elastic.config.schema import DataConfig, StrategyConfig, TrainConfig
    from elastic.models.mlp import MLPConfig

    return TrainConfig(
        model=MLPConfig(input_dim=8, hidden_dims=[16, 16], output_dim=3),
        data=DataConfig(path="unused", global_batch_size=GLOBAL_BATCH),
        strategy=StrategyConfig(zero_stage=stage),
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def _step(engine, step: int, rank: int, world: int) -> float:
    """One optimizer step on this rank's share of the step's global batch; the mean loss
    over the whole batch (all-reduced)."""
    x, y = _batch(step)
    per = GLOBAL_BATCH // world
    xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    losses = ((engine(xs) - ys) ** 2).mean(dim=1)
    engine.backward(losses.sum() * world / GLOBAL_BATCH)  # DeepSpeed averages over ranks
    engine.step()
    total = losses.detach().sum().reshape(1)
    dist.all_reduce(total)
    return float(total) / GLOBAL_BATCH


def _dump(engine) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    # ZeRO 1/2 link the optimizer state to the parameters at the first step; a freshly
    # loaded engine has not stepped yet (DeepSpeed internals, test-only)
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()
    for name, p in engine.module.named_parameters():  # collective under ZeRO-3
        full = safe_get_full_fp32_param(p)
        # stage 0: no partitions, the parameter and the torch optimizer's state are whole
        out[f"param/{name}"] = (p.detach() if full is None else full).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            moment = safe_get_full_optimizer_state(p, key) if full is not None else None
            if moment is None:
                moment = engine.optimizer.state[p][key]
            out[f"{key}/{name}"] = moment.clone()
    return out


def run(
    rank: int, world: int, stage: int, port: int, load: str | None, save: str | None, dump: str
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from elastic.train import checkpoint as ckpt
    from elastic.train.batch import BatchPlan
    from elastic.train.engine import build_engine, init_distributed

    init_distributed(False)
    cfg = _config(stage)
    plan = BatchPlan.for_world(GLOBAL_BATCH, world)
    torch.manual_seed(0)
    model = cfg.model.build()
    step, universal, loaded = 0, False, None
    if load:
        state = ckpt.read_state(load)
        universal = ckpt.needs_reshard(state, world, stage)
        engine = build_engine(cfg, plan, model, load_universal=universal)
        loaded = ckpt.restore(engine, load, rank, universal=universal)
        step = state.step
    else:
        engine = build_engine(cfg, plan, model)
        state = ckpt.TrainerState(world_sizes=[world])
        for step in range(1, STEPS_BEFORE_SAVE + 1):
            _step(engine, step, rank, world)
        state.step = step
    if save:
        ckpt.write(engine, state, rank, save)
        dist.barrier()
    result = {
        "state": _dump(engine),
        "global_steps": engine.global_steps,
        "lr": engine.get_lr()[0],
        "universal": universal,
    }
    # the universal folder each rank loaded from, and whether it is still there
    folders: list = [None] * world
    dist.all_gather_object(folders, loaded)
    result["universal_folders"] = folders
    result["universal_left"] = any(f is not None and os.path.exists(f) for f in folders)
    # the second step's loss depends on the restored Adam moments and step counts too
    result["next_losses"] = [_step(engine, step + k, rank, world) for k in (1, 2)]
    if rank == 0:
        torch.save(result, dump)
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: about one run in 50, a gloo/DeepSpeed
    # (ZeRO-3) C++ thread still joinable at finalization aborts the process after this
    # rank's work is done and checked ("terminate called without an active exception",
    # no Python frame: seen with faulthandler and a core dump), and the phase fails.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
