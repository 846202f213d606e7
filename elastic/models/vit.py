"""A Vision Transformer (``model=vit``): patches, class token, pre-norm blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from elastic.models.base import ImageModelConfig

if TYPE_CHECKING:
    from torch import nn


@dataclass
class ViTConfig(ImageModelConfig):
    """A Vision Transformer on [N, C, H, W] images (or flat rows of them): non-overlapping
    patches, a class token, pre-norm encoder blocks, a linear head on the class token.
    The default is small enough for a CPU run; ``dim=1024 depth=24 heads=16`` is ViT-L
    (~300M parameters), the size ``bench.py gpu`` measures."""

    name: str = "vit"
    in_channels: int = 1
    image_size: int = 32
    """Side of the square images the model takes (data.image.size for image data)."""
    patch_size: int = 8
    dim: int = 128
    depth: int = 4
    heads: int = 4
    mlp_ratio: float = 4.0
    output_dim: int = 10
    task: str = "classification"
    classes: int = 0
    """multitask: how many of the outputs are class logits."""
    input_size: int = 0
    """As ResNetConfig: flat rows of in_channels x input_size^2 values are reshaped to
    images (then it is the side and image_size is not used); 0 = the data are images."""
    log_input: bool = False

    @property
    def side(self) -> int:
        return self.input_size or self.image_size

    def validate(self) -> None:
        from elastic.errors import ConfigError

        super().validate()
        for key in ("image_size", "patch_size", "dim", "depth", "heads"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key}={getattr(self, key)} is not valid: must be >= 1")
        if self.side % self.patch_size:
            key = "input_size" if self.input_size else "image_size"
            raise ConfigError(
                f"model.patch_size={self.patch_size} does not divide model.{key}={self.side}: "
                "use a patch size that divides the image side"
            )
        if self.dim % self.heads:
            raise ConfigError(
                f"model.dim={self.dim} does not split into model.heads={self.heads}: "
                "use a dim that is a multiple of heads"
            )
        if self.mlp_ratio <= 0:
            raise ConfigError(f"model.mlp_ratio={self.mlp_ratio} is not valid: must be > 0")

    def build(self) -> nn.Module:
        from elastic.models.nets.vit import ViT

        return ViT(
            in_channels=self.in_channels,
            side=self.side,
            flat=bool(self.input_size),
            log_input=self.log_input,
            dim=self.dim,
            patch_size=self.patch_size,
            heads=self.heads,
            mlp_ratio=self.mlp_ratio,
            depth=self.depth,
            output_dim=self.output_dim,
        )
