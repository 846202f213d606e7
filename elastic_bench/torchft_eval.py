"""torchft: Ray Train 2.60's own live recovery (replica groups with torchft 0.2.0), measured
on a real multi-raylet cluster: what elastic can take from it (issue 45, "use what
exists first"). Not elastic's trainer: Ray's example shape (each worker its own replica
group, the only size Ray 2.60 makes; torchft's Manager with a quorum through a
Lighthouse each step; ProcessGroupGloo across the groups; PGTransport to heal a newcomer
from a live peer) with the recovery benchmark's model (an MLP 64-1024-1024-4), SGD with
momentum, and a fixed batch per group and step. The gradients are averaged through the
Manager (``manager.allreduce``): with torchft's DDP wrapper the survivors failed too.

Three one-worker nodes train and a fourth stands by (one node's worth of spare CPUs).
After some committed steps one training worker is SIGKILLed; after more, one training
worker's node is removed (a dead machine). Per fault: whether any survivor's process
changed; the survivors' longest gap between committed steps; the iterations they ran
that were not committed (their batches dropped: torchft moves a failed step's data on);
the time until the victim's group commits from a new process (the heal); the
participants of each committed step (the global batch is participants x a group's
batch: it shrinks while a group is missing). Not in ``bench all``; needs the ``ft``
extra. Writes bench-torchft.json, every iteration of every group included."""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HELP = "Ray Train's replica groups with torchft: a kill and a node loss, survivors' stall"
GROUPS = 3  # training workers, each its own replica group
ROWS = 32  # a group's batch each step
DIMS = (64, 1024, 1024, 4)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=900, help="committed steps in all")
    p.add_argument("--fault-every", type=int, default=300, help="committed steps between faults")
    p.add_argument("--join-timeout-ms", type=int, help="the Lighthouse's (torchft's default)")
    p.add_argument("--heartbeat-timeout-ms", type=int, help="the Lighthouse's (torchft's default)")


def _train(config: dict[str, Any]) -> None:
    """One worker: its own replica group of one, torchft around a plain torch MLP. Logs
    every iteration (step before it, committed or not, participants) to its own file."""
    from datetime import timedelta

    import ray.train
    import torch
    from torchft import Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in zip(DIMS, DIMS[1:], strict=False):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers[:-1])
    inner = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=30))
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=lambda s: (
            net.load_state_dict(s["model"]),
            inner.load_state_dict(s["optim"]),
        ),
        state_dict=lambda: {"model": net.state_dict(), "optim": inner.state_dict()},
        world_size=1,
        rank=0,
        replica_id=f"group{rank}",
        timeout=timedelta(seconds=60),
        checkpoint_transport=PGTransport(
            pg, timeout=timedelta(seconds=30), device=torch.device("cpu")
        ),
    )
    # gradients averaged through the Manager (its DDP wrapper's comm hook failed an
    # assertion in the survivors when a peer died: see docs/elastic.md)
    optimizer = Optimizer(manager, inner)
    with open(Path(config["dir"]) / f"group{rank}-{os.getpid()}.jsonl", "a") as log:
        while manager.current_step() < config["steps"]:
            optimizer.zero_grad()  # the quorum; a newcomer heals here
            step = manager.current_step()
            g = torch.Generator().manual_seed(step * 1000 + rank)  # this group's rows of the step
            x, y = torch.randn(ROWS, DIMS[0], generator=g), torch.randn(ROWS, DIMS[-1], generator=g)
            ((net(x) - y) ** 2).mean().backward()
            for work in [manager.allreduce(p.grad) for p in net.parameters()]:
                work.wait()
            optimizer.step()
            record = {
                "t": time.time(),
                "pid": os.getpid(),
                "group": rank,
                "step": step,
                "committed": manager.current_step() > step,
                "participants": manager.num_participants(),
            }
            log.write(json.dumps(record) + "\n")
            log.flush()
    manager.shutdown()


def _records(logdir: str) -> list[dict[str, Any]]:
    out = []
    for path in glob.glob(f"{logdir}/group*.jsonl"):
        with open(path) as f:
            out += [json.loads(line) for line in f if line.endswith("\n")]
    return sorted(out, key=lambda r: r["t"])


def _committed(records: list[dict[str, Any]]) -> int:
    """The step every group has committed (-1 until each has one)."""
    last: dict[int, int] = {}
    for r in records:
        if r["committed"]:
            last[r["group"]] = max(last.get(r["group"], -1), r["step"])
    return min(last.values()) if len(last) == GROUPS else -1


