"""Sets of sample ids as packed bitmaps (1 bit per id: 12.5 MB for 10^8 samples)."""

from __future__ import annotations

import numpy as np


def bitmap_contains(bitmap: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Which ``ids`` have their bit set in a packed (big-endian bit order) bitmap."""
    byte = ids >> 3
    inside = byte < bitmap.shape[0]
    out = np.zeros(ids.shape, dtype=bool)
    out[inside] = (bitmap[byte[inside]] >> (7 - (ids[inside] & 7))) & 1 == 1
    return out
