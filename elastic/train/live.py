"""The step loop's live-recovery part (``scaling.live``): what a worker does when its
quorum changes (:class:`LiveRun`), beside :class:`~elastic.train.step_loop.StepLoop`,
which owns the step. The quorum itself (process group, commit, waits) is
:mod:`elastic.train.quorum`; who is in it, :mod:`elastic.train.membership`."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from elastic.data.reader import slice_ids
from elastic.observe.tracking import NullTracker
from elastic.train.accounting import gather_ledger
from elastic.train.batch import BatchPlan
from elastic.train.engine import set_plan
from elastic.train.membership import Membership
from elastic.train.quorum import Quorum, QuorumBroken, copy_state

WHOLE_WAIT_S = 300.0
"""How long a checkpoint (the final one included) waits for a worker in a dead one's
place (Ray Train starts it; its report needs every worker it started) before the group
gives up and restarts from the last checkpoint."""

Rewire = Callable[[Membership], tuple[NullTracker, list[dict[str, Any]]]]
"""What the worker entry redoes for a new quorum: the tracker (rank 0's where this
worker became rank 0), every rank's place (a collective)."""


class LiveRun:
    """One worker's live part of the step loop (``loop``: its
    :class:`~elastic.train.step_loop.StepLoop`, which imports this module).
    ``wire(rank, where, tracker)``: the step loop's parts that depend on the ranks
    training together, made again."""

    def __init__(
        self,
        loop: Any,
        quorum: Quorum,
        rewire: Rewire,
        wire: Callable[[int, list[dict[str, Any]], NullTracker], None],
    ) -> None:
        self.loop, self.quorum, self._rewire, self._wire = loop, quorum, rewire, wire
        self.leave_after_step = False  # a newcomer waits: this quorum ends after the step
        self.save_due = False  # a checkpoint deferred until the quorum is whole
        self._deferred_at = 0.0  # since when (monotonic seconds)
        self.end: dict[str, Any] | None = None  # trained and validated: at the end
        self.gathered_step = loop.state.step  # the ledger's last gather (every rank's ids)

    # -- the quorum changes ---------------------------------------------------------------
    def reform(self, why: QuorumBroken | None) -> None:
        """Leave this quorum after the last committed step (``why``: it broke; None: a
        newcomer waits), wait for the next one, and wire the loop for it: the batch plan
        of its size (the same global batch), the engine's accumulation and rank, the
        reducer, every rank's place, the reader's split from the next step; a newcomer
        copies the state from rank 0."""
        loop, s, t0 = self.loop, self.loop.state, time.perf_counter()
        assert loop.reader is not None
        before = self.quorum.membership
        m = self.quorum.form(s.step)
        data = loop.cfg.data
        loop.plan = BatchPlan.for_world(data.global_batch_size, m.size, data.micro_batch_size)
        set_plan(loop.engine, loop.plan, m.rank(self.quorum.name))
        if loop.reducer is not None:
            loop.reducer.regroup(m.size)
        gone = [x for x in (before.members if before else []) if x not in m.members]
        lost = self._lost_rows([before.rank(x) for x in gone] if before else [])
        tracker, where = self._rewire(m)
        self._wire(m.rank(self.quorum.name), where, tracker)
        copied = copy_state(loop.engine, s, m, self.loop_state())[0] if m.fresh else 0
        self.gather()
        if self.end is None:
            loop.reader = loop.reader.resplit(
                m.size, s.epoch, s.step - s.epoch_start_step, loop.rank
            )
        else:  # at the end nothing is left to read: the split, for a member lost now
            loop.reader.rank, loop.reader.world = loop.rank, m.size
        if not s.world_sizes or s.world_sizes[-1] != m.size:
            s.world_sizes.append(m.size)
            s.batch_plans.append(loop.plan.to_dict())
        self.leave_after_step = False
        loop.tracker.event(
            s.step,
            "quorum",
            quorum=m.id,
            world_size=m.size,
            members=m.members,
            previous=before.size if before else None,
            gone=gone,
            joined=m.fresh,
            cause=str(why) if why is not None else "join",
            copied_bytes=copied,
            ledger_from_plan=lost,
            seconds=round(time.perf_counter() - t0, 3),
        )

    @contextmanager
    def step(self, engine: Any) -> Iterator[None]:
        """Around a step's micro-steps: when the quorum breaks before the commit, the
        engine's micro-step count is set back (the step starts over)."""
        micro_steps = engine.micro_steps
        try:
            yield
        except QuorumBroken:
            engine.micro_steps = micro_steps
            raise

    def commit(self, step: int, times: Any) -> None:
        """Every member has ``step``'s gradient, or none steps (QuorumBroken); the wait
        counts as ``comm`` in ``times``."""
        t0 = time.perf_counter()
        self.leave_after_step = self.quorum.commit(step)
        times.since("comm", t0)

    def loop_state(self) -> dict[str, Any]:
        """What a newcomer must take from rank 0 to make the same collectives."""
        return {"save_due": self.save_due, "end": self.end}

    def take(self, loop_state: dict[str, Any]) -> None:
        """A newcomer: rank 0's :meth:`loop_state`."""
        self.save_due = bool(loop_state.get("save_due", False))
        self._deferred_at = time.monotonic()  # its wait counts from here
        self.end = loop_state.get("end")

    def _lost_rows(self, ranks: list[int]) -> int:
        """The rows members that died (their ``ranks`` in the quorum that broke) trained
        in the steps committed since the ledger's last gather; their notes of them died
        with them. Those steps were committed, so their gradients are in the model: the
        ledger takes the rows the plan gave them (read from the shards), the same on
        every member. How many."""
        s, reader = self.loop.state, self.loop.reader
        assert reader is not None
        if not ranks or self.gathered_step >= s.step:
            return 0
        start = s.epoch_start_step
        steps = range(self.gathered_step - start, s.step - start)
        ids = slice_ids(
            reader.cfg, reader.files, reader.layout, s.epoch, steps, ranks, reader.world
        )
        s.ledger.merge([ids])
        return len(ids)

    # -- the ledger and checkpoints -------------------------------------------------------
    def gather(self) -> None:
        """Collective: the ledger's gather onto every member (any may become rank 0)."""
        loop = self.loop
        gather_ledger(loop.state.ledger, loop.rank, loop.world, everywhere=True)
        self.gathered_step = loop.state.step

    def whole(self) -> bool:
        """Whether every worker Ray Train started is in the quorum (its report, which a
        checkpoint goes through, waits for all of them)."""
        return self.loop.world >= self.quorum.expected

    def defer_save(self) -> bool:
        """Whether the checkpoint due now waits (a worker is missing: it is written at the
        first step the quorum is whole). Past :data:`WHOLE_WAIT_S` without one, the group
        restarts from the last checkpoint rather than train on unsaved."""
        step, world = self.loop.state.step, self.loop.world
        if self.whole():
            self.save_due = False
            return False
        if not self.save_due:
            self.loop.tracker.event(step, "checkpoint_deferred", world_size=world)
            self._deferred_at = time.monotonic()
        elif time.monotonic() - self._deferred_at > WHOLE_WAIT_S:
            raise RuntimeError(
                f"step {step}: {world} of {self.quorum.expected} workers and no checkpoint "
                f"for {WHOLE_WAIT_S:g} s (no worker joined in a dead one's place): the group "
                "restarts from the last checkpoint"
            )
        self.save_due = True
        return True

    def await_whole(self, val: dict[str, float], stop_reason: str | None) -> None:
        """At the end (``val``: the validation's metrics, for a newcomer that joins now):
        until a worker in a dead one's place has joined, at most :data:`WHOLE_WAIT_S`."""
        self.end = {"val": val, "stop_reason": stop_reason}
        deadline = time.monotonic() + WHOLE_WAIT_S
        while not self.whole():
            if self.quorum.broken() or self.quorum.join_waiting():
                self.reform(None)
            elif time.monotonic() > deadline:
                raise RuntimeError(
                    f"step {self.loop.state.step}: {self.loop.world} of "
                    f"{self.quorum.expected} workers at the end, none joined in "
                    f"{WHOLE_WAIT_S:g} s: the final checkpoint needs them all"
                )
            else:
                time.sleep(0.2)
