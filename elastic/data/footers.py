"""Parquet footers, each read once per process while its file is unchanged, many at a
time.

The checks before Ray starts read every shard's footer: the schema and row groups
(:func:`elastic.data.shards.check_dataset`), the labels' range, a format's width (a
contact map's bits), then the driver's data preparation again: two or three reads of
each footer, one after the other, ~0.3 s a read for every 1,000 shards on this
machine and far more where opening a file costs milliseconds (a parallel filesystem
holding 10^5 shards). Here a footer is read once, kept as the little every caller needs
(a :class:`Footer`; pyarrow's own object holds ~35 KB of memory), and files are read by
:data:`THREADS` threads at once so that one file's latency hides another's. The labels'
range (row-group statistics) is read apart, for the datasets whose checks need it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

ID_COLUMN = "sample_id"
"""Every row's stable id, an int64 column unique across the dataset."""
THREADS = 16
T = TypeVar("T")


@dataclass(frozen=True)
class Footer:
    """What the checks and the read plan need of one shard's footer."""

    schema: pa.Schema
    """The Arrow schema with the file's metadata (one object for shards written alike)."""
    rows: tuple[int, ...]
    """Rows of each row group."""
    group_bytes: tuple[int, ...]
    """Uncompressed bytes of each row group."""
    id_ranges: tuple[tuple[int, int] | None, ...] = ()
    """Each row group's smallest and largest ``sample_id`` from its statistics (None:
    no statistics, or no such column)."""
    digest: str = ""
    """sha256 of the footer's bytes: the row groups' sizes, offsets and statistics, and
    the key-value metadata. A shard written again with other rows or values has another
    (a resume compares them: :func:`elastic.data.reader.data_changes`)."""

    @property
    def num_rows(self) -> int:
        return sum(self.rows)


class FooterError(Exception):
    """A file whose footer cannot be read; ``path`` names it, ``cause`` says why."""

    def __init__(self, path: str, cause: BaseException) -> None:
        super().__init__(f"{path}: {cause}")
        self.path, self.cause = path, cause


_cache: dict[tuple[str, int, int, int], Footer] = {}
_ranges: dict[tuple[Any, ...], tuple[int, int] | None] = {}
_schemas: dict[bytes, pa.Schema] = {}


def _read(path: str) -> Footer:
    try:
        raw = _footer_bytes(path)
        meta = pq.read_metadata(pa.BufferReader(raw))
    except (pa.ArrowException, OSError, ValueError) as e:
        raise FooterError(path, e) from None
    schema = meta.schema.to_arrow_schema()
    schema = _schemas.setdefault(schema.serialize().to_pybytes(), schema)
    groups = [meta.row_group(g) for g in range(meta.num_row_groups)]
    ids = schema.get_field_index(ID_COLUMN)
    if ids >= 0 and not pa.types.is_integer(schema.field(ids).type):
        ids = -1  # no integer ids to range (the dataset check refuses the shard)
    return Footer(
        schema,
        tuple(g.num_rows for g in groups),
        tuple(g.total_byte_size for g in groups),
        tuple(_min_max(g.column(ids).statistics) if ids >= 0 else None for g in groups),
        hashlib.sha256(raw).hexdigest(),
    )


def _footer_bytes(path: str) -> bytes:
    """The file's footer as a Parquet file of its own (magic, metadata, its length,
    magic): what ``pq.read_metadata`` reads, read once, and hashed as it is."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if size < 12:
            raise ValueError(f"{size} bytes: too short for a Parquet file")
        f.seek(size - 8)
        tail = f.read(8)
        length = int.from_bytes(tail[:4], "little")
        if tail[4:] != b"PAR1" or length > size - 12:
            raise ValueError("no Parquet footer at the end of the file")
        f.seek(size - 8 - length)
        return b"PAR1" + f.read(length) + tail


def _min_max(stats: Any) -> tuple[int, int] | None:
    if stats is None or not stats.has_min_max:
        return None
    return int(stats.min), int(stats.max)


def file_key(path: str) -> tuple[str, int, int, int]:
    """A file as it is now: a shard rewritten or replaced has another key."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise FooterError(path, e) from None
    return os.path.abspath(path), st.st_ino, st.st_size, st.st_mtime_ns


def footer(path: str) -> Footer:
    """``path``'s footer, read once while the file keeps its inode, size and modification
    time."""
    key = file_key(path)
    found = _cache.get(key)
    if found is None:
        found = _cache[key] = _read(path)
    return found


def integer_range(path: str, column: str) -> tuple[int, int] | None:
    """The smallest and largest value of integer column ``column`` in ``path``, from its
    row-group statistics (None when a row group has none, or there is no such column):
    read only for the checks that ask (class labels), once while the file is unchanged."""
    key = (*file_key(path), column)
    if key not in _ranges:
        meta = pq.read_metadata(path)
        index = meta.schema.to_arrow_schema().get_field_index(column)
        low = high = None
        for g in range(meta.num_row_groups) if index >= 0 else ():
            stats = meta.row_group(g).column(index).statistics
            if stats is None or not stats.has_min_max:
                low = high = None
                break
            low = stats.min if low is None else min(low, stats.min)
            high = stats.max if high is None else max(high, stats.max)
        _ranges[key] = None if low is None or high is None else (int(low), int(high))
    return _ranges[key]


def each_file(read: Callable[[str], T], files: list[str]) -> list[T]:
    """``read`` of every file, in order, :data:`THREADS` files at a time."""
    if len(files) <= 1:
        return [read(f) for f in files]
    with ThreadPoolExecutor(min(THREADS, len(files))) as pool:
        return list(pool.map(read, files))


def footers(files: list[str]) -> list[Footer]:
    """Every file's footer, in order; the first file (in order) that cannot be read
    raises :class:`FooterError`. Footers already read are taken as they are; only the
    others go to the threads."""
    keys = [file_key(f) for f in files]
    missing = [f for f, k in zip(files, keys, strict=True) if k not in _cache]
    each_file(footer, missing)
    return [_cache[k] if k in _cache else footer(f) for f, k in zip(files, keys, strict=True)]


def read_integer_range(path: str, column: str) -> tuple[int, int] | None:
    """The smallest and largest value of integer column ``column`` in ``path``, read from
    the column itself (for a shard without statistics), once while the file is
    unchanged; None when it holds no value."""
    import pyarrow.compute as pc

    key = (*file_key(path), column, "read")
    if key not in _ranges:
        found = pc.min_max(pq.read_table(path, columns=[column])[column])
        low, high = found["min"].as_py(), found["max"].as_py()
        _ranges[key] = None if low is None or high is None else (int(low), int(high))
    return _ranges[key]


def integer_ranges(files: list[str], column: str) -> list[tuple[int, int] | None]:
    """:func:`integer_range` of every file, in order."""
    return each_file(lambda f: integer_range(f, column), files)
