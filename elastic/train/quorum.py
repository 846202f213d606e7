"""A worker's side of live recovery (``scaling.live``): its quorum's process group, the
commit of each step, and leaving a quorum without waiting for a dead peer.

Each worker of a live run is a replica group of its own (Ray Train's replica-group
mode: when one dies, Ray starts a new worker in its place and the others keep running).
The members training together (a quorum, :mod:`elastic.train.membership`) share torch's
default process group, made for that quorum from the run's store (a TCPStore the driver
serves; each quorum's keys under its own prefix), so every collective of the step loop
and of DeepSpeed runs over the quorum unchanged.

- **No collective waits on the dead.** Every collective runs asynchronously and is waited
  on here: when it fails (a peer's connection closed), or a peer has left the quorum
  (its ``broken`` key), or Ray says a member is dead (asked after :data:`ASK_RAY_S` of
  waiting), :class:`QuorumBroken` is raised. A peer stuck in gloo's ring waiting for data
  that never comes is freed by the ``broken`` key, not by gloo's timeout.
- **A step is committed by all or by none** (:meth:`Quorum.commit`, before the optimizer
  step): each member adds one to the step's count after its gradient all-reduce
  succeeded; the step commits when the count reaches the quorum's size, and is aborted
  when the quorum broke first; the first to see either writes the decision
  (compare-and-set), and every member follows it. A member whose all-reduce failed never
  counts, so no member can apply a gradient another one lacks.
- **Leaving is cheap**: the old group is abandoned, not destroyed (destroying waits for
  gloo's threads stuck on the dead peer until its timeout), and a new default group is
  made for the next quorum (:func:`abandon_default_group`).
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic.train.membership import Membership, member_name

POLL_S = 0.05
"""How often a member waiting on a collective or a commit looks at its quorum's
``broken`` key (one store round trip)."""
ASK_RAY_S = 1.0
"""A wait this long asks the control actor (Ray) whether a member is dead, then again at
this interval."""
ASK_TIMEOUT_S = 2.0
"""How long one question for the next quorum waits in the control actor."""
GROUP_TIMEOUT_S = 300
"""gloo's own timeout on a quorum's collectives: only a collective abandoned on a
broken quorum ever reaches it (the thread it holds is then freed)."""

# torch.distributed's tensor collectives that take ``async_op``: run asynchronously and
# waited on by the quorum (the object collectives call these)
_ASYNC = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "barrier",
    "all_to_all", "all_to_all_single",
)  # fmt: skip

_abandoned: list[Any] = []  # groups left with work in flight: kept until the process ends


class QuorumBroken(RuntimeError):
    """The quorum this member trains in is over (a peer died or left): the step in
    flight was not committed; ask for the next quorum and compute it again."""


class Quorum:
    """This worker's membership. ``store_at``: (host, port, key prefix) of the run's
    store;
    ``control``: the run's control actor; ``slot``: this worker's Ray Train rank;
    ``expected``: the workers Ray Train started (the first quorum waits for them)."""

    current: Quorum | None = None  # the process's, once made (the collectives' waits)

    def __init__(
        self, store_at: tuple[str, int, str], control: Any, slot: int, expected: int
    ) -> None:
        host, port, prefix = store_at
        self._tcp = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
        self.store = dist.PrefixStore(prefix, self._tcp)
        self.control, self.expected = control, expected
        self.name = member_name(slot, os.getpid())
        self.membership: Membership | None = None
        self._qstore: Any = None
        self._ray_asked = 0.0
        Quorum.current = self
        _install()

    # -- membership ---------------------------------------------------------------------
    @property
    def size(self) -> int:
        assert self.membership is not None
        return self.membership.size

    @property
    def joining(self) -> bool:
        """This member joined the current quorum without the state (it copies it)."""
        return self.membership is not None and self.name in self.membership.fresh

    def form(self, step: int) -> Membership:
        """Leave the current quorum (if any) at ``step``, wait for the next one and make
        its process group (the default one)."""
        import ray

        leaving = -1
        if self.joining:
            step = -1  # it holds no state yet: it copies it in the next quorum too
        if self.membership is not None:
            leaving = self.membership.id
            self._qstore.set("broken", self.name)  # peers still waiting: stop
            abandon_default_group()
        actor = ray.get_runtime_context().current_actor
        while True:
            if leaving == -1:
                self._announce()  # a newcomer: the quorum training now, take me in
            got = ray.get(
                self.control.quorum_ask.remote(
                    self.name, actor, leaving, step, self.expected, ASK_TIMEOUT_S
                )
            )
            if got is not None:
                break
        m = Membership(**got)
        self.membership = m
        self._qstore = dist.PrefixStore(f"q{m.id}/", self.store)
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("pg/", self._qstore),
            rank=m.rank(self.name),
            world_size=m.size,
            timeout=timedelta(seconds=GROUP_TIMEOUT_S),
        )
        return m

    def _announce(self) -> None:
        """A newcomer: tell the quorum training now that one waits (its members leave it
        at their next commit, and the next quorum takes the newcomer in)."""
        import ray

        now = ray.get(self.control.quorum_now.remote())
        if now >= 0:
            dist.PrefixStore(f"q{now}/", self.store).set("join", self.name)

    def broken(self) -> bool:
        """Whether the quorum is over: a member left it, or Ray says one is dead (asked
        at most every :data:`ASK_RAY_S`)."""
        if self._qstore.check(["broken"]):
            return True
        if time.monotonic() - self._ray_asked < ASK_RAY_S:
            return False
        import ray

        self._ray_asked = time.monotonic()
        assert self.membership is not None
        dead = ray.get(self.control.quorum_dead.remote(self.membership.id))
        if dead:
            self._qstore.set("broken", dead[0])
        return bool(dead)

    def join_waiting(self) -> bool:
        """Whether a newcomer waits to join this quorum."""
        return bool(self._qstore.check(["join"]))

    def leave_now(self) -> None:
        """Mark the quorum broken (this member cannot go on in it)."""
        if self._qstore is not None:
            self._qstore.set("broken", self.name)

    # -- waiting and committing ----------------------------------------------------------
    def wait(self, work: Any) -> None:
        """Wait for a collective's ``work``; QuorumBroken when it fails or the quorum
        breaks meanwhile."""
        if not work.is_completed():
            done = threading.Event()
            work.get_future().add_done_callback(lambda _: done.set())
            self._ray_asked = time.monotonic()  # ask Ray only after ASK_RAY_S of waiting
            while not done.wait(POLL_S):
                if self.broken():
                    raise QuorumBroken(f"quorum {self._id()}: a member left or died")
        try:
            work.wait()
        except Exception as e:
            self.leave_now()
            raise QuorumBroken(f"quorum {self._id()}: a collective failed ({e})") from e

    def commit(self, step: int) -> bool:
        """Every member has the step's reduced gradient (commit: the optimizer steps) or
        not (QuorumBroken: nobody steps). True when a newcomer waits: every member leaves
        the quorum after this step."""
        q, count, key = self.size, f"count/{step}", f"decision/{step}"
        if self._qstore.add(count, 1) == q:
            self._decide(key, step)
        self._ray_asked = time.monotonic()
        pause = 0.0002
        while not self._qstore.check([key]):
            # not decided yet: a peer is slower (or gone). Polled: the store's own wait
            # with a timeout logs a warning each time it times out
            time.sleep(pause)
            pause = min(POLL_S, pause * 2)
            if self._qstore.add(count, 0) == q:
                self._decide(key, step)
            elif pause >= POLL_S and self.broken():
                self._qstore.compare_set(key, "", "abort")
        decision = self._qstore.get(key).decode()
        if decision == "abort":
            raise QuorumBroken(f"quorum {self._id()}: step {step} not committed (a member left)")
        return decision == "commit+join"

    def _decide(self, key: str, step: int) -> None:
        joining = self._qstore.check(["join"])
        self._qstore.compare_set(key, "", "commit+join" if joining else "commit")
        if step > 1:  # every member has read the step before's decision: drop it
            for old in (f"count/{step - 1}", f"decision/{step - 1}"):
                self._qstore.delete_key(old)

    def _id(self) -> int:
        return -1 if self.membership is None else self.membership.id


def abandon_default_group() -> None:
    """Forget torch's default process group without shutting it down (a shutdown waits
    for gloo's threads, and one stuck on a dead peer waits out the group's timeout):
    the group is kept referenced until the process ends; ``init_process_group`` may then
    be called again. torch's own bookkeeping, as ``destroy_process_group`` clears it."""
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    _abandoned.append(c10d._get_default_group())
    world = c10d._world
    c10d._update_default_pg(None)
    for table in (
        world.pg_map,
        world.pg_names,
        world.pg_group_ranks,
        world.pg_backend_config,
        world.pg_to_tag,
        world.tags_to_pg,
        world.pg_coalesce_state,
    ):
        table.clear()
    c10d._unregister_all_process_groups()
    world.group_count = 0


