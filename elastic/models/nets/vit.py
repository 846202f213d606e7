"""The network of ``model=vit`` (:class:`~elastic.models.vit.ViTConfig`)."""

from __future__ import annotations

import torch
from torch import nn

from elastic.models.nets.image import LogIntensity


class ViT(nn.Module):
    """Images of ``in_channels`` x ``side`` x ``side`` (flat rows reshaped to them when
    ``flat``; log intensities when ``log_input``) in ``patch_size`` patches, a class
    token, ``depth`` pre-norm blocks of width ``dim``, a linear head of ``output_dim``."""

    def __init__(
        self,
        *,
        in_channels: int,
        side: int,
        flat: bool,
        log_input: bool,
        dim: int,
        patch_size: int,
        heads: int,
        mlp_ratio: float,
        depth: int,
        output_dim: int,
    ) -> None:
        super().__init__()
        self.prepare = nn.Sequential(
            nn.Unflatten(1, (in_channels, side, side)) if flat else nn.Identity(),
            LogIntensity() if log_input else nn.Identity(),
        )
        self.patches = nn.Conv2d(in_channels, dim, patch_size, patch_size)
        tokens = (side // patch_size) ** 2
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.position = nn.Parameter(torch.randn(1, tokens + 1, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(
            dim,
            heads,
            int(dim * mlp_ratio),
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, output_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patches(self.prepare(x)).flatten(2).transpose(1, 2)  # [N, tokens, dim]
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], dim=1) + self.position
        return self.head(self.norm(self.encoder(x)[:, 0]))
