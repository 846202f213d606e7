"""The parts of a training step, each alone: the schedule (which steps log, checkpoint,
validate, are agreed on, end the run) and the lock-step agreement on real gloo ranks
(forked processes: tests/ranks.py; no Ray, no DeepSpeed)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch.distributed as dist
from ranks import free_port, start_ranks

from elastic.config.schema import CheckpointConfig, DataConfig, TrainConfig, TrainerConfig
from elastic.models.mlp import MLPConfig
from elastic.train.checkpoint import TrainerState
from elastic.train.schedule import Schedule


def _schedule(steps_per_epoch: int = 10, **trainer) -> Schedule:
    cfg = TrainConfig(
        model=MLPConfig(),
        data=DataConfig(path="unused"),
        trainer=TrainerConfig(**{"log_every_steps": 4, "val_every_steps": 6, **trainer}),
        checkpoint=CheckpointConfig(every_steps=5),
    )
    return Schedule(cfg, steps_per_epoch)


def test_the_schedule_says_which_steps_log_checkpoint_validate_and_are_agreed_on():
    when = _schedule(max_steps=0, max_epochs=2)
    state = TrainerState()
    assert [s for s in range(1, 13) if when.logs_at(s)] == [1, 4, 8, 12]
    assert [s for s in range(1, 13) if when.checkpoints_at(s)] == [5, 10]
    assert [s for s in range(1, 13) if when.validates_at(s)] == [6, 12]
    # agreed on: every step the ranks act on together, and the epoch's last (10)
    agreed = [s for s in range(1, 11) if when.agreed_on(s, state)]
    assert agreed == [1, 4, 5, 6, 8, 10]
    state.epoch_start_step = 10  # the next epoch: its last is step 20
    assert [s for s in range(11, 21) if when.agreed_on(s, state)] == [12, 15, 16, 18, 20]


def test_the_schedule_ends_the_run_at_its_stopping_rules():
    when = _schedule(max_steps=7, max_epochs=0, stop_at_step=0)
    state = TrainerState(step=6)
    assert not when.done(state, False) and when.logs_at(7)  # the last step is logged
    state.step = 7
    assert when.done(state, False) and when.ends_here(state, False)
    assert when.done(TrainerState(step=1), stopped=True)  # a stop reason ends it too
    stopping = _schedule(max_steps=0, max_epochs=3, stop_at_step=3)
    assert stopping.stops_at(TrainerState(step=3)) and not stopping.stops_at(TrainerState(step=2))
    # the last epoch's last step ends the run before the epoch closes
    last = _schedule(steps_per_epoch=10, max_steps=0, max_epochs=1)
    assert not last.ends_here(TrainerState(step=9), False)
    assert last.ends_here(TrainerState(step=10), False)


def _lockstep_rank(rank: int, port: int, out: str, case: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    from elastic.data.stream import StepBatch
    from elastic.errors import DivergedError
    from elastic.train.divergence import Divergence
    from elastic.train.lockstep import LockStep

    dist.init_process_group("gloo", rank=rank, world_size=2)
    divergence = Divergence(2, f"{out}/data", 0.1)
    drains = iter([False, rank == 1, False])  # rank 1's node is drained at the 2nd
    lock = LockStep(2, torch.device("cpu"), None, divergence, lambda: next(drains, False))
    seen = []
    for step in (1, 2, 3):
        ids = np.arange(4 * step + 2 * rank, 4 * step + 2 * rank + 2)
        rows = 2 if case != "disagree" or rank == 0 or step < 3 else 1
        batch = StepBatch(ids[:rows], np.zeros((rows, 1)), np.zeros(rows), global_rows=4)
        if case == "diverge" and rank == 0 and step == 2:
            divergence.note(step, ids[:1])
        try:
            agreed = lock.agree(step, batch, forced=True)
        except (RuntimeError, DivergedError) as e:
            seen.append({"step": step, "error": type(e).__name__, "message": str(e)})
            break
        seen.append({"step": step, "agreed": agreed, "drain": lock.drain_pending,
                     "digest": lock.digest})  # fmt: skip
    with open(f"{out}/{rank}.json", "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()


def _lockstep(tmp_path, case: str) -> list[list[dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "data").mkdir()
    ids = pa.table({"sample_id": np.arange(20, dtype=np.int64)})
    pq.write_table(ids, tmp_path / "data" / "part-00000.parquet")
    start_ranks(_lockstep_rank, (free_port(), str(tmp_path), case), nprocs=2)
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("case", ["agree", "disagree", "diverge"])
def test_the_ranks_agree_on_rows_digests_drains_and_divergence_together(tmp_path, case):
    """Every rank gets the same answer at the same step: the same digest of the step's
    rows (of both ranks' ids), a drain seen on one rank's node, a non-finite loss on one
    rank (both stop, with the rows named), and rows that do not add up to the plan's."""
    r0, r1 = _lockstep(tmp_path, case)
    if case == "agree":
        assert [s["agreed"] for s in r0] == [True, True, True]
        assert [s["drain"] for s in r0] == [s["drain"] for s in r1] == [False, True, False]
        assert [s["digest"] for s in r0] == [s["digest"] for s in r1]
        assert len({s["digest"] for s in r0}) == 3  # other rows, another digest
    elif case == "disagree":  # rank 1 trained 1 row of its 2 at step 3
        for r in (r0, r1):
            assert r[-1]["step"] == 3 and r[-1]["error"] == "RuntimeError"
            assert "the ranks hold 3 rows since they last agreed, the plan 4" in r[-1]["message"]
    else:
        for r in (r0, r1):
            assert r[-1]["step"] == 2 and r[-1]["error"] == "DivergedError"
            assert (
                "training diverged at step 2: the loss is not finite for sample_id 8"
                in (r[-1]["message"])
            )
