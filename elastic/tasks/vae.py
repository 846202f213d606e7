"""``model.task=vae``: the model reconstructs its input of 0/1 values (no target column
is read). It returns [reconstruction logits, mu, log variance]; loss: binary cross
entropy + ``model.beta`` x KL, both per input value; metrics: BCE, KL and the F1 of the
reconstructed contacts (threshold 0.5)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from elastic.tasks.base import Task, register_task

if TYPE_CHECKING:
    import torch


def vae_terms(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per sample: reconstruction BCE and KL (each per input value), and the logits."""
    import torch.nn.functional as F

    width = target.shape[1]
    logits, stats = output[:, :width], output[:, width:]
    mu, logvar = stats.chunk(2, dim=1)
    target = target.to(logits.dtype)
    bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(dim=1)
    return bce.mean(dim=1), kl / width, logits


@register_task
class VAE(Task):
    name = "vae"
    description = "reconstruct the 0/1 input; loss: BCE + beta x KL; metrics: BCE, KL, F1"
    target_is_input = True

    def sums(self) -> int:
        return 4  # BCE, KL, true positives, false positives + false negatives

    def target_shape(self) -> tuple[tuple[int, ...], Any] | None:
        return None

    @property
    def beta(self) -> float:
        """The KL term's weight: the model config's ``beta`` (1 without one)."""
        return float(getattr(self.model, "beta", 1.0))

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        bce, kl, _ = vae_terms(output, target)
        return bce + self.beta * kl

    def add_sums(self, sums: torch.Tensor, output: torch.Tensor, target: torch.Tensor) -> None:
        bce, kl, logits = vae_terms(output, target.double())
        predicted, actual = logits > 0, target > 0.5
        sums[0] += bce.sum()
        sums[1] += kl.sum()
        sums[2] += (predicted & actual).sum()
        sums[3] += (predicted ^ actual).sum()

    def read_sums(self, sums: torch.Tensor, rows: float) -> dict[str, float]:
        tp, wrong = float(sums[2]), float(sums[3])
        # F1 of the reconstructed contacts: 2 TP / (2 TP + FP + FN)
        f1 = 2 * tp / max(2 * tp + wrong, 1.0)
        return {"bce": float(sums[0]) / rows, "kl": float(sums[1]) / rows, "f1": f1}
