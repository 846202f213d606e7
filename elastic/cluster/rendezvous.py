"""The workers' torch process group, with its rendezvous store on loopback when the
whole Ray cluster is on loopback (the embedded local cluster).

Rank 0 hosts torch's TCPStore, which listens on every interface whatever address it is
given: any machine that reaches this one could join the process group (it accepts
unauthenticated clients). Ray Train's torch set-up is kept, except that rank 0 serves the
store from a socket bound to 127.0.0.1 and every rank joins it there.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import ray
import torch.distributed as dist
from ray.train.torch import TorchConfig

from elastic.cluster.connect import LOOPBACK
from elastic.cluster.ray_internals import torch_backend

_TorchBackend: Any
_TorchBackend, _set_torch_distributed_env_vars = torch_backend()

# rank 0's store and its listening socket, alive as long as this worker process
_served: list[Any] = []


def torch_config(use_gpu: bool) -> TorchConfig:
    backend = "nccl" if use_gpu else "gloo"
    if ray.util.get_node_ip_address() == LOOPBACK:
        return LoopbackTorchConfig(backend=backend)
    return TorchConfig(backend=backend)


class LoopbackTorchConfig(TorchConfig):
    @property
    def backend_cls(self) -> type:
        return _LoopbackBackend


class _LoopbackBackend(_TorchBackend):
    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        n = len(worker_group)
        port = worker_group.execute_single(0, _serve_store, n, backend_config.timeout_s)
        worker_group.execute(_set_torch_distributed_env_vars)  # LOCAL_RANK & co.
        ray.get(
            [
                worker_group.execute_single_async(
                    rank, _join, backend_config.backend, rank, n, port, backend_config.timeout_s
                )
                for rank in range(n)
            ]
        )


def _serve_store(world_size: int, timeout_s: int) -> int:
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
    return sock.getsockname()[1]


def _join(backend: str, rank: int, world_size: int, port: int, timeout_s: int) -> None:
    timeout = timedelta(seconds=timeout_s)
    store = (
        _served[1]
        if rank == 0
        else dist.TCPStore(LOOPBACK, port, world_size, is_master=False, timeout=timeout)
    )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
