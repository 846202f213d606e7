"""Non-finite training, found at its step: a loss that is nan/inf (naming the rows),
an update DeepSpeed skipped for inf/nan gradients, parameters no longer finite. Each rank
notes what it saw; the ranks' next agreement on their steps (or a checkpoint's check)
makes it common, and every rank then stops with one message built from all ranks'
findings."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from elastic.data.shards import locate_samples
from elastic.errors import DivergedError

NAMED_ROWS = 5  # sample ids named in the message


def parameters_finite(engine: Any) -> bool:
    """This rank's parameters (ZeRO-3: its partition, ``ds_tensor``) hold no inf/nan."""
    for p in engine.module.parameters():
        t = getattr(p, "ds_tensor", p)
        if t.numel() and not torch.isfinite(t).all():
            return False
    return True


class Divergence:
    """One rank's findings in a group of ``world`` ranks training on ``data_path`` at
    learning rate ``lr`` (what the message names)."""

    def __init__(self, world: int, data_path: str, lr: float) -> None:
        self.world, self.data_path, self.lr = world, data_path, lr
        # what went non-finite on this rank (None: nothing yet)
        self.found: dict[str, Any] | None = None

    @property
    def pending(self) -> bool:
        return self.found is not None

    def note(self, step: int, sample_ids: np.ndarray, skipped_update: bool = False) -> None:
        if self.found is None:
            self.found = {"step": step, "ids": [], "skipped": False}
        self.found["ids"] += [int(i) for i in sample_ids[:NAMED_ROWS]]
        self.found["skipped"] |= skipped_update

    def check(self, engine: Any, step: int, device: torch.device) -> bool:
        """Collective: whether any rank saw a non-finite loss or holds non-finite
        parameters (a finite loss can still leave inf/nan weights after an update)."""
        if self.found is None and not parameters_finite(engine):
            self.found = {"step": step, "ids": [], "skipped": False, "params": True}
        flag = torch.tensor([self.pending], device=device)
        dist.all_reduce(flag)
        return bool(flag.item())

    def check_and_stop(self, engine: Any, step: int, device: torch.device) -> None:
        """Collective: :meth:`check`, then :meth:`stop` if any rank found anything."""
        if self.check(engine, step, device):
            self.stop()

    def stop(self) -> None:
        """Collective: raise the same :class:`DivergedError` on every rank."""
        world, data_path, lr = self.world, self.data_path, self.lr
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, self.found)
        seen = [f for f in gathered if f is not None]
        step = min(f["step"] for f in seen)
        ids = sorted({i for f in seen for i in f["ids"]})[:NAMED_ROWS]
        if ids:
            files = locate_samples(data_path, np.array(ids))
            where = ", ".join(f"{i} ({files.get(i, '?')})" for i in ids)
            cause = (
                f"the loss is not finite for sample_id {where} in {data_path}: check those "
                "rows for nan/inf, or lower optim.lr"
            )
        elif any(f.get("skipped") for f in seen):
            cause = (
                "the gradients are not finite and DeepSpeed skipped the update: lower "
                f"optim.lr (now {lr:g}) or set strategy.gradient_clipping"
            )
        else:
            cause = (
                f"the model's parameters are no longer finite: lower optim.lr (now {lr:g}) "
                "or set strategy.gradient_clipping"
            )
        raise DivergedError(
            f"training diverged at step {step}: {cause}; nothing from this step on was checkpointed"
        )
