"""``model.task=multitask``: a class and regressed values a row. The target is
``[class, r_1, ..., r_k]``; the model's first ``classes`` outputs are class logits, the
other ``output_dim - classes`` regress r_1..r_k. Loss: cross entropy + mean squared
error; metrics: accuracy and R^2."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from elastic.errors import ConfigError
from elastic.tasks.base import Task, register_task
from elastic.tasks.regression import add_r2_sums, check_numbers, read_r2

if TYPE_CHECKING:
    import pyarrow as pa
    import torch


@register_task
class Multitask(Task):
    name = "multitask"
    description = "[class, values...] a row; loss: cross entropy + mean squared error"

    def sums(self) -> int:
        return 1 + 3 * (self.outputs - self.model.classes)  # rows right, then R^2's

    def check_model(self) -> None:
        # here, not at the top: elastic.models imports torch, which no read task needs
        from elastic.models.base import ModelConfig

        m = self.model
        if type(m).classes is ModelConfig.classes:  # the family has no model.classes key
            raise ConfigError(
                f"model.task=multitask needs a model family with model.classes (the class "
                f"logits among its outputs), which model={m.name} does not have: use "
                "model=resnet or model=vit, or another task"
            )
        if not 2 <= m.classes < m.output_dim:
            raise ConfigError(
                f"model.classes={m.classes} with model.output_dim={m.output_dim} is not "
                "valid for multitask: classes >= 2 and output_dim = classes + regression outputs"
            )

    def classes(self) -> int:
        return self.model.classes

    def label_fix(self, high: int) -> str:
        return f"set model.classes={high + 1}"

    def target_shape(self) -> tuple[tuple[int, ...], Any]:
        return (self.outputs - self.model.classes + 1,), np.float32

    def check_target_type(self, field_type: pa.DataType, where: str) -> None:
        expected = self.outputs - self.model.classes + 1
        check_numbers(self, field_type, where, expected, "[class, regressed values...]")

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        c = self.model.classes
        ce = F.cross_entropy(output[:, :c], target[:, 0].long(), reduction="none")
        err = output[:, c:] - target[:, 1:].to(output.dtype)
        return ce + err.pow(2).mean(dim=1)

    def add_sums(self, sums: torch.Tensor, output: torch.Tensor, target: torch.Tensor) -> None:
        c = self.model.classes
        sums[0] += (output[:, :c].argmax(dim=-1) == target[:, 0].long()).sum()
        add_r2_sums(sums[1:], output[:, c:], target[:, 1:])

    def read_sums(self, sums: torch.Tensor, rows: float) -> dict[str, float]:
        return {"accuracy": float(sums[0]) / rows, "r2": read_r2(sums[1:], rows)}
