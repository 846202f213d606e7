"""Rank processes for the tests that run DeepSpeed engines over gloo without Ray
(test_reshard, test_checkpoint, test_engine, test_timing).

A rank is forked from a fork server that has imported torch, DeepSpeed, torch's compiler
stack and elastic's engine and checkpoint code once for the whole test session
(``forkserver``, preloading :mod:`rank_preload`), not started as a fresh interpreter that
imports them all again (``spawn``: ~5 s of one core a rank here, before its work of a
fraction of a second). test_reshard starts 36 ranks: 141 s spawned, 8 s forked (full
suites from clean clones, 2026-12-06, this 2-core machine).

What a rank so started does not get: the test's environment of the moment. It has the
fork server's, from when that started (the session's first call), and its C library was
set up then. A test whose ranks must see a variable at their start (glibc's malloc
settings) spawns them instead (:func:`spawn_ranks`).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import socket
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    """A TCP port free on loopback now: the ranks' rendezvous (MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes forked from the fork server; wait
    for all (one that fails raises here, as ``torch.multiprocessing`` does)."""
    import torch.multiprocessing as mp

    _fork_server()
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def _fork_server() -> None:
    """Start the fork server unless it runs: a fresh interpreter that imports
    :mod:`rank_preload` (from this folder, put on its PYTHONPATH: Python's fork server
    takes no sys.path of ours, and skips a preload that does not import without a word).
    The ranks it forks inherit that PYTHONPATH; this process's is left as it was."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(["rank_preload"])
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, *([saved] if saved else [])])
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def spawn_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """:func:`start_ranks` in fresh interpreters that inherit this process's environment
    as it is now."""
    import torch.multiprocessing as mp

    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="spawn")
