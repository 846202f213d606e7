"""What ``stragglers.policy`` does once a log interval has named the slow ranks.

``rebalance``: every rank computes the same new split of every step's rows from the
same gathered table (no collective); it takes effect at the next step, the reader going
on from there with it. ``evict``: rank 0 decides (it alone asks the driver how many
evictions the run has had) and broadcasts the decision, so every rank follows; the
eviction itself waits for the step's other actions (a checkpoint first), then every rank
leaves and Ray Train restarts the group without the node. ``report`` does nothing more
than the interval's straggler events.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch.distributed as dist

from elastic.config.schema import TrainConfig
from elastic.data.order import slice_sizes
from elastic.data.reader import PlannedReader
from elastic.observe.tracking import NullTracker
from elastic.train.batch import BatchPlan
from elastic.train.checkpoint import TrainerState
from elastic.train.control import wait_for_eviction
from elastic.train.stragglers import Evicting, StragglerWatch, eviction


class StragglerActions:
    """One rank's side of the policy. ``control``: the run's control actor on rank 0
    (the evictions so far; it keeps an evicted node out), None elsewhere."""

    def __init__(
        self,
        cfg: TrainConfig,
        plan: BatchPlan,
        watch: StragglerWatch,
        tracker: NullTracker,
        rank: int,
        world: int,
        run_dir: str,
        control: Any = None,
    ) -> None:
        self.cfg, self.plan, self.watch, self.tracker = cfg, plan, watch, tracker
        self.rank, self.world, self.run_dir, self._control = rank, world, run_dir, control
        self.eviction: dict[str, Any] | None = None  # evict: after this step's actions
        self._new_split: tuple[int, ...] | None = None  # rebalance: from the next step on

    def after_log(self, step: int, stragglers: list[dict[str, Any]]) -> None:
        """Collective under ``evict`` when there are stragglers (a broadcast; every rank
        has the same list): decide what the policy does about this interval."""
        policy = self.cfg.stragglers.policy
        if stragglers and policy == "evict":
            self.eviction = self._decide_eviction(step, stragglers)
        if policy == "rebalance":  # the same table on every rank
            self._new_split = self.watch.rebalance(
                self.cfg.data.global_batch_size, self._max_slice_rows()
            )

    def resplit(self, reader: PlannedReader, state: TrainerState) -> PlannedReader | None:
        """The reader that goes on with a new split decided at this step, or None."""
        split, self._new_split = self._new_split, None
        if split is None:
            return None
        s = state
        resplit = reader.resplit(split, s.epoch, s.step - s.epoch_start_step)
        self.tracker.event(
            s.step,
            "rebalance",
            world_size=self.world,
            shares=list(split),
            rows=slice_sizes(self.cfg.data.global_batch_size, split),  # a full step's
        )
        return resplit

    def evict(self, state: TrainerState, checkpoint: Callable[[], None] | None) -> NoReturn:
        """Collective (a barrier): checkpoint (``checkpoint``; None: this step is saved
        already); rank 0 asks the driver to keep the node out and waits until it has, and
        until the checkpoint is registered (the one the smaller group resumes from);
        then every rank leaves (:class:`Evicting`) and Ray Train restarts the group
        without the node."""
        assert self.eviction is not None
        request = self.eviction
        if checkpoint is not None:
            checkpoint()
        self.tracker.event(state.step, "evict", world_size=self.world, **request)
        if self._control is not None:
            wait_for_eviction(self._control, request, self.run_dir, state.step)
        dist.barrier()
        raise Evicting(
            f"step {state.step}: node {request['node']} evicted (rank {request['rank']}, "
            f"{request['ratio']}x the others' compute time) for {request['cooldown_s']:g} s: "
            "the worker group restarts without it"
        )

    def _decide_eviction(
        self, step: int, stragglers: list[dict[str, Any]]
    ) -> dict[str, Any] | None:
        """Rank 0 decides and every rank follows (a broadcast): the node to evict, or None
        (then an ``evict_skipped`` event says why)."""
        decision: list[Any] = [None]
        if self.rank == 0:
            import ray

            done = ray.get(self._control.evictions.remote()) if self._control else 0
            where, min_workers = self.watch.where, self.cfg.scaling.min_workers
            decision = [eviction(stragglers, where, min_workers, done, self.cfg.stragglers)]
        dist.broadcast_object_list(decision, src=0)
        request, why = decision[0]
        if why is not None:
            self.tracker.event(step, "evict_skipped", world_size=self.world, reason=why)
        return request

    def _max_slice_rows(self) -> int | None:
        """The largest slice a rank may train: data.micro_batch_size per forward pass."""
        micro = self.cfg.data.micro_batch_size
        return None if micro is None else micro * self.plan.grad_accum_steps
