"""Lock-step agreement: what the ranks of a worker group agree on, in one all-reduce.

Every rank trains its slice of the same global step (:mod:`elastic.data.order`) and
counts the rows it trained since the ranks last agreed. On the steps that need it (the
caller's: logged, checkpointed or validated after, an epoch's last; and every few steps,
paced by :class:`~elastic.train.control.SyncPace`) one all-reduce of six integers
carries: those rows (summed, they must be the plan's: else the ranks' plans disagree),
the step's sample-id digest (which rows the step trained, logged), each rank's pace
proposal, and whether any rank has seen a stop request, a node drain or a non-finite
value. So every rank acts on a stop, a drain or a divergence at the same step, and no
rank waits on a collective the others never make.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elastic.data.ids import ids_digest
from elastic.data.stream import StepBatch
from elastic.train.control import StopPoller, SyncPace, node_drain_probe
from elastic.train.divergence import Divergence


class LockStep:
    """One rank's side of the agreement. ``control`` is the run's control actor on rank 0
    (its stop requests: SIGTERM, SIGUSR1 to the driver) and None elsewhere. When any
    rank has noted a non-finite value every rank stops (:meth:`Divergence.stop`
    raises)."""

    def __init__(
        self,
        world: int,
        device: torch.device,
        control: Any,
        divergence: Divergence,
        drain_probe: Callable[[], bool] | None = None,
    ) -> None:
        self.world, self.device = world, device
        self.divergence = divergence
        self.stops = StopPoller(control)
        self._drain_probe = drain_probe or node_drain_probe()
        self.pace = SyncPace()
        self._rows = [0, 0]  # since the last agreement: this rank's, the plan's (all ranks)
        self.digest = 0  # the last agreed step's sample-id digest over all ranks
        self.stop_requested = False  # by now, on any rank: sticky
        self.drain_pending = False  # at the last agreement, on any rank's node

    def agree(self, step: int, batch: StepBatch, forced: bool) -> bool:
        """Count ``batch``'s rows; on a step due for agreement (``forced``, or the pace's)
        make the all-reduce. Whether the ranks agreed at ``step`` (every rank answers
        the same)."""
        self._rows[0] += batch.rows
        self._rows[1] += batch.global_rows
        if not self.pace.due(step, forced):
            return False
        rows, digest, paces = self.all_reduce(
            self._rows[0], ids_digest(batch.sample_id), self.pace.proposal()
        )
        self.pace.agreed(step, paces, self.world)
        self.digest = digest
        if rows != self._rows[1]:
            raise RuntimeError(
                f"step {step}: the ranks hold {rows} rows since they last agreed, the plan "
                f"{self._rows[1]}: their plans disagree"
            )
        self._rows = [0, 0]
        return True

    def all_reduce(self, rows: int, digest: int = 0, pace: int = 0) -> tuple[int, int, int]:
        """Collective: ``rows``, ``digest`` and ``pace`` summed over all ranks, and (in the
        same all-reduce) whether any rank has seen a stop request, a node drain or a
        non-finite value. Also the validation stream's per-block agreement on rows."""
        stop = self.stops.poll() is not None
        drain = self._drain_probe()
        bad = self.divergence.pending
        t = torch.tensor(
            [rows, stop, drain, bad, digest, pace], dtype=torch.int64, device=self.device
        )
        dist.all_reduce(t)
        if t[3]:
            self.divergence.stop()
        self.stop_requested = self.stop_requested or bool(t[1])
        self.drain_pending = bool(t[2])
        return int(t[0]), int(t[4]), int(t[5])