class _Waited:
    """An asynchronous collective's handle whose ``wait`` is the quorum's."""

    def __init__(self, work: Any) -> None:
        self._work = work

    def wait(self, *args: Any) -> bool:
        if Quorum.current is None:
            return bool(self._work.wait(*args))
        Quorum.current.wait(self._work)
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _install() -> None:
    """Route torch.distributed's collectives through the quorum's wait, once a process
    (before :class:`~elastic.train.timing.CollectiveClock` wraps them, and before
    DeepSpeed keeps references)."""
    from torch.distributed import distributed_c10d as c10d

    if getattr(c10d, "_elastic_quorum", False):
        return
    for name in _ASYNC:
        original = getattr(c10d, name, None)
        if original is None:
            continue
        waited = _waited(original)
        setattr(c10d, name, waited)
        if getattr(dist, name, None) is original:
            setattr(dist, name, waited)
    c10d._elastic_quorum = True  # type: ignore[attr-defined]


def _waited(fn: Any) -> Any:
    def waited(*args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        work = fn(*args, async_op=True, **kwargs)
        if work is None:  # this rank is not in the group
            return None
        if async_op:
            return _Waited(work)
        quorum = Quorum.current
        if quorum is None:
            work.wait()
        else:
            quorum.wait(work)
        return None

    waited.__wrapped__ = fn  # type: ignore[attr-defined]
    waited.__name__ = fn.__name__
    waited.__doc__ = fn.__doc__
    return waited


def copy_state(
    engine: Any, state: Any, membership: Membership, loop: dict[str, Any] | None = None
) -> tuple[int, dict[str, Any]]:
    """Collective over a new quorum with newcomers (``membership.fresh``): rank 0 (the
    eldest member, which holds the state) sends the model, the optimizer and its
    schedule, DeepSpeed's step counters and the trainer state (step, epoch, ledger,
    RNG-free: every rank seeds the same); the newcomers load them, the other members
    keep their own (the same); ``loop``: rank 0's step-loop state that decides the
    collectives to come (a deferred checkpoint). The bytes of tensors sent, and rank
    0's ``loop``."""
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        payload[0] = {
            "module": engine.module.state_dict(),
            "optimizer": engine.optimizer.state_dict(),
            "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
            "counters": {k: getattr(engine, k, 0) for k in _ENGINE_COUNTERS},
            "state": state.state_dict(),
            "loop": loop or {},
        }
    dist.broadcast_object_list(payload, src=0)
    got = payload[0]
    quorum = Quorum.current
    if quorum is not None and quorum.joining:
        engine.module.load_state_dict(got["module"])
        engine.optimizer.load_state_dict(got["optimizer"])
        if got["scheduler"] is not None and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(got["scheduler"])
        for k, v in got["counters"].items():
            setattr(engine, k, v)
        state.load_state_dict(got["state"])
        quorum.membership = Membership(
            membership.id,
            membership.members,
            membership.step,
            [m for m in membership.fresh if m != quorum.name],
        )
    return tensor_bytes([got["module"], got["optimizer"]]), got["loop"]


_ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def tensor_bytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state: what a newcomer's copy moves."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(v) for v in state)
    return 0
