"""The exactly-once ledger against an independent count (Python sets), and its bitmaps'
round trip through a checkpoint's bytes, compressed or stored as they are."""

from __future__ import annotations

import io
import zipfile

import numpy as np

from elastic.train.accounting import SampleLedger


def test_merges_count_every_sample_once_and_every_repeat():
    """Ids repeated inside one merge, across ranks and across merges are counted as
    duplicates exactly as a set would see them; the bitmap holds exactly the set."""
    rng = np.random.default_rng(0)
    ledger, seen, repeats = SampleLedger(), set(), 0
    for _ in range(6):
        ids = rng.integers(0, 20_000, 7_000)  # many repeats, ids past the bitmap's end
        for i in ids.tolist():
            repeats += i in seen
            seen.add(i)
        ledger.merge(np.array_split(ids, 3))  # three ranks' notes
    assert ledger.trained == len(seen)
    assert ledger.duplicates == repeats
    assert ledger.trained_ids().tolist() == sorted(seen)
    assert ledger.contains(np.array(sorted(seen))).all()
    outside = np.array(sorted(set(range(20_000)) - seen))
    assert not ledger.contains(outside).any()


def test_bitmaps_round_trip_and_only_compressible_ones_are_deflated():
    """A closed epoch's bitmap (all ones) is deflated; the random bits of an epoch under
    way are stored as they are (deflating them saves nothing and took seconds); both
    read back exactly."""
    rng = np.random.default_rng(1)
    ledger = SampleLedger()
    ledger.merge([rng.permutation(1_000_000)[:500_000]])
    ledger.last_closed_bitmap = np.full(125_000, 255, np.uint8)
    data = ledger.bitmaps_bytes()
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        kinds = {i.filename: i.compress_type for i in z.infolist()}
    assert kinds == {"epoch.npy": zipfile.ZIP_STORED, "last_closed.npy": zipfile.ZIP_DEFLATED}
    back = SampleLedger()
    back.load_bitmaps(data)
    np.testing.assert_array_equal(back.bitmap, ledger.bitmap)
    np.testing.assert_array_equal(back.last_closed_bitmap, ledger.last_closed_bitmap)
    assert len(data) < ledger.bitmap.nbytes + 10_000  # the all-ones one costs ~nothing


def test_a_checkpoint_written_with_np_savez_compressed_still_loads():
    """Checkpoints written before the bitmaps were stored selectively load as before."""
    epoch = np.arange(256, dtype=np.uint8)
    buf = io.BytesIO()
    np.savez_compressed(buf, epoch=epoch, last_closed=np.zeros(3, np.uint8))
    ledger = SampleLedger()
    ledger.load_bitmaps(buf.getvalue())
    np.testing.assert_array_equal(ledger.bitmap, epoch)