def _fault_report(
    records: list[dict[str, Any]], t: float, end: float, victim: int
) -> dict[str, Any]:
    """What one fault at time ``t`` (the next at ``end``) that took group ``victim``'s
    process cost: the survivors' longest gap between commits around it, their
    iterations not committed, whether any of them changed process, and the time until
    the victim's group committed from a new process."""
    before = [r for r in records if r["t"] < t]
    window = [r for r in records if t <= r["t"] < end]
    old = {r["group"]: r["pid"] for r in before}
    survivors = [r for r in window if r["group"] != victim]
    restarted = {r["group"] for r in survivors if r["pid"] != old.get(r["group"])}
    commits = [r["t"] for r in before if r["committed"] and r["group"] != victim][-1:]
    commits += [r["t"] for r in survivors if r["committed"]]
    failed = [r for r in survivors if not r["committed"]]
    healed = [
        r["t"]
        for r in window
        if r["group"] == victim and r["pid"] != old.get(victim) and r["committed"]
    ]
    return {
        "survivor_restarts": len(restarted),
        "stall_s": max((b - a for a, b in zip(commits, commits[1:], strict=False)), default=None),
        "survivor_uncommitted_iterations": len(failed),
        "dropped_rows": ROWS * len(failed),
        "heal_s": (healed[0] - t) if healed else None,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise SystemExit(
            "bench torchft: torchft is not installed: pip install -e '.[ft]'"
        ) from None
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2.torch.torchft_config import TorchftConfig

    from elastic_harness.localcluster import NODE_CPUS, RayCluster

    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "1"  # elastic's default
    lighthouse: dict[str, Any] = {"min_replicas": 1}
    for key in ("join_timeout_ms", "heartbeat_timeout_ms"):
        if getattr(args, key) is not None:
            lighthouse[key] = getattr(args, key)
    cluster = RayCluster(GROUPS + 1)  # one spare node
    faults: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-torchft-") as workdir:
        logdir = f"{workdir}/log"
        os.makedirs(logdir)
        try:
            ray.init(address=cluster.address)
            trainer = TorchTrainer(
                _train,
                train_loop_config={"dir": logdir, "steps": args.steps},
                scaling_config=ScalingConfig(
                    num_workers=GROUPS, resources_per_worker={"CPU": NODE_CPUS}
                ),
                torch_config=TorchftConfig(lighthouse_kwargs=lighthouse, backend="gloo"),
                run_config=RunConfig(
                    storage_path=f"{workdir}/storage",
                    name="torchft",
                    failure_config=FailureConfig(max_failures=10),  # a replacement each
                ),
            )
            result: dict[str, Any] = {}
            fit = threading.Thread(target=lambda: result.update(r=_fit(trainer)), daemon=True)
            fit.start()
            plan = [("worker_kill", 1), ("node_loss", 2)]
            for k, (fault, victim) in enumerate(plan):
                goal = (k + 1) * args.fault_every
                while _committed(_records(logdir)) < goal:
                    if not fit.is_alive():
                        raise SystemExit(f"bench torchft: the run ended before {fault}")
                    time.sleep(0.2)
                pid = next(r["pid"] for r in reversed(_records(logdir)) if r["group"] == victim)
                t = time.time()
                if fault == "worker_kill":
                    os.kill(pid, signal.SIGKILL)
                else:
                    cluster.remove_node(cluster.node_of_pid(pid))
                faults[fault] = {"time": t, "victim": victim}
                print(f"{fault}: group {victim} (pid {pid}) at committed step {goal}", flush=True)
            fit.join(timeout=900)
            records = _records(logdir)
        finally:
            ray.shutdown()
            cluster.shutdown()
    report: dict[str, Any] = {
        "finished": "r" in result and result["r"] is None,
        "error": result.get("r"),
        "lighthouse": lighthouse,
        "faults": {},
    }
    times = [f["time"] for f in faults.values()] + [float("inf")]
    for (fault, f), end in zip(faults.items(), times[1:], strict=False):
        report["faults"][fault] = _fault_report(records, f["time"], end, f["victim"])
        print(f"{fault}: {report['faults'][fault]}", flush=True)
    committed = [r for r in records if r["committed"]]
    group0 = [r["t"] for r in committed if r["group"] == 0]  # one group's commits
    steady = [b - a for a, b in zip(group0, group0[1:], strict=False)]
    report["participants_per_step"] = sorted({r["participants"] for r in committed})
    report["step_s_median"] = statistics.median(steady) if steady else None
    report["groups"] = GROUPS
    report["records"] = records  # every iteration of every group: the figures' source
    report["rows_per_group_step"] = ROWS
    return report


def _fit(trainer: Any) -> str | None:
    try:
        trainer.fit()
    except Exception as e:  # reported, not raised: the figures so far still count
        return f"{type(e).__name__}: {e}"
    return None
