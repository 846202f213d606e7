"""Who trains the next step (``scaling.live``): the quorums of a live run, decided in
the run's control actor (:class:`~elastic.train.control.RunControl`). No torch, no Ray.

Each Ray Train worker of a live run is a replica group of its own (a *member*: its Ray
Train slot and its process id; a worker Ray starts in a dead one's slot is a new member).
The members that train together form a *quorum*: an id, the members in order of
seniority (rank = position: the eldest is rank 0 and the source a newcomer copies its
state from), and the step they are at. A quorum is left as a whole: a collective that
failed, a member found dead, or a newcomer waiting makes every member ask for the next
one at the same step (the step that was in flight is computed again by the next quorum,
over the same global batch). The next quorum is decided when every member of the current
one has asked or is dead; newcomers that asked meanwhile join it (they take their state
from rank 0 before the next step). Whether a member is dead is the caller's to say (Ray:
its worker actor gone), through ``alive``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Membership:
    """One quorum. ``members``: member names ("slot.pid") by seniority; ``fresh``: those
    joining it without the state (they copy it from rank 0); ``step``: the last step
    every member with the state has committed."""

    id: int
    members: list[str]
    step: int
    fresh: list[str] = field(default_factory=list)

    def rank(self, member: str) -> int:
        return self.members.index(member)

    @property
    def size(self) -> int:
        return len(self.members)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "members": self.members, "step": self.step, "fresh": self.fresh}


def member_name(slot: int, pid: int) -> str:
    return f"{slot}.{pid}"


def member_pid(member: str) -> int:
    """The process id in a member's name."""
    return int(member.split(".")[1])


class Quorums:
    """The quorums of one fit(). ``expected``: the worker count of the first one (Ray
    Train's group); ``alive(names)``: which of those members' processes are alive (it
    may take a while: it is called without the lock)."""

    def __init__(self, alive: Callable[[list[str]], set[str]], check_every_s: float = 0.5):
        self._alive = alive
        self._check_every_s = check_every_s
        self._lock = threading.Condition()
        self.current = Membership(-1, [], 0)
        self._next_id = 0  # ids are never reused (each quorum's keys in the store are its)
        self._asks: dict[str, tuple[int, int]] = {}  # member -> (quorum it leaves, step)
        self._dead: set[str] = set()
        self._expected = 0
        self._checked_at = 0.0
        self.history: list[dict[str, Any]] = []  # every quorum decided, for the record

    def ask(
        self, member: str, leaving: int, step: int, expected: int, timeout_s: float
    ) -> Membership | None:
        """``member`` leaves quorum ``leaving`` (-1: it has none yet) at ``step``: the next
        quorum it is in, once decided, else None after about ``timeout_s`` (ask again)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._expected = max(self._expected, expected)
            if leaving == -1 or leaving >= self.current.id:  # not a stale ask
                self._asks[member] = (leaving, step)
        while True:
            with self._lock:
                if member in self.current.members and self.current.id > leaving:
                    return self.current
                waiting = self._waiting_for()
            if not waiting:
                with self._lock:
                    if not self._waiting_for():  # nobody asked or died meanwhile
                        self._decide()
                        self._lock.notify_all()
                    continue
            if time.monotonic() >= deadline:
                return None
            if time.monotonic() - self._checked_at >= self._check_every_s:
                self._checked_at = time.monotonic()
                dead = set(waiting) - self._alive(waiting)
                if dead:
                    with self._lock:
                        self._dead |= dead
                        self._lock.notify_all()
                    continue
            with self._lock:
                self._lock.wait(min(self._check_every_s, max(0.0, deadline - time.monotonic())))

    def live_id(self) -> int:
        """The id of the quorum training now, if any of its members is alive; else -1,
        and the book starts over (Ray Train restarted the whole group: its new workers
        form a first quorum, from the checkpoint)."""
        with self._lock:
            cur = self.current
        if not cur.members:
            return -1
        alive = self._alive(cur.members)
        with self._lock:
            if self.current is cur and not alive:
                self.history.append(
                    {"id": cur.id, "ended": "every member gone", "time": time.time()}
                )
                self.current = Membership(cur.id, [], 0)
                self._asks.clear()
                self._dead.clear()
                self._expected = 0
            return self.current.id if self.current.members else -1

    def dead(self, quorum: int) -> list[str]:
        """Members of quorum ``quorum`` found dead (asked of Ray at most every
        ``check_every_s``; a member waiting long on a collective asks)."""
        with self._lock:
            if quorum != self.current.id:
                return []  # that quorum is over: its members know
            members = list(self.current.members)
        if time.monotonic() - self._checked_at >= self._check_every_s:
            self._checked_at = time.monotonic()
            found = set(members) - self._alive(members)
            with self._lock:
                self._dead |= found
        with self._lock:
            return sorted(set(members) & self._dead)

    def _waiting_for(self) -> list[str]:
        """Members the next quorum waits for (the lock held): those of the current one
        that have not asked, alive as far as is known; before the first, the workers
        Ray Train started that have not asked yet (by count)."""
        if not self.current.members:
            asked = [m for m in self._asks if m not in self._dead]
            return ["?"] * max(0, self._expected - len(asked)) if self._expected else ["?"]
        return [
            m
            for m in self.current.members
            if m not in self._dead and self._asks.get(m, (-2, 0))[0] != self.current.id
        ]

    def _decide(self) -> None:
        """The next quorum (the lock held): the members that hold the state (those of
        the current one, in their order; before the first, every worker by slot: each
        resumed from the same checkpoint), then those without it (newcomers in the order
        they asked, and members that had not copied it yet)."""
        cur = self.current
        asked = [m for m in self._asks if m not in self._dead]
        if not cur.members:
            holders, fresh = sorted(asked, key=_slot), []
        else:
            stay = [m for m in cur.members if m in asked]
            holders = [m for m in stay if self._asks[m][1] >= 0]  # a newcomer that copied
            fresh = [m for m in stay if m not in holders]
            fresh += [m for m in asked if m not in cur.members]
        if not holders:  # no live copy of the state: the run restarts from storage
            raise RuntimeError(f"no member of quorum {cur.id} holding the state is left")
        steps = {self._asks[m][1] for m in holders}
        if len(steps) > 1:
            raise RuntimeError(
                f"the members of quorum {cur.id} left it at different steps {sorted(steps)}: "
                "their states differ, none can be the source"
            )
        self.current = Membership(self._next_id, holders + fresh, steps.pop(), fresh=fresh)
        self._next_id += 1
        for m in holders + fresh:
            self._asks.pop(m, None)
        gone = [m for m in cur.members if m not in self.current.members]
        self.history.append({**self.current.to_dict(), "gone": gone, "time": time.time()})


def _slot(member: str) -> int:
    return int(member.split(".")[0])
