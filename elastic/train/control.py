"""The run's control channel: one small actor owned by the driver for the whole fit().

The driver asks it to stop (SIGTERM/SIGUSR1 to the driver: a batch system's warning);
rank 0 of each worker group keeps a question out to it without blocking
(:class:`StopPoller`) and the answer reaches every rank inside the all-reduce the ranks
agree on their steps with (:class:`SyncPace`). Each
worker group start registers here, so a restarted group knows it is a restart (after a
failure, a shrink or a grow) even when no checkpoint recorded the previous one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from elastic.train.membership import Quorums
from elastic.train.trainer import DrainWatching

STOP_WAIT_S = 10.0
"""How long rank 0's standing question "stop?" waits in the control actor before it is
asked again (a stop answers it at once)."""
STATUS_WAIT_S = 10.0
"""The same for the driver's "anything new?" (a fatal error, rank 0's progress, a node
to keep out)."""
CONTROL_THREADS = 64
"""The control actor's threads: each standing question holds one while it waits (the
driver's, each worker group's rank 0's until it times out; in a live run, each worker
asking for its next quorum), the others answer at once."""
SYNC_PERIOD_S = 0.25
"""About how often the ranks agree on their steps (:class:`SyncPace`)."""
SYNC_MAX_STEPS = 32
"""At most this many steps between two agreements."""


Status = tuple[str | None, dict[str, float] | None, list[dict[str, Any]], float | None]
"""What :meth:`RunControl.status` tells the driver."""


class RunControl(DrainWatching):
    """Runs as a ``num_cpus=0`` threaded Ray actor; plain methods, no Ray imports. It
    also watches node drains for the fit's worker groups (:class:`DrainWatching`).

    Its two readers ask standing questions (:meth:`wait_stop`, :meth:`wait_status`)
    that it answers the moment there is news, else after a timeout: a call per piece
    of news (the driver's: rank 0's log lines) or every 10 s, instead of a poll every
    0.5 s each (a call costs milliseconds of CPU, the caller's, the actor's and Ray's
    together: polls at that rate take a share of the cores the training runs on)."""

    def __init__(self) -> None:
        self._news = threading.Condition()  # guards every field; notified on news
        self._version = 0  # how many pieces of news so far (stop, fatal, progress, eviction)
        self._stop_reason: str | None = None
        self._fatal: str | None = None
        self._starts: list[int] = []
        self._progress: dict[str, float] | None = None
        self._evictions: list[dict[str, Any]] = []  # every eviction of this fit()
        self._to_cordon: list[dict[str, Any]] = []  # not yet taken by the driver
        self._evicting = False  # the next group start follows an eviction
        self._cordoned: set[str] = set()  # node ids the driver keeps out now
        # whether a worker group is up (Ray Train's controller says, GroupWatch), and
        # since when none is (wall-clock seconds; None while one is up)
        self._controller: Any = None  # Ray Train's controller actor, once it started
        self._group_up = False
        self._starting = True
        self._down_since: float | None = time.time()
        # scaling.live: the quorums, and each member's Ray worker actor (to ask Ray
        # whether it is alive)
        self._members: dict[str, Any] = {}
        self.quorums = Quorums(self._alive)

    def _tell(self) -> None:
        """News: wake every standing question (the caller holds ``_news``)."""
        self._version += 1
        self._news.notify_all()

    def request_stop(self, reason: str) -> None:
        with self._news:
            self._stop_reason = self._stop_reason or reason
            self._tell()

    def wait_stop(self, timeout_s: float) -> str | None:
        """Rank 0's standing question: the stop reason as soon as there is one, else
        None after ``timeout_s``."""
        with self._news:
            self._news.wait_for(lambda: self._stop_reason is not None, timeout_s)
            return self._stop_reason

    def fail(self, message: str) -> None:
        """A worker hit an error retrying cannot fix (a bad row): the driver ends the
        run with this message instead of restarting the worker group."""
        with self._news:
            self._fatal = self._fatal or message
            self._tell()

    def fatal(self) -> str | None:
        return self._fatal

    def progress(
        self, step: int, epoch: int, loss: float, world: int, samples_per_s: float
    ) -> None:
        """Rank 0's latest log line, for the driver's progress display."""
        with self._news:
            self._progress = {
                "step": step,
                "epoch": epoch,
                "loss": loss,
                "world": world,
                "samples_per_s": samples_per_s,
            }
            self._tell()

    def evict(self, request: dict[str, Any]) -> None:
        """Rank 0 evicts a straggler's node (``node_id``, ``cooldown_s``, ...): the
        driver keeps it out of the run (:mod:`elastic.cluster.cordon`) before the worker
        group restarts without it."""
        with self._news:
            self._evictions.append(request)
            self._to_cordon.append(request)
            self._evicting = True
            self._tell()

    def evictions(self) -> int:
        return len(self._evictions)

    def cordoned(self, node_id: str, held: bool) -> None:
        """The driver: it now keeps ``node_id`` out (a hold is asked for), or no longer."""
        with self._news:
            if held:
                self._cordoned.add(node_id)
            else:
                self._cordoned.discard(node_id)

    def is_cordoned(self, node_id: str) -> bool:
        return node_id in self._cordoned

    def cordoned_nodes(self) -> list[str]:
        """Ray Train's scaling policy asks, to size a group without them."""
        with self._news:
            return sorted(self._cordoned)

    def controller_started(self, handle: Any) -> None:
        """Ray Train's controller: its own actor handle (the driver aborts it with it)."""
        with self._news:
            self._controller = handle

    def controller(self) -> Any:
        return self._controller

    def controller_state(self, up: bool, starting: bool) -> None:
        """Ray Train's controller, at each change of its state: whether a worker group
        is up (training, resizing, or waiting out a drain's grace period), and whether
        one is being started (first, or again after a failure; else the run ends)."""
        with self._news:
            if up != self._group_up or starting != self._starting:
                if up != self._group_up:
                    self._down_since = None if up else time.time()
                self._group_up, self._starting = up, starting
                self._tell()

    def status(self) -> Status:
        """(a fatal error, rank 0's latest progress, the nodes to keep out since the
        last call, since when no worker group is up and one is being started, else
        None): the driver's look."""
        with self._news:
            taken, self._to_cordon = self._to_cordon, []
            starting_since = self._down_since if self._starting else None
            return self._fatal, self._progress, taken, starting_since

    def wait_status(self, seen: int, timeout_s: float) -> tuple[int, Status]:
        """The driver's standing question: as soon as there is news past its ``seen``
        (else after ``timeout_s``), the news count and :meth:`status`."""
        with self._news:
            self._news.wait_for(lambda: self._version > seen, timeout_s)
            return self._version, self.status()

    # -- scaling.live: quorums (elastic.train.membership) ----------------------------
    def quorum_ask(
        self, member: str, actor: Any, leaving: int, step: int, expected: int, timeout_s: float
    ) -> dict[str, Any] | None:
        """A live run's worker leaves quorum ``leaving`` (-1: none yet) at ``step``: the
        next quorum it is in, once decided (else None after ``timeout_s``: ask again)."""
        with self._news:
            self._members.setdefault(member, actor)
        m = self.quorums.ask(member, leaving, step, expected, timeout_s)
        return None if m is None else m.to_dict()

    def quorum_live(self) -> int:
        """The id of the quorum training now if a member of it is alive, else -1 (a new
        worker group forms a first one)."""
        return self.quorums.live_id()

    def quorum_now(self) -> int:
        """The id of the quorum training now (-1: none yet)."""
        return self.quorums.current.id

    def quorum_dead(self, quorum: int) -> list[str]:
        """Members of quorum ``quorum`` whose processes are gone (Ray says)."""
        return self.quorums.dead(quorum)

    def _alive(self, members: list[str]) -> set[str]:
        """Which of ``members`` Ray still has a worker actor for (one that does not
        answer within a second is busy, so alive)."""
        import ray

        with self._news:
            handles = {m: self._members[m] for m in members if m in self._members}
        pings = {m: h.__ray_ready__.remote() for m, h in handles.items()}
        alive = {m for m in members if m not in handles}  # not asked yet: no word of it
        ready, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=1.0)
        for m, ref in pings.items():
            if ref not in ready:
                alive.add(m)
                continue
            try:
                ray.get(ref)
                alive.add(m)
            except ray.exceptions.RayActorError:
                pass
        return alive

    def register_start(self, world_size: int) -> tuple[list[int], bool]:
        """World sizes of every worker group start of this fit(), this one last; and
        whether this start follows an eviction."""
        with self._news:
            self._starts.append(world_size)
            evicted, self._evicting = self._evicting, False
            return list(self._starts), evicted


