"""A convolutional variational autoencoder of contact maps (``model=cvae``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from elastic.models.base import ModelConfig

if TYPE_CHECKING:
    from torch import nn


@dataclass
class CVAEConfig(ModelConfig):
    """A convolutional variational autoencoder on contact maps (data.format=contacts),
    as in the protein-folding work (Bhowmik et al., BMC Bioinformatics 2018)."""

    name: str = "cvae"
    residues: int = 214
    channels: list[int] = field(default_factory=lambda: [16, 32, 64])
    """Encoder widths; each halves the map (the decoder mirrors them)."""
    latent_dim: int = 8
    beta: float = 1.0
    """Weight of the KL term (per contact value, like the reconstruction term)."""
    task: str = "vae"

    @property
    def input_dim(self) -> int:
        return self.residues * (self.residues - 1) // 2

    @property
    def output_dim(self) -> int:
        return self.input_dim + 2 * self.latent_dim

    def validate(self) -> None:
        from elastic.errors import ConfigError

        if self.task != "vae":
            raise ConfigError(f"model.task={self.task!r} is not valid for model=cvae: use vae")
        if self.residues < 2 or self.latent_dim < 1 or self.beta < 0:
            raise ConfigError(
                "model.residues >= 2, model.latent_dim >= 1 and model.beta >= 0 are needed"
            )
        if not self.channels or any(c < 1 for c in self.channels):
            raise ConfigError(f"model.channels={self.channels} is not valid: one or more, >= 1")

    def build(self) -> nn.Module:
        from elastic.models.nets.cvae import ContactVAE

        return ContactVAE(self.residues, list(self.channels), self.latent_dim, self.beta)
