"""What the image model families (ResNet, ViT) share: config checks and input scaling."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from elastic.errors import ConfigError
from elastic.models.losses import TASKS


def check_image_model(m: Any) -> None:
    """What the image models share: task, outputs, classes, channels, flat input side."""
    if m.task not in TASKS:
        raise ConfigError(f"model.task={m.task!r} is not valid: use one of {TASKS}")
    if m.in_channels < 1 or m.output_dim < 1:
        raise ConfigError("model.in_channels and model.output_dim must be >= 1")
    if m.task == "classification" and m.output_dim < 2:
        raise ConfigError("model.output_dim must be >= 2 (classes) for classification")
    if m.task == "multitask" and not 2 <= m.classes < m.output_dim:
        raise ConfigError(
            f"model.classes={m.classes} with model.output_dim={m.output_dim} is not "
            "valid for multitask: classes >= 2 and output_dim = classes + regression outputs"
        )
    if m.input_size < 0:
        raise ConfigError(f"model.input_size={m.input_size} is not valid: use 0 or >= 4")


class LogIntensity(nn.Module):
    """x (normalised to sum 1 per image) -> log(1 + x * H * W): mean pixel at log 2."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log1p(x * (x.shape[-1] * x.shape[-2]))
