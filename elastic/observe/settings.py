"""The ``logger.*`` section of the config: where the run's metrics go (W&B or only
metrics.jsonl). The config package composes it into the whole."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from elastic.fields import one_of


@dataclass
class LoggerConfig:
    kind: str = one_of(Literal["wandb", "none"], "wandb")
    project: str = "elastic"
    entity: str | None = None
    mode: str = one_of(Literal["auto", "online", "offline"], "auto")
    """auto: online when a W&B key is configured, else offline."""
