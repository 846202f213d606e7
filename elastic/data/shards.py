"""Parquet shard directories: listing, checks before Ray starts, converters' writes.

:func:`check_dataset` validates a split's shards from their footers (cheap for thousands
of shards); :func:`write_split` is how converters write one; :func:`locate_samples` and
:func:`damaged_shard` name the file behind a row or a read that broke training.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from elastic.data.footers import ID_COLUMN, Footer, FooterError, each_file, file_key, footers
from elastic.data.settings import DataConfig
from elastic.errors import ConfigError, exception_chain


def list_shards(path: str, key: str = "data.path") -> list[str]:
    """The sorted ``.parquet`` files of a directory, or a ConfigError naming the key."""
    if not os.path.exists(path):
        raise ConfigError(f"{key}={path} does not exist: point {key} at a directory of shards")
    if not os.path.isdir(path):
        raise ConfigError(f"{key}={path} is not a directory: point it at a directory of shards")
    files = []
    for entry in os.scandir(path):
        if not entry.name.endswith(".parquet") or entry.name.startswith("."):
            continue
        if not entry.is_file():  # a FIFO would block the read (and every signal) forever
            kind = "a directory" if entry.is_dir() else "not a regular file"
            raise ConfigError(
                f"{entry.path} is {kind}: a split holds Parquet files only; move it out of {key}"
            )
        files.append(entry.path)
    files.sort()
    if not files:
        raise ConfigError(
            f"{key}={path} holds no .parquet files: prepare the dataset there or fix the path"
        )
    return files


def locate_samples(path: str, ids: np.ndarray) -> dict[int, str]:
    """The shard file (name) that holds each of ``ids``: the Parquet footers' sample_id
    statistics narrow it to row groups, which are then read. For error messages only
    (a row that broke training): one directory's footers, never on the hot path."""
    wanted = {int(i) for i in ids}
    found: dict[int, str] = {}
    for file in list_shards(path):
        shard = pq.ParquetFile(file)
        meta = shard.metadata
        col = meta.schema.to_arrow_schema().get_field_index(ID_COLUMN)
        for g in range(meta.num_row_groups):
            stats = meta.row_group(g).column(col).statistics if col >= 0 else None
            if (
                stats is not None
                and stats.has_min_max
                and not any(stats.min <= i <= stats.max for i in wanted)
            ):
                continue
            ids_here = shard.read_row_group(g, columns=[ID_COLUMN])[ID_COLUMN]
            for i in set(ids_here.to_pylist()) & wanted:
                found[i] = os.path.basename(file)
        if len(found) == len(wanted):
            break
    return found


def damaged_shard(exc: BaseException, dirs: list[str | None]) -> str | None:
    """One line naming a shard that cannot be read, when ``exc`` (from reading the data)
    came from one: decided by reading the shard again here, in full, so a transient I/O
    error (gone on a re-read) is still retried like any other failure. A page that does
    not decode fails the same way on every retry: Ray Data retried it, then Ray Train
    restarted the worker group on it 11 times without naming the file."""
    text = "\n".join(str(e) for e in exception_chain(exc))
    if "parquet" not in text.lower() and "arrow" not in text.lower():
        return None
    named = re.findall(r"(?:Failed to read fragment|reading shard) (\S+?\.parquet)", text)
    files = list(dict.fromkeys(named)) or [
        f for d in dirs if d and os.path.isdir(d) for f in list_shards(d)
    ]
    for file in files:
        try:
            shard = pq.ParquetFile(file)
            for g in range(shard.metadata.num_row_groups):
                shard.read_row_group(g)
        except Exception as e:  # what pyarrow says is the message
            why = " ".join(str(e).split())[:200]
            return (
                f"shard {file} cannot be read ({why}): write it again (re-run the dataset's "
                "converter) or move it out of the dataset directory"
            )
    return None


def in_val(key: str, val_fraction: float, seed: int) -> bool:
    """Stable split: whether ``key`` (a file's path, a sample group) is held out depends
    only on the key and the seed, never on what else the dataset holds."""
    h = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(h[:8], "little") / 2**64 < val_fraction


# the only files a converter writes into a split directory
SHARD_NAME = re.compile(r"part-\d{5}\.parquet")


class OutputError(ValueError):
    """A converter's output directory that cannot be written (a file, or a directory
    holding Parquet files the converter did not write)."""


