"""A multi-layer perceptron on flat input vectors (``model=mlp``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from elastic.models.base import ModelConfig

if TYPE_CHECKING:
    from torch import nn


@dataclass
class MLPConfig(ModelConfig):
    """A multi-layer perceptron on a flat input vector."""

    name: str = "mlp"
    input_dim: int = 64
    hidden_dims: list[int] = field(default_factory=lambda: [256, 256])
    output_dim: int = 1
    task: str = "regression"

    def validate(self) -> None:
        from elastic.errors import ConfigError

        for key in ("input_dim", "output_dim"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key}={getattr(self, key)} is not valid: must be >= 1")
        if any(h < 1 for h in self.hidden_dims):
            raise ConfigError(f"model.hidden_dims={self.hidden_dims} is not valid: all >= 1")

    def build(self) -> nn.Module:
        from torch import nn

        dims = [self.input_dim, *self.hidden_dims]
        layers: list[nn.Module] = []
        for d_in, d_out in zip(dims[:-1], dims[1:], strict=True):
            layers += [nn.Linear(d_in, d_out), nn.GELU()]
        layers.append(nn.Linear(dims[-1], self.output_dim))
        return nn.Sequential(*layers)
