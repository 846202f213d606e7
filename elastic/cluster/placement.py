"""Whether the cluster can place a worker group, in words: a worker that fits on no
node, fewer placeable workers than ``scaling.min_workers`` under the placement strategy
(both before a run starts), and what the nodes offer when no group could be started for
``scaling.placement_timeout_s``."""

from __future__ import annotations

from typing import Any

from elastic.errors import ConfigError


def check_resources(sc: Any, nodes: list[dict[str, Any]], fixed: bool = True) -> list[str]:
    """A worker that fits on no node would make Ray ask its autoscaler for it every 35 s,
    forever: say so at once, with what the nodes offer (``nodes``: ``ray.nodes()``). So
    are fewer workers than ``scaling.min_workers`` placeable as the placement strategy
    asks (a STRICT_SPREAD group on too few nodes was retried 182 times in 16 minutes)
    on a ``fixed`` cluster (the embedded one); on one that nodes may still join, that
    is returned as a warning (``scaling.placement_timeout_s`` bounds the wait)."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    need = _worker_needs(sc)
    for resource, amount in need.items():
        best = max((r.get(resource, 0.0) for r in alive), default=0.0)
        if best < amount:
            key = "scaling.cpus_per_worker" if resource == "CPU" else "scaling.use_gpu"
            fix = f"lower {key}" if resource == "CPU" else "set scaling.use_gpu=false"
            offer = ", ".join(f"{r.get(resource, 0.0):g}" for r in alive) or "none"
            raise ConfigError(
                f"{key}: a worker needs {amount:g} {resource} on one node, but the cluster's "
                f"nodes offer {offer} {resource}: {fix}, or add nodes that have it"
            )
    per_node = [int(min(r.get(k, 0.0) // v for k, v in need.items())) for r in alive]
    strategy, wanted = sc.placement_strategy, sc.min_workers
    fits = {
        "STRICT_SPREAD": sum(1 for n in per_node if n),  # a worker a node
        "STRICT_PACK": max(per_node, default=0),  # all on one node
    }.get(strategy, sum(per_node))
    if fits >= wanted:
        return []
    strict = {
        "STRICT_SPREAD": ("puts each worker on a node of its own", "use SPREAD, "),
        "STRICT_PACK": ("puts every worker on one node", "use PACK, "),
    }
    how, other = strict.get(strategy, ("places them on any node", ""))
    found = (
        f"scaling.placement_strategy={strategy} {how}, but the cluster's nodes hold "
        f"{fits} of scaling.min_workers={wanted} ({_offer(alive, need)})"
    )
    if fixed:
        raise ConfigError(f"{found}: {other}lower scaling.min_workers, or add nodes")
    wait = (
        f"up to scaling.placement_timeout_s={sc.placement_timeout_s:g} s"
        if sc.placement_timeout_s
        else "as long as it takes (scaling.placement_timeout_s=0)"
    )
    return [f"{found}: the run waits for nodes to join, {wait}"]


def _worker_needs(sc: Any) -> dict[str, float]:
    """What one worker takes of a node (``sc``: the scaling config)."""
    return {"CPU": sc.cpus_per_worker, **({"GPU": 1.0} if sc.use_gpu else {})}


def _offer(alive: list[dict[str, float]], need: dict[str, float]) -> str:
    """What each live node offers of the resources a worker needs, in words."""
    nodes = "; ".join(", ".join(f"{r.get(k, 0.0):g} {k}" for k in need) for r in alive)
    return f"{len(alive)} node(s): {nodes or 'none'}"


def no_group_started(sc: Any, waited_s: float) -> str:
    """The line that ends a run whose worker group could not be started for
    ``waited_s`` seconds (``scaling.placement_timeout_s``)."""
    import ray

    try:
        alive = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        offer = _offer(alive, _worker_needs(sc))
    except Exception:  # Ray going down: say what is known
        offer = "the nodes could not be asked"
    return (
        f"no worker group could be started for {waited_s:.0f} s (scaling.min_workers="
        f"{sc.min_workers}, {sc.cpus_per_worker:g} CPU{' and a GPU' if sc.use_gpu else ''} "
        f"each, scaling.placement_strategy={sc.placement_strategy}; now {offer}): add nodes, "
        "lower scaling.min_workers or use another placement strategy, or wait longer with "
        "scaling.placement_timeout_s; the same command resumes from the last complete "
        "checkpoint (exit 75)"
    )