def start_control() -> Any:
    """On the driver's node: it must outlive any worker node (its state is the run's)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(RunControl).options(
        num_cpus=0, max_concurrency=CONTROL_THREADS, scheduling_strategy=here
    )
    return actor.remote()


class StopPoller:
    """Rank 0's view of the control actor: never blocks a training step. One standing
    :meth:`RunControl.wait_stop` is out at a time; :meth:`poll` only looks whether it
    has come back (a local check, no call)."""

    def __init__(self, control: Any) -> None:
        self._control = control
        self._pending: Any = None
        self.reason: str | None = None

    def poll(self) -> str | None:
        import ray

        if self._control is None or self.reason:
            return self.reason
        if self._pending is not None:
            ready, _ = ray.wait([self._pending], timeout=0)
            if ready:
                self.reason = ray.get(ready[0])
                self._pending = None
        if self._pending is None and not self.reason:
            self._pending = self._control.wait_stop.remote(STOP_WAIT_S)
        return self.reason


class SyncPace:
    """When the ranks agree on their steps (one small all-reduce: the steps' rows, and
    whether any rank has seen a stop request, a node drain or a non-finite value).

    Every step would cost a collective a step (~0.6 ms on gloo here, and the wait for the
    slowest rank outside DeepSpeed's own): at first every step, then every ``every``
    steps, paced to about :data:`SYNC_PERIOD_S` from the ranks' step times (each rank
    proposes, the mean is taken, so every rank computes the same pace); a step the
    caller must agree on (a log, checkpoint or validation step, an epoch's last) is
    always one. A stop request or a node drain thus acts within about a quarter of a
    second, or one step when steps are slower than that."""

    def __init__(self) -> None:
        self.every = 1
        self.next_at = 0  # the first step agreed on: the next one
        self._since = time.perf_counter()
        self._steps = 0  # steps since the last agreement

    def due(self, step: int, forced: bool = False) -> bool:
        """Whether the ranks agree on ``step`` (every rank answers the same)."""
        self._steps += 1
        return forced or step >= self.next_at

    def proposal(self) -> int:
        """This rank's pace: steps a period takes at its step time since the last one."""
        step_s = (time.perf_counter() - self._since) / max(1, self._steps)
        return int(min(SYNC_MAX_STEPS, max(1, SYNC_PERIOD_S // max(step_s, 1e-6))))

    def agreed(self, step: int, proposals: int, world: int) -> None:
        """After the all-reduce at ``step``: ``proposals``, the sum of every rank's."""
        self.every = max(1, min(SYNC_MAX_STEPS, proposals // world))
        self.next_at = step + self.every
        self._since, self._steps = time.perf_counter(), 0


def node_drain_probe() -> Callable[[], bool]:
    """Whether a node of this worker group is being drained (preempted), as a cheap
    per-step check. Ray Train marks every worker's context when that happens; the probe
    reads the local mark without Ray Train's barrier (``ray.train.get_preemption_info``
    waits for every rank); the ranks' agreement on their steps makes the answer common."""
    from elastic.cluster import ray_internals

    try:
        preemption = ray_internals.worker_preemption_context()
    except Exception:  # not inside a Ray Train V2 worker, or the internals moved
        return lambda: False
    return lambda: preemption.preemption_info is not None


def wait_for_eviction(control: Any, request: dict[str, Any], run_dir: str, step: int) -> None:
    """Rank 0, before the ranks leave: the eviction is with the control actor, the driver
    has asked for the node to be kept out (so the restarted group is placed without it),
    and Ray Train has registered the eviction's checkpoint (so the group resumes from it,
    not from an older one). Gives up waiting after a minute: the worst outcome is then
    an older checkpoint or the node taken back at once, never a wrong result."""
    import ray

    from elastic.train.integrity import registered_steps

    ray.get(control.evict.remote(request))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        held = ray.get(control.is_cordoned.remote(request["node_id"]))
        if held and step in registered_steps(run_dir):
            return
        time.sleep(0.1)
