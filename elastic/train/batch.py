"""Batch plan: world size is data.

On every (re)start the loop derives micro batch and gradient accumulation from the
world size it actually got, so the global batch the config asks for holds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class BatchPlan:
    global_batch_size: int
    world_size: int
    micro_batch_size: int
    grad_accum_steps: int
    requested_global_batch_size: int = 0
    """What the config asked for (0: the same as global_batch_size)."""

    @property
    def lr_scale(self) -> float:
        """Linear learning-rate scaling for an adjusted global batch (1.0 when kept)."""
        requested = self.requested_global_batch_size or self.global_batch_size
        return self.global_batch_size / requested

    @property
    def adjusted(self) -> bool:
        return self.lr_scale != 1.0

    @classmethod
    def for_policy(
        cls, policy: str, global_batch_size: int, world_size: int, micro: int | None = None
    ) -> BatchPlan:
        """``strict``: :meth:`for_world` (raises when the world size cannot hold the batch).
        ``adjust``: the nearest global batch this world size splits into whole micro
        batches (ties go to the larger), for a learning rate scaled by :attr:`lr_scale`."""
        try:
            return cls.for_world(global_batch_size, world_size, micro)
        except ValueError:
            if policy != "adjust":
                raise
        unit = world_size * (micro or 1)
        nearest = max(unit, int(global_batch_size / unit + 0.5) * unit)
        plan = cls.for_world(nearest, world_size, micro)
        return replace(plan, requested_global_batch_size=global_batch_size)

    @property
    def per_worker(self) -> int:
        """Samples one worker contributes to one optimizer step."""
        return self.micro_batch_size * self.grad_accum_steps

    @classmethod
    def for_world(
        cls, global_batch_size: int, world_size: int, micro_batch_size: int | None = None
    ) -> BatchPlan:
        """Raise ValueError when the global batch does not split into whole micro batches."""
        if global_batch_size % world_size:
            raise ValueError(
                f"global batch {global_batch_size} does not split over {world_size} workers"
            )
        per_worker = global_batch_size // world_size
        micro = per_worker if micro_batch_size is None else micro_batch_size
        if micro <= 0 or per_worker % micro:
            raise ValueError(
                f"per-worker batch {per_worker} is not a multiple of micro batch {micro}"
            )
        return cls(global_batch_size, world_size, micro, per_worker // micro)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)
