"""``model.task=classification``: one integer class label a row, cross entropy,
accuracy."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from elastic.errors import ConfigError
from elastic.tasks.base import Task, register_task

if TYPE_CHECKING:
    import pyarrow as pa
    import torch


@register_task
class Classification(Task):
    name = "classification"
    description = "one class label a row (0..output_dim-1); loss: cross entropy; accuracy"

    def sums(self) -> int:
        return 1  # rows predicted right

    def check_model(self) -> None:
        if self.outputs < 2:
            raise ConfigError("model.output_dim must be >= 2 (classes) for classification")

    def classes(self) -> int:
        return self.outputs

    def target_shape(self) -> tuple[tuple[int, ...], Any]:
        return (), np.int64

    def check_target_type(self, field_type: pa.DataType, where: str) -> None:
        import pyarrow as pa

        if not pa.types.is_integer(field_type):
            raise ConfigError(
                f"model.task=classification needs one integer class label per row, but "
                f"{where} holds {field_type}: write integer labels, or set model.task"
            )

    def check_rows(self, y: np.ndarray, who: str) -> None:
        if y.ndim != 1:
            shape = "x".join(map(str, y.shape[1:]))
            raise ConfigError(
                f"{who} returns targets of shape {shape} a row, but "
                "task=classification takes one class label a row (y of shape [rows])"
            )

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        return F.cross_entropy(output, target.long(), reduction="none")

    def add_sums(self, sums: torch.Tensor, output: torch.Tensor, target: torch.Tensor) -> None:
        sums[0] += (output.argmax(dim=-1) == target.long()).sum()

    def read_sums(self, sums: torch.Tensor, rows: float) -> dict[str, float]:
        return {"accuracy": float(sums[0]) / rows}
