"""The network of ``model=resnet`` (:class:`~elastic.models.resnet.ResNetConfig`)."""

from __future__ import annotations

import torch
from torch import nn

from elastic.models.nets.image import LogIntensity


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


def resnet(
    *,
    in_channels: int,
    widths: list[int],
    blocks_per_stage: int,
    output_dim: int,
    input_size: int,
    log_input: bool,
) -> nn.Module:
    """A 3x3 stem, one stage of ``blocks_per_stage`` blocks per width (each after the
    first halves the resolution), global average pooling, a linear head; flat rows
    reshaped to ``in_channels`` x ``input_size`` x ``input_size`` when ``input_size``."""
    layers: list[nn.Module] = []
    if input_size:
        layers.append(nn.Unflatten(1, (in_channels, input_size, input_size)))
    if log_input:
        layers.append(LogIntensity())
    layers += [
        nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False),
        nn.GroupNorm(min(8, widths[0]), widths[0]),
        nn.ReLU(inplace=True),
    ]
    c = widths[0]
    for i, w in enumerate(widths):
        for b in range(blocks_per_stage):
            layers.append(_Block(c, w, 2 if (i > 0 and b == 0) else 1))
            c = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, output_dim)]
    return nn.Sequential(*layers)
