"""A Vision Transformer (``model=vit``): patches, class token, pre-norm blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from elastic.models.base import ImageModelConfig
from elastic.models.image import LogIntensity


class _ViT(nn.Module):
    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        side = c.side
        self.prepare = nn.Sequential(
            nn.Unflatten(1, (c.in_channels, side, side)) if c.input_size else nn.Identity(),
            LogIntensity() if c.log_input else nn.Identity(),
        )
        self.patches = nn.Conv2d(c.in_channels, c.dim, c.patch_size, c.patch_size)
        tokens = (side // c.patch_size) ** 2
        self.cls = nn.Parameter(torch.zeros(1, 1, c.dim))
        self.position = nn.Parameter(torch.randn(1, tokens + 1, c.dim) * 0.02)
        layer = nn.TransformerEncoderLayer(
            c.dim,
            c.heads,
            int(c.dim * c.mlp_ratio),
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, c.depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.output_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patches(self.prepare(x)).flatten(2).transpose(1, 2)  # [N, tokens, dim]
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], dim=1) + self.position
        return self.head(self.norm(self.encoder(x)[:, 0]))


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
        return _ViT(self)
