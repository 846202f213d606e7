"""Read a W&B offline run file (``run-<id>.wandb``) record by record.

wandb 0.31 no longer ships a Python reader for its transaction log; the format is
LevelDB's log format (32 KiB blocks; 7-byte chunk headers: crc32, length, type) behind a
7-byte file header, and each record is a ``wandb_internal_pb2.Record`` protobuf, which we
parse with wandb's own generated classes.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from collections.abc import Iterator
from typing import Any

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32 * 1024
FILE_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str) -> Iterator[Any]:
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, parts = FILE_HEADER, b""
    while pos + 7 <= len(data):
        room = BLOCK - pos % BLOCK
        if room < 7:  # block trailer padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            parts = payload
        elif kind == FIRST:
            parts = payload
            continue
        elif kind == MIDDLE:
            parts += payload
            continue
        elif kind == LAST:
            parts += payload
        else:
            break  # zero padding at the end of a file that is still open
        rec = pb.Record()
        rec.ParseFromString(parts)
        yield rec


def history(run_dir: str) -> list[dict[str, Any]]:
    """Every logged history row of the offline run in ``run_dir`` (the offline-run-* dir)."""
    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append(
                {
                    (item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                    for item in rec.history.item
                }
            )
    return rows
