"""Models and their typed configs.

A model config is a dataclass registered with Hydra (``schema/model/<name>``), so a typo
in ``conf/model/*.yaml`` fails while composing. Each config builds its module and knows
its task, which decides the per-sample loss and the validation metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

TASKS = ("regression", "classification", "multitask", "vae")
"""multitask: the target is [class, r_1, ..., r_k]; the model's first ``classes`` outputs
are class logits, the other ``output_dim - classes`` regress r_1..r_k (loss: cross
entropy + mean squared error; metrics: accuracy and R^2). vae: the model reconstructs its
input of 0/1 values (the target column is not used): it returns [reconstruction logits,
mu, log variance]; loss: binary cross entropy + beta x KL, both per input value."""


@dataclass
class MLPConfig:
    """A multi-layer perceptron on a flat input vector."""

    name: str = "mlp"
    input_dim: int = 64
    hidden_dims: list[int] = field(default_factory=lambda: [256, 256])
    output_dim: int = 1
    task: str = "regression"

    def validate(self) -> None:
        from elastic.config import ConfigError

        if self.task not in TASKS:
            raise ConfigError(f"model.task={self.task!r} is not valid: use one of {TASKS}")
        for key in ("input_dim", "output_dim"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key}={getattr(self, key)} is not valid: must be >= 1")
        if any(h < 1 for h in self.hidden_dims):
            raise ConfigError(f"model.hidden_dims={self.hidden_dims} is not valid: all >= 1")
        if self.task == "classification" and self.output_dim < 2:
            raise ConfigError("model.output_dim must be >= 2 (classes) for classification")

    def build(self) -> nn.Module:
        dims = [self.input_dim, *self.hidden_dims]
        layers: list[nn.Module] = []
        for d_in, d_out in zip(dims[:-1], dims[1:], strict=True):
            layers += [nn.Linear(d_in, d_out), nn.GELU()]
        layers.append(nn.Linear(dims[-1], self.output_dim))
        return nn.Sequential(*layers)


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


def _check_image_model(m: ResNetConfig | ViTConfig) -> None:
    """What the image models share: task, outputs, classes, channels, flat input side."""
    from elastic.config import ConfigError

    if m.task not in TASKS:
        raise ConfigError(f"model.task={m.task!r} is not valid: use one of {TASKS}")
    if m.in_channels < 1 or m.output_dim < 1:
        raise ConfigError("model.in_channels and model.output_dim must be >= 1")
    if m.task == "classification" and m.output_dim < 2:
        raise ConfigError("model.output_dim must be >= 2 (classes) for classification")
    if m.task == "multitask" and not 2 <= m.classes < m.output_dim:
        raise ConfigError(
            f"model.classes={m.classes} with model.output_dim={m.output_dim} is not "
            "valid for multitask: classes >= 2 and output_dim = classes + regression outputs"
        )
    if m.input_size < 0:
        raise ConfigError(f"model.input_size={m.input_size} is not valid: use 0 or >= 4")


class _LogIntensity(nn.Module):
    """x (normalised to sum 1 per image) -> log(1 + x * H * W): mean pixel at log 2."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log1p(x * (x.shape[-1] * x.shape[-2]))


@dataclass
class ResNetConfig:
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

    @property
    def input_dim(self) -> int | None:
        """Width of a flat input row, when the model takes flat rows."""
        return self.in_channels * self.input_size**2 if self.input_size else None

    def validate(self) -> None:
        from elastic.config import ConfigError

        _check_image_model(self)
        if self.blocks_per_stage < 1:
            raise ConfigError(f"model.blocks_per_stage={self.blocks_per_stage}: must be >= 1")
        if not self.widths or any(w < 1 for w in self.widths):
            raise ConfigError(f"model.widths={self.widths} is not valid: one or more, all >= 1")

    def build(self) -> nn.Module:
        layers: list[nn.Module] = []
        if self.input_size:
            layers.append(nn.Unflatten(1, (self.in_channels, self.input_size, self.input_size)))
        if self.log_input:
            layers.append(_LogIntensity())
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


class _ContactVAE(nn.Module):
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


@dataclass
class CVAEConfig:
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
        from elastic.config import ConfigError

        if self.task != "vae":
            raise ConfigError(f"model.task={self.task!r} is not valid for model=cvae: use vae")
        if self.residues < 2 or self.latent_dim < 1 or self.beta < 0:
            raise ConfigError(
                "model.residues >= 2, model.latent_dim >= 1 and model.beta >= 0 are needed"
            )
        if not self.channels or any(c < 1 for c in self.channels):
            raise ConfigError(f"model.channels={self.channels} is not valid: one or more, >= 1")

    def build(self) -> nn.Module:
        return _ContactVAE(self.residues, list(self.channels), self.latent_dim, self.beta)


