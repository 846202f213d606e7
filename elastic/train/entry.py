"""The worker entry as Ray Train holds it (:func:`train_loop`), importing no torch.

Ray Train's controller process unpickles the training function and its config (a
:class:`~elastic.train.worker_args.WorkerArgs`) when it starts, before it asks for any
worker: the modules they live in are imported there, and one that imports torch costs
~2.4 CPU s of every run's start, for nothing. The work itself is
:func:`elastic.train.loop.run`, imported in the workers only (``tests/test_imports.py``
checks that unpickling these imports no torch).
"""

from __future__ import annotations

from typing import Any


def train_loop(config: dict[str, Any]) -> None:
    """What every Ray Train worker runs (``config["args"]``: its WorkerArgs)."""
    from elastic.train.loop import run

    run(config)
