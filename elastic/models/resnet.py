"""A ResNet for images, or flat rows reshaped to images (``model=resnet``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from elastic.models.base import ImageModelConfig

if TYPE_CHECKING:
    from torch import nn


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
        from elastic.models.nets.resnet import resnet

        return resnet(
            in_channels=self.in_channels,
            widths=list(self.widths),
            blocks_per_stage=self.blocks_per_stage,
            output_dim=self.output_dim,
            input_size=self.input_size,
            log_input=self.log_input,
        )
