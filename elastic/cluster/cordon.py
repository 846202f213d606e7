"""Keep a node out of a run for a while (``stragglers.policy=evict``), with public Ray
APIs only.

A cordon is an actor pinned to the node (hard node affinity) that asks for all of the
node's CPUs and GPUs. It is asked for while the node's training workers still run (the
driver submits it before any rank leaves), so the node's raylet queues it and the
workers' resources go to it when they leave. Ray Train's elastic policy would still
count the node (it sizes groups from the nodes' totals): the run's scaling policy leaves
cordoned nodes out (:func:`elastic.train.trainer.interruptible`), so the restarted group
is sized and placed without it. When the cooldown is over, the driver kills the cordon
and Ray Train's resize check may take the node back. Cordons live no longer than the
driver's Ray job: nothing outlives the run.
"""

from __future__ import annotations

import time
from typing import Any

from elastic.observe.metrics import append_record


class _Hold:
    """Holds a node's resources while it lives; does nothing."""

    def ready(self) -> bool:
        return True


class Cordons:
    """The run's cordoned nodes, each released when its cooldown is over. Every hold and
    release is a console line at once and an event in the run's history
    (``metrics.jsonl``) with the time it happened, written by :meth:`release_all` when
    the fit ends (rank 0 appends to that file while the fit runs)."""

    def __init__(self, run_dir: str, control: Any = None) -> None:
        self.run_dir, self.control = run_dir, control
        self._held: list[tuple[float, Any, dict[str, Any]]] = []  # (until, actor, request)
        self._events: list[dict[str, Any]] = []

    def update(self, requests: list[dict[str, Any]]) -> None:
        """Hold the nodes of new evictions; release those whose cooldown is over. Called
        by the driver's control thread, which must go on whatever happens here (it also
        relays the stop signals): a failure is a warning, and the node is not held."""
        for request in requests:
            try:
                self.hold(request)
            except Exception as e:
                print(f"[elastic] warning: node {request['node']} not kept out: {e}", flush=True)
        try:
            self.release_due()
        except Exception as e:
            print(f"[elastic] warning: releasing kept-out nodes: {e}", flush=True)

    def hold(self, request: dict[str, Any]) -> None:
        """``request``: rank 0's eviction (``node_id``, ``node``, ``cooldown_s``)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node_id = request["node_id"]
        node = next((n for n in ray.nodes() if n["NodeID"] == node_id and n["Alive"]), None)
        resources = (node or {}).get("Resources", {})
        actor = None
        if node is not None:  # a node already gone needs no keeping out
            actor = (
                ray.remote(_Hold)
                .options(
                    num_cpus=resources.get("CPU", 0.0),
                    num_gpus=resources.get("GPU", 0.0),
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                )
                .remote()
            )
        self._held.append((time.monotonic() + request["cooldown_s"], actor, request))
        self._record("cordon", request, held=node is not None)
        if self.control is not None:
            ray.get(self.control.cordoned.remote(node_id, True))
        print(
            f"[elastic] node {request['node']} kept out of the run for "
            f"{request['cooldown_s']:g} s (stragglers.cooldown_s)",
            flush=True,
        )

    def release_due(self) -> None:
        """Release every node whose cooldown is over."""
        now = time.monotonic()
        due = [h for h in self._held if h[0] <= now]
        self._held = [h for h in self._held if h[0] > now]
        for _, actor, request in due:
            self._release(actor, request)
            print(f"[elastic] node {request['node']} may rejoin the run", flush=True)

    def release_all(self) -> None:
        """At the end of the fit: nothing is held past it; the events are written."""
        held, self._held = self._held, []
        for _, actor, request in held:
            self._release(actor, request, at_end=True)
        for record in self._events:
            append_record(self.run_dir, record)
        self._events = []

    def _release(self, actor: Any, request: dict[str, Any], at_end: bool = False) -> None:
        import contextlib

        import ray

        if actor is not None:
            with contextlib.suppress(Exception):  # the node or Ray may be gone already
                ray.kill(actor)
        if self.control is not None:
            with contextlib.suppress(Exception):
                ray.get(self.control.cordoned.remote(request["node_id"], False), timeout=10)
        if not at_end:
            self._record("cordon_released", request)

    def _record(self, event: str, request: dict[str, Any], **extra: Any) -> None:
        keys = ("node", "node_id", "cooldown_s")
        fields = {k: request[k] for k in keys if k in request}
        self._events.append({"event": event, "time": time.time(), **fields, **extra})
