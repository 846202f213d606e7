"""The workers' torch process group, set up without torch in Ray Train's controller, and
with its rendezvous store on loopback when the whole Ray cluster is on loopback.

Ray Train's ``TorchConfig`` and its backend import torch where they are defined, and the
controller process unpickles the run's backend config as it starts: ~2.4 CPU s of its
start, on the way of every run's first worker. :class:`ProcessGroupConfig` is the same
set-up from a module that imports torch only inside the workers: the controller asks rank
0 for an address and port, then every rank sets Ray Train's ``LOCAL_RANK`` & co. and joins
the group through Ray Train's own worker-side functions (``ray_internals.torch_worker``),
and at the end leaves it as Ray Train does.

Loopback: rank 0 would host torch's TCPStore on every interface whatever address it is
given, so any machine that reaches this one could join the process group (it accepts
unauthenticated clients). When the cluster is on loopback, rank 0 serves the store from a
socket bound to 127.0.0.1 and every rank joins it there.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray
from ray.train.backend import Backend, BackendConfig

from elastic.cluster import ray_internals
from elastic.cluster.connect import LOOPBACK

log = logging.getLogger(__name__)

# rank 0's store and its listening socket, alive as long as this worker process
_served: list[Any] = []


@dataclass
class ProcessGroupConfig(BackendConfig):
    """Ray Train's ``TorchConfig`` (``backend``, ``timeout_s``; ``init_method`` env) for
    ``TorchTrainer(torch_config=...)``, importing no torch where it is unpickled."""

    backend: str = "gloo"
    timeout_s: int = 1800
    loopback: bool = False
    """Serve the rendezvous store on 127.0.0.1 (the cluster is on loopback)."""
    live: bool = False
    """``scaling.live``: each worker a replica group of its own (Ray Train replaces a
    dead one alone); the workers make their process groups themselves, one a quorum
    (:mod:`elastic.train.quorum`)."""

    @property
    def backend_cls(self) -> type:
        return _LiveBackend if self.live else _ProcessGroupBackend

    @property
    def train_func_context(self) -> type:
        return _DeviceContext

    @property
    def framework(self) -> Any:
        return ray_internals.torch_framework()

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


def torch_config(use_gpu: bool, live: bool = False) -> ProcessGroupConfig:
    return ProcessGroupConfig(
        backend="nccl" if use_gpu else "gloo",
        loopback=ray.util.get_node_ip_address() == LOOPBACK,
        live=live,
    )


def serve_quorum_store() -> tuple[tuple[str, int], Any]:
    """The driver's side of a live run: the store every quorum's process group meets in
    (it outlives any worker), bound to this node's address (loopback on a loopback
    cluster), not every interface. ((host, port), the store: keep it referenced for
    the run)."""
    import torch.distributed as dist

    host = ray.util.get_node_ip_address()
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.bind((host, 0))
    sock.listen(128)
    port = int(sock.getsockname()[1])
    store = dist.TCPStore(
        host,
        port,
        is_master=True,
        timeout=timedelta(seconds=60),
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
    )
    return (host, port), (sock, store)


class _LiveBackend(Backend):
    """Ray Train's replica-group mode: a dead worker is replaced alone, the others keep
    running. Nothing to set up here: each worker joins its quorum itself."""

    share_cuda_visible_devices = True
    has_replica_groups = True


class _ProcessGroupBackend(Backend):
    share_cuda_visible_devices = True  # as Ray Train's torch backend

    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        c: ProcessGroupConfig = backend_config
        n = len(worker_group)
        if c.loopback:
            addr, port = LOOPBACK, worker_group.execute_single(0, _serve_store, n, c.timeout_s)
        else:
            addr, port = worker_group.execute_single(0, ray_internals.address_and_port())
        ray.get(
            [
                worker_group.execute_single_async(
                    rank, _join, c.backend, rank, n, addr, port, c.timeout_s, c.loopback
                )
                for rank in range(n)
            ]
        )

    def on_shutdown(self, worker_group: Any, backend_config: Any) -> None:
        futures = worker_group.execute_async(_leave, len(worker_group) > 1)
        timeout_s = ray_internals.process_group_shutdown_timeout_s()
        try:
            ray.get(futures, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            log.warning("torch process group shutdown timed out after %s s", timeout_s)


class _DeviceContext:
    """Around the training function on each worker: Ray Train's (the worker's CUDA
    device, when it has one)."""

    def __enter__(self) -> None:
        self._inner = ray_internals.torch_worker().context()
        self._inner.__enter__()

    def __exit__(self, *exc: Any) -> bool:
        return bool(self._inner.__exit__(*exc))


def _serve_store(world_size: int, timeout_s: int) -> int:
    import torch.distributed as dist

    sock = socket.socket()
    sock.bind((LOOPBACK, 0))
    sock.listen(128)
    store = dist.TCPStore(
        LOOPBACK,
        sock.getsockname()[1],
        world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
    )
    _served[:] = [sock, store]
    return int(sock.getsockname()[1])


def _join(
    backend: str, rank: int, world_size: int, addr: str, port: int, timeout_s: int, loopback: bool
) -> None:
    """On each worker: Ray Train's environment (LOCAL_RANK & co.), then the group."""
    worker = ray_internals.torch_worker()
    worker.set_env()
    if not loopback:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
        worker.setup(backend, rank, world_size, "env://", timeout_s)
        return
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = (
        _served[1]
        if rank == 0
        else dist.TCPStore(LOOPBACK, port, world_size, is_master=False, timeout=timeout)
    )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _leave(destroy: bool) -> None:
    ray_internals.torch_worker().shutdown(destroy)
