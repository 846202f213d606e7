"""The :class:`Task` interface, its registry and the validation sums every task shares."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from elastic.errors import ConfigError
from elastic.registry import Registry

if TYPE_CHECKING:
    import pyarrow as pa
    import torch

    from elastic.models.base import ModelConfig


class Task:
    """What a model is trained to do: its targets, its per-sample loss, its metrics.

    One class per task, registered under :attr:`name`; an instance serves one model
    config (``task_of(model)``), whose ``output_dim`` (and ``classes``, where the task
    has them) it reads. Everything a task says about targets is checked before Ray
    starts: the target column's type in the shards' footers
    (:meth:`check_target_type`), the decoded rows (:meth:`target_shape`,
    :meth:`check_rows`), class labels by value (:meth:`classes`); in training only a
    label out of range in shards without statistics is left to find (a DataError)."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    target_is_input: ClassVar[bool] = False
    """The model reconstructs its input (an autoencoder): no target column is read."""

    def __init__(self, model: ModelConfig) -> None:
        self.model = model

    @property
    def outputs(self) -> int:
        return self.model.output_dim

    # -- the model --------------------------------------------------------------------
    def check_model(self) -> None:
        """Config errors of this task with the model's keys (raise ConfigError)."""

    # -- targets ----------------------------------------------------------------------
    def classes(self) -> int:
        """How many classes a row's (first) target value names: labels in 0..n-1, checked
        by value before Ray starts and at every step. 0: no class labels."""
        return 0

    def target_shape(self) -> tuple[tuple[int, ...], Any] | None:
        """One row's target as decoded (shape, dtype); for the shape only its number of
        values is checked (a target of one value may be a scalar). None: not checked."""
        return (self.outputs,), np.float32

    def check_target_type(self, field_type: pa.DataType, where: str) -> None:
        """The target column's Arrow type (``where`` names column and path), from the
        shards' footers: a mismatch would otherwise fail at the first step."""

    def check_rows(self, y: np.ndarray, who: str) -> None:
        """Decoded targets (``who`` names the decoder) against the task, before Ray."""

    def bad_labels(self, target: np.ndarray) -> np.ndarray:
        """Which rows' class labels the task cannot use (the loss would raise, or index
        past the model's outputs): not an integer in 0..classes-1. A bool mask over the
        rows (all False for tasks without class labels)."""
        n = self.classes()
        if not n:
            return np.zeros(len(target), bool)
        labels = target[:, 0] if target.ndim > 1 else target  # [class, values...]
        bad = (labels < 0) | (labels >= n)
        if labels.dtype.kind == "f":
            bad |= labels != np.floor(labels)  # nan too
        return bad

    def label_range(self) -> str:
        """The labels the task takes, in words."""
        return f"classes 0..{self.classes() - 1}"

    def label_fix(self, high: int) -> str:
        """What to set when the data hold labels up to ``high``."""
        return f"set model.output_dim={high + 1}"

    # -- training ---------------------------------------------------------------------
    def losses(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss of every row (no reduction): the loop weights them so uneven or
        partial batches still give the exact mean over a global step's rows. The target
        is the input where :attr:`target_is_input`."""
        raise NotImplementedError

    # -- validation -------------------------------------------------------------------
    def sums(self) -> int:
        """How many additive validation statistics :meth:`add_sums` keeps (beyond the
        rows and the loss sum, which every task has)."""
        return 0

    def add_sums(self, sums: torch.Tensor, output: torch.Tensor, target: torch.Tensor) -> None:
        """Add one batch's statistics to ``sums`` (:meth:`sums` float64 values, summed
        over batches and ranks): ``output`` float64, ``target`` as decoded."""

    def read_sums(self, sums: torch.Tensor, rows: float) -> dict[str, float]:
        """Metrics from the summed statistics over ``rows`` rows."""
        return {}


TASKS: Registry[type[Task]] = Registry("task", "model.task")


def register_task(task: type[Task]) -> type[Task]:
    """Make the :class:`Task` subclass ``task`` the task ``model.task=<its name>`` (a
    plugin's task). Usable as a class decorator."""
    if not (isinstance(task, type) and issubclass(task, Task)) or not task.name:
        raise TypeError(f"{task!r} is not a Task subclass with a name")
    return TASKS.add(task.name, task)


def task_of(model: ModelConfig) -> Task:
    """The task of ``model`` (its ``model.task``), or a ConfigError naming the known ones."""
    name = model.task
    if name not in TASKS:
        from elastic.plugins import load_plugins

        load_plugins()
    if name not in TASKS:
        raise ConfigError(
            f"model.task={name!r} is not valid: use one of {', '.join(sorted(TASKS))}, or "
            "register your own (README 'Your own task')"
        )
    return TASKS[name](model)


class MetricSums:
    """A task's validation statistics over batches: rows, loss sum, then the task's own
    sums (:meth:`Task.add_sums`). All-reduce :attr:`sums`, then read metrics off it."""

    def __init__(self, task: Task) -> None:
        import torch

        self.task = task
        self.sums = torch.zeros(2 + task.sums(), dtype=torch.float64)

    def add(self, output: torch.Tensor, target: torch.Tensor, losses: torch.Tensor) -> None:
        self.sums[0] += losses.shape[0]
        self.sums[1] += losses.detach().double().sum()
        self.task.add_sums(self.sums[2:], output.detach().double(), target)

    def metrics(self) -> dict[str, float]:
        n = float(self.sums[0])
        if n == 0:
            return {}
        return {
            "loss": float(self.sums[1]) / n,
            "samples": n,
            **self.task.read_sums(self.sums[2:], n),
        }
