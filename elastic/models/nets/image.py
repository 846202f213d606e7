"""What the image model families' networks (ResNet, ViT) share: input scaling (their
config base is :class:`~elastic.models.base.ImageModelConfig`)."""

from __future__ import annotations

import torch
from torch import nn


class LogIntensity(nn.Module):
    """x (normalised to sum 1 per image) -> log(1 + x * H * W): mean pixel at log 2."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log1p(x * (x.shape[-1] * x.shape[-2]))