def check_split_dir(out: str | os.PathLike) -> str:
    """``out`` if a converter may write its split there: a directory (or a path to create)
    holding no ``.parquet`` file besides its own ``part-NNNNN.parquet``. Another Parquet
    file would be read as part of the dataset, and must not be deleted either."""
    d = os.fspath(out)
    existing = next(a for a in (Path(d), *Path(d).parents) if a.exists())
    if not existing.is_dir():
        raise OutputError(f"{existing} is a file, not a directory: give an output directory")
    if existing == Path(d):
        foreign = sorted(
            f
            for f in os.listdir(d)
            if f.endswith(".parquet") and not f.startswith(".") and not SHARD_NAME.fullmatch(f)
        )
        if foreign:
            raise OutputError(
                f"{d} holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}, "
                "not written by this converter: write to an empty directory or move them away"
            )
    return d


def write_split(table: pa.Table, out: str | os.PathLike, shards: int, seed: int) -> None:
    """A converter's split: ``table``'s rows in a seeded random order (inputs often come
    sorted by class or time; unmixed, a step would see one kind of sample) as up to
    ``shards`` files ``out/part-NNNNN.parquet``, replacing the split's old shards (and
    nothing else: see :func:`check_split_dir`). Each file is written under a temp name and
    renamed: a half-written shard never looks valid."""
    d = check_split_dir(out)
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create {d} ({e.strerror}): give a writable directory") from None
    for old in os.listdir(d):
        if SHARD_NAME.fullmatch(old):
            os.remove(os.path.join(d, old))
    mixed = table.take(np.random.default_rng(seed).permutation(table.num_rows))
    bounds = np.linspace(0, table.num_rows, max(1, min(shards, table.num_rows)) + 1).astype(int)
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        final = os.path.join(d, f"part-{i:05d}.parquet")
        tmp = os.path.join(d, f".part-{i:05d}.parquet.tmp")
        pq.write_table(mixed.slice(lo, hi - lo), tmp)
        os.replace(tmp, final)


@dataclass(frozen=True)
class Split:
    """A checked split: its shard files, rows, uncompressed bytes and each file's row
    groups' rows (from the footers)."""

    files: list[str]
    rows: int
    bytes: int
    row_groups: tuple[tuple[int, ...], ...] = ()


def check_dataset(cfg: DataConfig) -> dict[str, Split]:
    """Every shard opens and has the columns the run needs; returns the splits.

    Reads only Parquet footers, once a process and many at a time
    (:mod:`elastic.data.footers`).
    """
    required = (ID_COLUMN, cfg.input_column, cfg.target_column)
    checked = {}
    splits = [("train", "data.path", cfg.path)]
    if cfg.val_path:
        splits.append(("val", "data.val_path", cfg.val_path))
    first_types: dict[str, pa.DataType] | None = None
    first_file = ""
    for split, key, path in splits:
        rows = size = 0
        groups: list[tuple[int, ...]] = []
        files = list_shards(path, key)
        try:
            metas = footers(files)
        except FooterError as e:
            raise ConfigError(
                f"{e.path} is not a readable Parquet file ({str(e.cause).splitlines()[0]}): "
                "regenerate or remove it"
            ) from None
        for f, meta in zip(files, metas, strict=True):
            schema = meta.schema
            for col in required:
                if col not in schema.names:
                    raise ConfigError(
                        f"{f} has no column {col!r} (columns: {', '.join(schema.names)}): "
                        f"regenerate the shard or set data.input_column/data.target_column"
                    )
            types = {col: schema.field(col).type for col in required}
            if not pa.types.is_integer(types[ID_COLUMN]):
                raise ConfigError(
                    f"{f} has column {ID_COLUMN!r} of type {types[ID_COLUMN]}: it must hold "
                    "integer ids (int64), unique across the dataset; regenerate the shard"
                )
            if first_types is None:
                first_types, first_file = types, f
            for col, typ in types.items():
                if typ != first_types[col]:
                    raise ConfigError(
                        f"{f} has column {col!r} of type {typ}, {first_file} of type "
                        f"{first_types[col]}: every shard of a dataset needs the same schema"
                    )
            rows += meta.num_rows
            size += sum(meta.group_bytes)
            groups.append(meta.rows)
        if rows == 0:
            raise ConfigError(
                f"{key}={path} holds no rows ({len(files)} shard(s) of 0 rows): prepare the "
                f"dataset there{' or set data.val_path=null' if split == 'val' else ''}"
            )
        if split == "train":
            check_sample_ids(path, files, metas)
        checked[split] = Split(files, rows, size, tuple(groups))
    return checked


CHECK_READ_ROWS = 50_000_000
"""Up to this many rows, a column whose row-group statistics cannot prove what a check
needs is read (a split's ``sample_id`` to be unique, class labels to be in range:
8 bytes a row; ~1 s for 10^7 here)."""
_ids_checked: dict[tuple[Any, ...], bool] = {}


