"""The network of ``model=cvae`` (:class:`~elastic.models.cvae.CVAEConfig`)."""

from __future__ import annotations

import torch
from torch import nn


class ContactVAE(nn.Module):
    """Convolutional VAE on a symmetric n x n contact map given as its upper triangle
    (i < j, row-major): the map is rebuilt (diagonal 1) for the convolutions and the
    decoder's map is read back as upper-triangle logits."""

    flat_index: torch.Tensor

    def __init__(self, n: int, channels: list[int], latent: int, beta: float) -> None:
        super().__init__()
        self.n, self.latent, self.beta = n, latent, beta
        iu = torch.triu_indices(n, n, 1)
        self.register_buffer("flat_index", iu[0] * n + iu[1], persistent=False)
        layers: list[nn.Module] = []
        c_in, side = 1, n
        for c in channels:
            layers += [nn.Conv2d(c_in, c, 3, 2, 1), nn.GroupNorm(min(8, c), c), nn.GELU()]
            c_in, side = c, (side + 1) // 2
        self.encoder = nn.Sequential(*layers, nn.Flatten())
        self.side, self.c_last = side, c_in
        self.to_stats = nn.Linear(c_in * side * side, 2 * latent)
        self.from_latent = nn.Linear(latent, c_in * side * side)
        layers = []
        for c in [*reversed(channels[:-1]), 8]:
            layers += [
                nn.ConvTranspose2d(c_in, c, 4, 2, 1),
                nn.GroupNorm(min(8, c), c),
                nn.GELU(),
            ]
            c_in = c
        self.decoder = nn.Sequential(*layers, nn.Conv2d(c_in, 1, 3, 1, 1))
        # A learned logit per contact, the map every frame shares (most contacts of a
        # folded protein never change), so the latent code only carries what differs.
        # Kept in units of 8 logits: Adam moves a parameter ~lr a step, and these must
        # travel to +-10 in a short run. Starts at the typical density (~4% contacts).
        self.contact_bias = nn.Parameter(torch.full((len(iu[0]),), -3.0 / 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, b = self.n, x.shape[0]
        full = x.new_zeros(b, n * n)
        full[:, self.flat_index] = x
        grid = full.view(b, 1, n, n)
        grid = grid + grid.transpose(2, 3) + torch.eye(n, dtype=x.dtype, device=x.device)
        mu, logvar = self.to_stats(self.encoder(grid)).chunk(2, dim=1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp() if self.training else mu
        h = self.from_latent(z).view(b, self.c_last, self.side, self.side)
        logits = self.decoder(h)[:, 0, :n, :n]
        logits = 0.5 * (logits + logits.transpose(1, 2))  # a contact map is symmetric
        upper = logits.reshape(b, n * n)[:, self.flat_index] + 8 * self.contact_bias
        return torch.cat([upper, mu, logvar], dim=1)
