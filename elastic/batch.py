"""Batch plan: world size is data.

On every (re)start the loop derives micro batch and gradient accumulation from the
world size it actually got, so the global batch the config asks for holds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class BatchPlan:
    global_batch_size: int
    world_size: int
    micro_batch_size: int
    grad_accum_steps: int

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
