"""A rank's time split into its own work and the wait in the collectives, on real
DeepSpeed ZeRO-2 engines over a real 2-rank gloo group (forked processes:
tests/ranks.py; no Ray).

Rank 1 computes for real (matrix products, not a sleep) for a while before its backward
pass and again before its optimizer step; rank 0 then waits for it inside DeepSpeed's
gradient reduction and inside ZeRO-2's optimizer step (the gradient-norm all-reduce and
the parameter all-gather). Rank 0's backward and optimizer time must stay its own small
work, the wait must show as ``comm``."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from ranks import free_port, start_ranks

BURN_S = 0.4  # rank 1's extra work before each of the two phases


def _burn(seconds: float) -> float:
    """Real work for about ``seconds``; the seconds it took."""
    a = torch.randn(256, 256)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a = torch.tanh(a @ a)
    return time.perf_counter() - t0


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
        DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(1)
    from elastic.config.schema import DataConfig, StrategyConfig, TrainConfig
    from elastic.models.mlp import MLPConfig
    from elastic.train.batch import BatchPlan
    from elastic.train.engine import build_engine, init_distributed
    from elastic.train.timing import CollectiveClock, PhaseTimes

    CollectiveClock.install()  # as the loop does: before DeepSpeed starts
    dist.init_process_group("gloo", rank=rank, world_size=2)
    init_distributed(False)
    cfg = TrainConfig(
        model=MLPConfig(input_dim=8, hidden_dims=[32, 32], output_dim=3),
        data=DataConfig(path="unused", global_batch_size=8),
        strategy=StrategyConfig(zero_stage=2),
    )
    torch.manual_seed(0)
    engine = build_engine(cfg, BatchPlan.for_world(8, 2), cfg.model.build())
    times = PhaseTimes()
    x, y = torch.randn(4, 8), torch.randn(4, 3)
    burned = 0.0
    for step in range(4):  # 2 steps to warm up, then one slowed before each phase
        with times.phase("forward"):
            loss = ((engine(x) - y) ** 2).sum()
        if rank == 1 and step == 2:
            burned += _burn(BURN_S)
        with times.phase("backward"):
            engine.backward(loss)
        if rank == 1 and step == 3:
            burned += _burn(BURN_S)
        with times.phase("optimizer"):
            engine.step()
        if step == 1:
            times.take_interval()  # the warm-up steps are not judged
    seconds = times.take_interval()
    gathered: list = [None, None]
    dist.all_gather_object(gathered, {"seconds": seconds, "burned": burned})
    if rank == 0:
        torch.save(gathered, out)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # no gloo/DeepSpeed thread left to abort the interpreter's teardown


def test_a_slow_rank_is_waited_for_in_comm_not_in_the_fast_ranks_own_work(tmp_path):
    out = str(tmp_path / "times.pt")
    start_ranks(_rank, (free_port(), out), 2)
    fast, slow = torch.load(out, weights_only=False)
    burned = slow["burned"]
    assert burned >= 2 * BURN_S
    own = fast["seconds"]["backward"] + fast["seconds"]["optimizer"]
    # rank 0 waited about as long as rank 1 worked extra, in the collectives...
    assert fast["seconds"]["comm"] > 0.8 * burned, fast
    # ...and its own backward and optimizer work stayed small (a tiny MLP)
    assert own < 0.25 * burned, fast
    # rank 1's extra work was outside its phases: it did not wait for anyone
    assert slow["seconds"]["comm"] < 0.25 * burned, slow


def test_the_ranks_agree_on_every_step_at_first_then_at_their_pace():
    """Every rank computes the same steps from the same sums: every step until the step
    times are known, then about SYNC_PERIOD_S apart (at most SYNC_MAX_STEPS), and always
    on the steps the caller forces (log, checkpoint, validation, an epoch's last)."""
    from elastic.train.control import SYNC_MAX_STEPS, SyncPace

    def agreed_steps(pace, steps, proposals, forced=()):
        out = []
        for s in steps:
            if pace.due(s, forced=s in forced):
                pace.agreed(s, proposals, world=2)
                out.append(s)
        return out

    pace = SyncPace()
    assert agreed_steps(pace, [1], 2 * 8) == [1]  # the first step: nothing known yet
    # both ranks propose 8 steps (the mean is taken); a forced step restarts the count
    assert agreed_steps(pace, range(2, 30), 2 * 8, forced={12}) == [9, 12, 20, 28]
    # the next agreement (36) sets a new pace: a mean of 2.5, rounded down for both
    assert agreed_steps(pace, range(29, 45), 1 + 4) == [36, 38, 40, 42, 44]
    agreed_steps(pace, [46], 10_000)
    assert pace.every == SYNC_MAX_STEPS
    # a rank's proposal: steps in a period at its step time, within [1, SYNC_MAX_STEPS]
    fast = SyncPace()
    for s in range(1, 100):
        fast.due(s)
    assert fast.proposal() == SYNC_MAX_STEPS
    slow = SyncPace()
    slow.due(1)
    slow._since -= 10.0  # one step of 10 s
    assert slow.proposal() == 1
