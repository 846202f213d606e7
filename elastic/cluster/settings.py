"""The ``scaling.*`` and ``cluster.*`` sections of the config: the workers a run asks
for and where they go, and the Ray cluster it runs on (the config package composes
them into the whole)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from elastic.errors import ConfigError
from elastic.fields import one_of, positive


@dataclass
class ScalingConfig:
    min_workers: int = 2
    max_workers: int = 2
    """min < max is elastic: Ray Train runs as many workers as the cluster holds, shrinks
    when a node dies and grows when one joins (restarting from the latest checkpoint)."""
    workers: int | None = None
    """Set: a fixed world size, min_workers = max_workers = workers (for a scaling
    sweep: ``-m scaling.workers=1,2,4``)."""
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    placement_strategy: str = one_of(
        Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"], "PACK"
    )
    """How workers are placed on nodes (Ray placement group strategy): PACK fills a node
    first, SPREAD puts them on as many nodes as it can (one worker per node on a batch
    allocation), STRICT_PACK / STRICT_SPREAD insist."""
    max_failures: int = 10
    """Worker/node failures to recover from (Ray's FailureConfig); -1 = no limit.
    Preemptions (node drains) are not counted against it."""
    resize_interval_s: float = 10.0
    """How often a healthy elastic run checks whether more workers fit (Ray default 60)."""
    start_timeout_s: float = 5.0
    """Give up on starting a worker group after this long and retry at the size the
    cluster now holds (Ray default 60: a dead node's workers are waited for that long)."""
    placement_timeout_s: float = 600.0
    """End the run (one line, naming what the nodes offer) when no worker group has been
    up for this long while one is being started: nodes gone below scaling.min_workers,
    or a placement the cluster cannot give (Ray Train would retry forever). 0 = wait
    as long as it takes (for nodes that are yet to join)."""
    health_check_interval_s: float = 1.0
    """Controller polls of the workers (Ray default 2)."""
    worker_health_check_timeout_s: float = 60.0
    """A worker whose health check hangs this long is dead (Ray default 600)."""
    node_refresh_s: float = 2.0
    """How often the node view Ray Train sizes elastic groups from is refreshed (Ray Data's
    autoscaling coordinator; Ray default 20): a dead node stops being asked for, and a
    new node is used, within this."""
    drain_poll_interval_s: float = 1.0
    """How often Ray Train looks for drained (preempted) nodes (Ray default 5); a drain
    makes the run checkpoint at once."""
    live: bool = False
    """Live recovery: a dead worker costs the others the step in flight, not a restart.
    Each worker is a replica group of its own; the survivors compute that step again
    over the same global batch, Ray Train starts a worker in the dead one's place, and
    it copies its state from a survivor's memory (docs/elastic.md#live-recovery). For
    now: fp32 ZeRO-0 on CPU (gloo); a node lost with no room for its workers restarts
    from the last checkpoint as before."""

    def validate(self) -> None:
        """scaling.workers is resolved (and checked) before, by
        :func:`elastic.config.validate.to_typed`."""
        if self.min_workers < 1:
            raise ConfigError(
                f"scaling.min_workers={self.min_workers} is not valid: it must be >= 1"
            )
        if self.min_workers > self.max_workers:
            raise ConfigError(
                f"scaling.min_workers={self.min_workers} > scaling.max_workers="
                f"{self.max_workers}: set min_workers <= max_workers (to sweep fixed world "
                "sizes: -m scaling.workers=1,2)"
            )
        positive("scaling.cpus_per_worker", self.cpus_per_worker)
        if self.max_failures < -1:
            raise ConfigError(
                f"scaling.max_failures={self.max_failures}: use -1 (no limit) or >= 0"
            )
        if self.live and self.max_failures == 0:
            raise ConfigError(
                "scaling.live=true with scaling.max_failures=0: Ray Train replaces a dead "
                "worker only while failures are allowed; set max_failures > 0 or -1"
            )
        if self.live and self.use_gpu:
            raise ConfigError(
                "scaling.live=true with scaling.use_gpu=true: live recovery runs on gloo "
                "(CPU) for now; set scaling.live=false to train on GPUs"
            )
        positive("scaling.placement_timeout_s", self.placement_timeout_s, allow_zero=True)
        for key in (
            "resize_interval_s",
            "start_timeout_s",
            "health_check_interval_s",
            "worker_health_check_timeout_s",
            "drain_poll_interval_s",
            "node_refresh_s",
        ):
            positive(f"scaling.{key}", getattr(self, key))

    def ray_env(self) -> dict[str, str]:
        """Ray Train's recovery knobs, as the environment its controller reads."""
        return {
            "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(self.start_timeout_s),
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(self.health_check_interval_s),
            "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S": str(self.worker_health_check_timeout_s),
            "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": str(self.drain_poll_interval_s),
        }


# Ray refuses a smaller object store (ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES)
OBJECT_STORE_MINIMUM_MB = 75


@dataclass
class ClusterConfig:
    address: str = ""
    """Empty: start an embedded local Ray cluster. Else the head's explicit address
    (``host:port`` of its GCS, as the bootstrap exports it)."""
    connect_timeout_s: float = 60.0
    """How long an explicit ``address`` may take to answer before the run ends, in one
    line (Ray itself retries for minutes without a word)."""
    num_cpus: int | None = None
    """CPUs for the embedded cluster (null = all of this machine's)."""
    object_store_memory_mb: int = 512

    def validate(self) -> None:
        """Whether the embedded cluster can hold the workers is
        :func:`elastic.config.validate.validate`'s (it needs scaling)."""
        if self.object_store_memory_mb < OBJECT_STORE_MINIMUM_MB:
            raise ConfigError(
                f"cluster.object_store_memory_mb={self.object_store_memory_mb} is not valid: "
                f"Ray needs at least {OBJECT_STORE_MINIMUM_MB}"
            )
        positive("cluster.connect_timeout_s", self.connect_timeout_s)
        if self.address and not host_port(self.address):
            raise ConfigError(
                f"cluster.address={self.address!r} is not valid: use HOST:PORT of the head's "
                "GCS (e.g. 10.0.0.1:6379), or leave it empty for an embedded local cluster"
            )


def host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of ``HOST:PORT`` (``ray://`` allowed, IPv6 in brackets), else None."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)