class _ViT(nn.Module):
    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        side = c.side
        self.prepare = nn.Sequential(
            nn.Unflatten(1, (c.in_channels, side, side)) if c.input_size else nn.Identity(),
            _LogIntensity() if c.log_input else nn.Identity(),
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
class ViTConfig:
    """A Vision Transformer on [N, C, H, W] images (or flat rows of them): non-overlapping
    patches, a class token, pre-norm encoder blocks, a linear head on the class token.
    The default is small enough for a CPU run; ``dim=1024 depth=24 heads=16`` is ViT-L
    (~300M parameters), the size ``bench.py gpu`` measures."""

    name: str = "vit"
    in_channels: int = 1
    image_size: int = 32
    """Side of the square images the model takes (data.image_size for image data)."""
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

    @property
    def input_dim(self) -> int | None:
        return self.in_channels * self.input_size**2 if self.input_size else None

    def validate(self) -> None:
        from elastic.config import ConfigError

        _check_image_model(self)
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


MODEL_SCHEMAS: dict[str, type] = {
    "mlp": MLPConfig,
    "resnet": ResNetConfig,
    "vit": ViTConfig,
    "cvae": CVAEConfig,
}


def vae_terms(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per sample: reconstruction BCE and KL (each per input value), and the logits."""
    width = target.shape[1]
    logits, stats = output[:, :width], output[:, width:]
    mu, logvar = stats.chunk(2, dim=1)
    target = target.to(logits.dtype)
    bce = nn.functional.binary_cross_entropy_with_logits(logits, target, reduction="none")
    kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(dim=1)
    return bce.mean(dim=1), kl / width, logits


def per_sample_loss(
    task: str, output: torch.Tensor, target: torch.Tensor, classes: int = 0, beta: float = 1.0
) -> torch.Tensor:
    """Loss of every sample (no reduction): the loop weights them so uneven or partial
    batches still give the exact mean over the samples of a global step. For ``vae`` the
    target is the input."""
    if task == "vae":
        bce, kl, _ = vae_terms(output, target)
        return bce + beta * kl
    if task == "classification":
        return nn.functional.cross_entropy(output, target.long(), reduction="none")
    if task == "multitask":
        ce = nn.functional.cross_entropy(output[:, :classes], target[:, 0].long(), reduction="none")
        err = output[:, classes:] - target[:, 1:].to(output.dtype)
        return ce + err.pow(2).mean(dim=1)
    target = target.reshape(output.shape).to(output.dtype)
    return (output - target).pow(2).mean(dim=tuple(range(1, output.dim())))


class MetricSums:
    """Additive validation statistics; all-reduce the tensor, then read metrics off it."""

    def __init__(self, task: str, output_dim: int, classes: int = 0) -> None:
        self.task, self.classes = task, classes
        # n, sum loss, correct (classification, multitask), then for each regressed
        # output: sum y, sum y^2, sum squared error (regression, multitask)
        self.k = {"classification": 0, "multitask": output_dim - classes, "vae": 0}.get(
            task, output_dim
        )
        # vae: n, sum loss, then sum BCE, sum KL, true/false positive and false negative
        # contacts (threshold 0.5)
        self.sums = torch.zeros(6 if task == "vae" else 3 + 3 * self.k, dtype=torch.float64)

    def add(self, output: torch.Tensor, target: torch.Tensor, losses: torch.Tensor) -> None:
        out = output.detach().double()
        self.sums[0] += losses.shape[0]
        self.sums[1] += losses.detach().double().sum()
        if self.task == "classification":
            self.sums[2] += (out.argmax(dim=-1) == target.long()).sum()
            return
        if self.task == "vae":
            bce, kl, logits = vae_terms(out, target.double())
            predicted, actual = logits > 0, target > 0.5
            self.sums[2] += bce.sum()
            self.sums[3] += kl.sum()
            self.sums[4] += (predicted & actual).sum()
            self.sums[5] += (predicted ^ actual).sum()  # false positives + false negatives
            return
        if self.task == "multitask":
            c = self.classes
            self.sums[2] += (out[:, :c].argmax(dim=-1) == target[:, 0].long()).sum()
            out, target = out[:, c:], target[:, 1:]
        o = out.flatten(1) if out.dim() > 1 else out[:, None]
        y = target.double().reshape(o.shape)
        k = self.k
        self.sums[3 : 3 + k] += y.sum(0)
        self.sums[3 + k : 3 + 2 * k] += (y * y).sum(0)
        self.sums[3 + 2 * k : 3 + 3 * k] += ((o - y) ** 2).sum(0)

    def metrics(self) -> dict[str, float]:
        n = float(self.sums[0])
        if n == 0:
            return {}
        result = {"loss": float(self.sums[1]) / n, "samples": n}
        if self.task == "vae":
            tp, wrong = float(self.sums[4]), float(self.sums[5])
            result["bce"] = float(self.sums[2]) / n
            result["kl"] = float(self.sums[3]) / n
            # F1 of the reconstructed contacts: 2 TP / (2 TP + FP + FN)
            result["f1"] = 2 * tp / max(2 * tp + wrong, 1.0)
            return result
        if self.task in ("classification", "multitask"):
            result["accuracy"] = float(self.sums[2]) / n
        if not self.k:
            return result
        k = self.k
        sy, syy, sse = self.sums[3 : 3 + k], self.sums[3 + k : 3 + 2 * k], self.sums[3 + 2 * k :]
        sst = syy - sy * sy / n
        # R^2 averaged over output dimensions (sklearn's "uniform_average")
        result["r2"] = float((1 - sse / sst.clamp_min(1e-12)).mean())
        return result
