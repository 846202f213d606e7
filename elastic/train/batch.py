"""Batch plan: world size is data.

Every global batch is the same rows at any world size (:mod:`elastic.data.order`); a
worker's slice is the global batch over the world size, give or take a row. On every
(re)start the loop derives from the world size it got how many micro batches a slice
is cut into (gradient accumulation), so no forward pass exceeds
``data.micro_batch_size``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class BatchPlan:
    global_batch_size: int
    world_size: int
    micro_batch_size: int
    """The largest micro batch of any worker (slices may differ by a row)."""
    grad_accum_steps: int

    @classmethod
    def for_world(
        cls, global_batch_size: int, world_size: int, micro_batch_size: int | None = None
    ) -> BatchPlan:
        """Raise ValueError when the world is larger than the global batch (a worker
        would have no rows)."""
        if not 1 <= world_size <= global_batch_size:
            raise ValueError(
                f"world size {world_size} must be between 1 and the global batch "
                f"{global_batch_size}: every worker trains at least one row a step"
            )
        largest = -(-global_batch_size // world_size)  # the largest slice
        micro = largest if micro_batch_size is None else min(micro_batch_size, largest)
        if micro <= 0:
            raise ValueError(f"micro batch {micro} must be >= 1")
        accum = -(-largest // micro)
        return cls(global_batch_size, world_size, -(-largest // accum), accum)

    @property
    def deepspeed_batch_size(self) -> int:
        """What DeepSpeed is told the global batch is (it insists on micro x accumulation
        x world; the loss weighting makes the gradient the mean over the true rows)."""
        return self.micro_batch_size * self.grad_accum_steps * self.world_size

    def to_dict(self) -> dict[str, int]:
        return asdict(self)
