"""What every worker of a run gets from the driver (:class:`WorkerArgs`), importing no
torch: Ray Train's controller unpickles it too (see :mod:`elastic.train.entry`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elastic.config.schema import TrainConfig
from elastic.data.order import Layout


@dataclass
class WorkerArgs:
    """What every worker of a run gets from the driver (Ray Train passes it in the
    ``train_loop_config`` dict, under ``"args"``)."""

    cfg: TrainConfig
    config_dict: dict[str, Any]
    """The resolved config as plain data, for W&B."""
    run_dir: str
    train_files: list[str]
    layout: Layout
    """The train split's row groups: what every global batch is planned on."""
    data_record: dict[str, Any]
    """What the checkpoints keep of the data (:func:`elastic.data.reader.data_record`)."""
    cache_train: bool
    """The decoded train split fits ``data.cache_mb``: each row group read once a worker."""
    train_rows: int
    empty: dict[str, Any] = field(default_factory=dict)
    """A batch of no rows with the decoded rows' shapes and dtypes (the driver's
    :func:`~elastic.config.probe.probe`): what a rank with no rows of a step trains on."""
    val_files: list[str] = field(default_factory=list)
    """The validation split's shards (each worker reads its share: stream.val_blocks)."""
    resume_from: str | None = None
    """The checkpoint to resume from while Ray Train has none to hand out (its list of
    the run's checkpoints was missing or unreadable: ``integrity.prepare_resume``)."""
    control: Any = None
    """The run's control actor (stop requests, fatal errors, progress)."""
    quorum_store: tuple[str, int, str] | None = None
    """``scaling.live``: (host, port, this fit's key prefix) of the store the driver
    serves for the quorums' process groups (:mod:`elastic.train.quorum`)."""