def check_sample_ids(path: str, files: list[str], metas: list[Footer]) -> bool:
    """``sample_id`` is unique across the split and not negative (the exactly-once
    ledger is a bitmap indexed by it; a duplicate would be trained twice an epoch and
    only counted): a :class:`ConfigError` naming an id and its shards otherwise.

    The row groups' statistics prove it where each group's ids are a run of consecutive
    numbers and the groups' ranges do not overlap (a split written in id order); else
    the ids are read, up to :data:`CHECK_READ_ROWS` rows. Returns whether the ids were
    checked (False: too many to read; the ledger counts duplicates as they are
    trained). Once a process for the same files."""
    key = tuple(file_key(f) for f in files)
    if key in _ids_checked:
        return _ids_checked[key]
    ranges = [r for m in metas for r in m.id_ranges]
    rows = [n for m in metas for n in m.rows]
    known = [r for r in ranges if r is not None]
    if known:
        _not_negative(path, min(low for low, _ in known))
    proven = len(known) == len(ranges) and _disjoint_runs(list(zip(known, rows, strict=True)))
    if not proven and sum(rows) <= CHECK_READ_ROWS:
        _duplicate_ids(path, files)
    _ids_checked[key] = proven or sum(rows) <= CHECK_READ_ROWS
    return _ids_checked[key]


def _not_negative(path: str, lowest: int) -> None:
    if lowest < 0:
        raise ConfigError(
            f"data.path={path} holds sample_id {lowest}: ids must be >= 0 (they index the "
            "exactly-once bitmap); rewrite the shards with ids from 0"
        )


def _disjoint_runs(groups: list[tuple[tuple[int, int], int]]) -> bool:
    """Whether every group ((low, high), rows) holds the ids low..high, each once (as
    many ids as rows in that range), and no two groups' ranges overlap."""
    if any(high - low + 1 != n for (low, high), n in groups if n):
        return False
    spans = sorted(r for r, n in groups if n)
    return all(b[0] > a[1] for a, b in zip(spans, spans[1:], strict=False))


def _duplicate_ids(path: str, files: list[str]) -> None:
    """Read every shard's ids; a ConfigError naming the first id found twice, its
    shards, or a negative id."""
    per_file = each_file(
        lambda f: pq.read_table(f, columns=[ID_COLUMN])[ID_COLUMN].to_numpy(), files
    )
    for f, part in zip(files, per_file, strict=True):
        if part.dtype.kind not in "iu":  # a null among the ids makes them floats
            raise ConfigError(
                f"{f} has rows without a {ID_COLUMN}: every row needs one; regenerate the shard"
            )
    ids = np.concatenate(per_file) if per_file else np.zeros(0, np.int64)
    if len(ids):
        _not_negative(path, int(ids.min()))
    ordered = np.sort(ids)
    twice = ordered[1:][ordered[1:] == ordered[:-1]]
    if len(twice):
        where = [os.path.basename(f) for f, i in zip(files, per_file, strict=True) if twice[0] in i]
        raise ConfigError(
            f"data.path={path} holds sample_id {twice[0]} more than once ({len(twice)} repeated "
            f"ids; this one in {', '.join(where)}): ids must be unique across the dataset "
            "(every sample is trained once an epoch by its id); rewrite the shards with unique ids"
        )


def split_warnings(cfg: DataConfig, max_workers: int, splits: dict[str, Split]) -> list[str]:
    """What in the splits will work, but not as a user likely means it: a training split
    smaller than one global batch, and splits with fewer row groups than workers (a row
    group is the unit a worker reads: see README "Bring your own dataset, model or task")."""
    out = []
    train = splits["train"]
    if train.rows < cfg.global_batch_size:
        out.append(
            f"data.path={cfg.path} holds {train.rows} rows, fewer than data.global_batch_size="
            f"{cfg.global_batch_size}: every step trains the whole epoch ({train.rows} rows)"
        )
    for name, key, what in (
        ("train", "data.path", "each of them reads (and decodes) whole row groups it shares"),
        ("val", "data.val_path", "the others have no validation rows and wait"),
    ):
        split = splits.get(name)
        groups = sum(len(g) for g in split.row_groups) if split else max_workers
        if split and groups < max_workers:
            out.append(
                f"{key}={os.path.dirname(split.files[0])} has {groups} row group(s) for up to "
                f"{max_workers} workers: {what}; write more, smaller row groups "
                "(pyarrow.parquet.write_table(..., row_group_size=ROWS))"
            )
    return out
