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


def ids_digest(ids: np.ndarray) -> int:
    """An order-free digest of a set of sample ids: the sum of a 31-bit mix of each id.
    A step's digest is the sum of its slices' (one all-reduce), the same at any world
    size; two steps with other rows differ but by chance (about 1 in 2^31)."""
    x = np.asarray(ids, dtype=np.int64).astype(np.uint64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's finaliser
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return int((x & np.uint64(0x7FFFFFFF)).sum(dtype=np.uint64))
