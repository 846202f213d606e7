"""A ResNet for images, or flat rows reshaped to images (``model=resnet``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from elastic.models.base import ImageModelConfig
from elastic.models.image import LogIntensity


class _Block(nn.Module):
    """A ResNet basic block (two 3x3 convs); GroupNorm, not BatchNorm: no running
    statistics that depend on the per-worker batch (the world size changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False),
            nn.GroupNorm(min(8, c_out), c_out),
            nn.ReLU(inplace=True),
            nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False),
            nn.GroupNorm(min(8, c_out), c_out),
        )
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.skip = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.GroupNorm(min(8, c_out), c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


@dataclass
class ResNetConfig(ImageModelConfig):
    """A small ResNet on [N, C, H, W] images: a 3x3 stem, one stage per width (each
    after the first halves the resolution), global average pooling, a linear head."""

    name: str = "resnet"
    in_channels: int = 1
    widths: list[int] = field(default_factory=lambda: [16, 32, 64])
    blocks_per_stage: int = 1
    output_dim: int = 10
    """Classes (classification), outputs (regression), or classes + outputs (multitask)."""
    task: str = "classification"
    classes: int = 0
    """multitask: how many of the outputs are class logits."""
    input_size: int = 0
    """Flat array inputs (data.format=array) of in_channels x input_size x input_size
    values are reshaped to images; 0 = the data are images already."""
    log_input: bool = False
    """Feed log(1 + x * H * W): for intensities normalised to sum 1 (diffraction
    patterns), whose dynamic range spans decades."""

    def validate(self) -> None:
        from elastic.errors import ConfigError

        super().validate()
        if self.blocks_per_stage < 1:
            raise ConfigError(f"model.blocks_per_stage={self.blocks_per_stage}: must be >= 1")
        if not self.widths or any(w < 1 for w in self.widths):
            raise ConfigError(f"model.widths={self.widths} is not valid: one or more, all >= 1")

    def build(self) -> nn.Module:
        layers: list[nn.Module] = []
        if self.input_size:
            layers.append(nn.Unflatten(1, (self.in_channels, self.input_size, self.input_size)))
        if self.log_input:
            layers.append(LogIntensity())
        layers += [
            nn.Conv2d(self.in_channels, self.widths[0], 3, 1, 1, bias=False),
            nn.GroupNorm(min(8, self.widths[0]), self.widths[0]),
            nn.ReLU(inplace=True),
        ]
        c = self.widths[0]
        for i, w in enumerate(self.widths):
            for b in range(self.blocks_per_stage):
                layers.append(_Block(c, w, 2 if (i > 0 and b == 0) else 1))
                c = w
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, self.output_dim)]
        return nn.Sequential(*layers)
