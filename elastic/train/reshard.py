"""A ZeRO 1-3 checkpoint written at one world size, made loadable at another: its
DeepSpeed universal form (``ds_to_universal``), made once for the worker group, by the
whole group.

DeepSpeed's converter works in two passes that split by item: it extracts each saved
rank's optimizer partitions into per-parameter fragments, then merges each parameter's
fragments into whole tensors; the rest (common optimizer state, the model-state files,
a pointer file) is small. Here every rank of the group takes its share of each pass's
items (rank r: items r, r + N, ... in the order of their names), the ranks exchange the
passes' results, and rank 0
alone writes the rest, all into one folder in the run's staging folder. Before, every
rank converted the whole checkpoint on its own: N times the reads and writes of the
whole state on the shared filesystem per resize, and, where ranks share cores, N times
the time; one rank alone took 78 s for 300M parameters here (``bench.py scale``), a
time that grows with the model whatever the world size. Split N ways, the passes take
1/N of it.

A group whose ranks do not all see rank 0's folder (storage that is not shared) falls
back to a whole conversion on each rank, as before.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from elastic.errors import CheckpointError
from elastic.train.integrity import DS_TAG, STAGING_DIR

PASSES = 2  # DeepSpeed's parallel passes: extract, then merge (ds_to_universal.main)


class _PartDone(Exception):
    """A rank other than 0 has done its share of both passes: rank 0 finishes."""


def _converter_args(path: str, out: str) -> argparse.Namespace:
    return argparse.Namespace(
        input_folder=os.path.join(path, DS_TAG),
        output_folder=os.path.join(out, DS_TAG),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # stages 1 and 2 lack the info the converter needs
    )


def _fresh_folder(path: str) -> str:
    """A new folder for a universal form, in the staging folder beside ``path``."""
    staging = os.path.join(os.path.dirname(os.path.abspath(path)), STAGING_DIR)
    os.makedirs(staging, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"universal-p{os.getpid()}-", dir=staging)


def _convert(path: str, out: str) -> None:
    from deepspeed.checkpoint import ds_to_universal

    # the converter prints and draws progress bars: keep the run's log readable
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal.main(_converter_args(path, out))


def to_universal(path: str) -> str:
    """Convert the DeepSpeed checkpoint in ``path`` whole, in this process, into a fresh
    folder under the run's staging folder (the checkpoint itself is never modified; the
    caller removes the folder)."""
    out = _fresh_folder(path)
    _convert(path, out)
    return out


@contextlib.contextmanager
def _shared_passes(rank: int, world: int) -> Iterator[None]:
    """Inside, DeepSpeed's converter runs this rank's share of its parallel passes and
    gathers every rank's results; a rank other than 0 stops after the last pass
    (:class:`_PartDone`). An error in a rank's share reaches every rank (none waits
    for a rank that failed)."""
    import torch.distributed as dist
    from deepspeed.checkpoint import ds_to_universal

    original = getattr(ds_to_universal, "_do_parallel_work", None)
    if original is None:
        raise RuntimeError(
            "deepspeed.checkpoint.ds_to_universal._do_parallel_work is gone: update "
            "elastic.train.reshard for this DeepSpeed"
        )
    passes = 0

    def shared(do_work: Callable[[Any], Any], chunks: list[Any], workers: int) -> list[Any]:
        nonlocal passes
        # The converter lists some passes' items from sets of names, whose order differs
        # from process to process (string hashing): items are dealt by their sorted
        # names, the same on every rank, and results matched back by name.
        names = [repr(c) for c in chunks]
        if len(set(names)) != len(names):
            raise CheckpointError(f"the converter's items are not unique by name: {names}")
        by_name = dict(zip(names, chunks, strict=True))
        mine: dict[str, Any] = {}
        error = None
        try:
            for name in sorted(names)[rank::world]:
                mine[name] = do_work(by_name[name])
        except Exception as e:
            error = f"rank {rank}: {type(e).__name__}: {e}"
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, (mine, error))
        failed = [err for _, err in everyone if err]
        if failed:
            raise CheckpointError(f"converting a checkpoint to this world size failed: {failed[0]}")
        results = {name: r for part, _ in everyone for name, r in part.items()}
        passes += 1
        if passes == PASSES and rank != 0:
            raise _PartDone
        return [results[name] for name in names]

    ds_to_universal._do_parallel_work = shared
    try:
        yield
    finally:
        ds_to_universal._do_parallel_work = original


def shared_universal(path: str, rank: int, world: int) -> tuple[str, bool]:
    """The universal form of the checkpoint in ``path``, made by the whole worker group
    into one folder (see the module docstring; a collective: every rank calls it).
    Returns (the folder, whether this rank made it: that rank removes it)."""
    import torch.distributed as dist

    made: list[Any] = [_fresh_folder(path) if rank == 0 else None]
    dist.broadcast_object_list(made, src=0)
    out = str(made[0])
    seen: list[Any] = [None] * world
    dist.all_gather_object(seen, os.path.isdir(out))
    if not all(seen):  # not one filesystem: each rank converts the whole on its own
        return to_universal(path), True
    failed: Exception | None = None
    try:
        with _shared_passes(rank, world):
            _convert(path, out)
    except _PartDone:
        pass
    except Exception as e:  # told to every rank below, then raised here
        failed = e
    outcome: list[Any] = [None if failed is None else f"{type(failed).__name__}: {failed}"]
    dist.broadcast_object_list(outcome, src=0)  # rank 0 has finished the rest
    if failed is not None:
        raise failed
    if outcome[0] is not None:
        raise CheckpointError(
            f"checkpoint {path}: converting it to this world size failed on rank 0 ({outcome[0]})"
        )
    return out, rank == 0
