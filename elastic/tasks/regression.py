"""``model.task=regression``: ``output_dim`` values a row, mean squared error, R^2."""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic.errors import ConfigError
from elastic.tasks.base import Task, register_task

if TYPE_CHECKING:
    import pyarrow as pa
    import torch


def check_numbers(task: Task, field_type: pa.DataType, where: str, expected: int, what: str) -> int:
    """A target column of numbers, ``expected`` of them a row (``what`` they are, in
    words): the common check of the tasks that regress values. Returns the width."""
    import pyarrow as pa

    is_list = pa.types.is_fixed_size_list(field_type)
    value_type = field_type.value_type if is_list else field_type
    if not (pa.types.is_floating(value_type) or pa.types.is_integer(value_type)):
        raise ConfigError(f"model.task={task.name} needs numbers, but {where} holds {field_type}")
    width = field_type.list_size if is_list else 1
    if width != expected:
        raise ConfigError(
            f"{where} holds {width} target value(s) a row but model={task.model.name} "
            f"(task={task.name}, output_dim={task.outputs}) needs {expected} {what}: set "
            "model.output_dim to match the data"
        )
    return width


def add_r2_sums(sums: torch.Tensor, output: torch.Tensor, target: torch.Tensor) -> None:
    """Per regressed output: sum y, sum y^2, sum squared error (``sums`` holds 3 k)."""
    o = output.flatten(1) if output.dim() > 1 else output[:, None]
    y = target.double().reshape(o.shape)
    k = o.shape[1]
    sums[:k] += y.sum(0)
    sums[k : 2 * k] += (y * y).sum(0)
    sums[2 * k : 3 * k] += ((o - y) ** 2).sum(0)


def read_r2(sums: torch.Tensor, rows: float) -> float:
    """R^2 averaged over the regressed outputs (sklearn's "uniform_average")."""
    k = len(sums) // 3
    sy, syy, sse = sums[:k], sums[k : 2 * k], sums[2 * k :]
    sst = syy - sy * sy / rows
    return float((1 - sse / sst.clamp_min(1e-12)).mean())


@register_task
class Regression(Task):
    name = "regression"
    description = "output_dim values a row; loss: mean squared error; metric: R^2"

    def sums(self) -> int:
        return 3 * self.outputs

    def check_target_type(self, field_type: pa.DataType, where: str) -> None:
        import pyarrow as pa

        if pa.types.is_integer(field_type):
            raise ConfigError(
                f"model.task=regression but {where} holds integer labels ({field_type}): for "
                "classes set model.task=classification and model.output_dim to their number; "
                "to regress them write the column as floats"
            )
        check_numbers(self, field_type, where, self.outputs, "values")

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        target = target.reshape(output.shape).to(output.dtype)
        return (output - target).pow(2).mean(dim=tuple(range(1, output.dim())))

    def add_sums(self, sums: torch.Tensor, output: torch.Tensor, target: torch.Tensor) -> None:
        add_r2_sums(sums, output, target)

    def read_sums(self, sums: torch.Tensor, rows: float) -> dict[str, float]:
        return {"r2": read_r2(sums, rows)}
