"""Per-sample losses and validation metrics, by task (what a model family declares)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

TASKS = ("regression", "classification", "multitask", "vae")
"""multitask: the target is [class, r_1, ..., r_k]; the model's first ``classes`` outputs
are class logits, the other ``output_dim - classes`` regress r_1..r_k (loss: cross
entropy + mean squared error; metrics: accuracy and R^2). vae: the model reconstructs its
input of 0/1 values (the target column is not used): it returns [reconstruction logits,
mu, log variance]; loss: binary cross entropy + beta x KL, both per input value."""


def bad_labels(task: str, target: np.ndarray, output_dim: int, classes: int = 0) -> np.ndarray:
    """Which rows' class labels the task cannot use (the loss would raise, or index past
    the model's outputs): not an integer in 0..classes-1. A bool mask over the rows (all
    False for tasks without labels)."""
    if task not in ("classification", "multitask"):
        return np.zeros(len(target), bool)
    labels = target[:, 0] if target.ndim > 1 else target  # multitask: [class, values...]
    n = output_dim if task == "classification" else classes
    bad = (labels < 0) | (labels >= n)
    if labels.dtype.kind == "f":
        bad |= labels != np.floor(labels)  # nan too
    return bad


def label_range(task: str, output_dim: int, classes: int = 0) -> str:
    """The labels ``task`` takes, in words."""
    n = output_dim if task == "classification" else classes
    return f"classes 0..{n - 1}"


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
