"""Exactly-once sample accounting.

Each worker notes the ``sample_id`` of every row it trains. At each checkpoint and at the
end of an epoch the notes are gathered to rank 0 and merged into a packed bitmap of the
epoch (1 bit per sample: 12.5 MB for 10^8 samples), which goes into the checkpoint. A
sample seen twice is counted, not hidden. The bitmap in the checkpoint a run resumes from
is exactly the set of samples in the surviving model state, so the resumed run skips it.

Rank 0 does this while every other rank waits at the checkpoint, so its cost is per id
and small (``bench.py scale``, docs/performance.md#scale): a merge sorts the ids (numpy
2.4's hash-based ``np.unique`` took 40x longer on millions of ids) and sets each byte's
bits at once; a bitmap of random bits (any epoch under way) is stored as it is, since
deflating 10^9 ids' worth took 5 s to save nothing.
"""

from __future__ import annotations

import io
import zipfile
import zlib
from typing import Any

import numpy as np

from elastic.data.ids import bitmap_contains


class SampleLedger:
    def __init__(self) -> None:
        self.epoch = 0
        self.bitmap = np.zeros(0, dtype=np.uint8)
        self.trained = 0
        self.duplicates = 0
        self.closed_epochs: list[dict[str, int]] = []
        self.last_closed_bitmap = np.zeros(0, dtype=np.uint8)
        self._pending: list[np.ndarray] = []

    # -- on every worker -------------------------------------------------------------
    def record(self, sample_ids: np.ndarray) -> None:
        if len(sample_ids):
            self._pending.append(np.asarray(sample_ids, dtype=np.int64))

    def take_pending(self) -> np.ndarray:
        ids = np.concatenate(self._pending) if self._pending else np.zeros(0, np.int64)
        self._pending = []
        return ids

    # -- on rank 0 -----------------------------------------------------------------------
    def merge(self, per_rank: list[np.ndarray]) -> None:
        """Fold every rank's notes since the last merge into the epoch bitmap."""
        ids = np.concatenate(per_rank) if per_rank else np.zeros(0, np.int64)
        if not len(ids):
            return
        need = int(ids.max()) // 8 + 1
        if need > self.bitmap.shape[0]:
            self.bitmap = np.concatenate(
                [self.bitmap, np.zeros(need - self.bitmap.shape[0], np.uint8)]
            )
        ordered = np.sort(ids)
        unique = ordered[np.r_[True, ordered[1:] != ordered[:-1]]]
        already = self.contains(unique)
        self.duplicates += int(len(ids) - len(unique)) + int(already.sum())
        fresh = unique[~already]  # ascending: each byte's ids side by side
        if len(fresh):
            byte = fresh >> 3
            bits = (1 << (7 - (fresh & 7))).astype(np.uint8)
            starts = np.flatnonzero(np.r_[True, byte[1:] != byte[:-1]])
            self.bitmap[byte[starts]] |= np.bitwise_or.reduceat(bits, starts)
        self.trained += len(fresh)

    def contains(self, ids: np.ndarray) -> np.ndarray:
        return bitmap_contains(self.bitmap, ids)

    def close_epoch(self) -> dict[str, int]:
        """The epoch is over: keep its record (and bitmap, for audit) and start the next."""
        record = {"epoch": self.epoch, "trained": self.trained, "duplicates": self.duplicates}
        self.closed_epochs.append(record)
        self.last_closed_bitmap = self.bitmap
        self.epoch += 1
        self.bitmap = np.zeros(0, dtype=np.uint8)
        self.trained = self.duplicates = 0
        return record

    def trained_ids(self, bitmap: np.ndarray | None = None) -> np.ndarray:
        bits = np.unpackbits(self.bitmap if bitmap is None else bitmap)
        return np.flatnonzero(bits).astype(np.int64)

    # -- persistence -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "trained": self.trained,
            "duplicates": self.duplicates,
            "closed_epochs": list(self.closed_epochs),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.trained = int(state["trained"])
        self.duplicates = int(state["duplicates"])
        self.closed_epochs = [dict(r) for r in state["closed_epochs"]]

    def bitmaps_bytes(self) -> bytes:
        """Both bitmaps as an npz (what ``np.load`` reads), each deflated only where
        that pays (:func:`_compressible`)."""
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            for name, bitmap in (("epoch", self.bitmap), ("last_closed", self.last_closed_bitmap)):
                member = io.BytesIO()
                np.lib.format.write_array(member, bitmap, allow_pickle=False)
                how = zipfile.ZIP_DEFLATED if _compressible(bitmap) else zipfile.ZIP_STORED
                z.writestr(f"{name}.npy", member.getvalue(), compress_type=how, compresslevel=1)
        return buf.getvalue()

    def load_bitmaps(self, data: bytes) -> None:
        with np.load(io.BytesIO(data)) as z:
            self.bitmap = z["epoch"].astype(np.uint8)
            self.last_closed_bitmap = z["last_closed"].astype(np.uint8)


def _compressible(bitmap: np.ndarray, chunks: int = 16, chunk_bytes: int = 4096) -> bool:
    """Whether deflating ``bitmap`` would save a fifth or more, judged on ``chunks``
    pieces spread over it: a closed epoch's (all ones) or a sparse id range's would; the
    random bits of an epoch under way would not."""
    if bitmap.nbytes <= chunks * chunk_bytes:
        sample = bitmap.tobytes()
    else:
        at = np.linspace(0, bitmap.nbytes - chunk_bytes, chunks).astype(np.int64)
        sample = b"".join(bitmap[a : a + chunk_bytes].tobytes() for a in at)
    return len(zlib.compress(sample, 1)) < 0.8 * max(1, len(sample))


def gather_ledger(ledger: SampleLedger, rank: int, world: int, everywhere: bool = False) -> None:
    """Collective (a gather to rank 0): every rank's sample ids noted since the last
    gather, merged into rank 0's ledger; ``everywhere`` (a live run: any member may
    become rank 0), an all-gather merged into every rank's."""
    import torch.distributed as dist

    mine = ledger.take_pending()
    if everywhere:
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        ledger.merge(every)
        return
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if gathered is not None:
        ledger.merge(gathered)
