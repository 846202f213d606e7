"""Protein dynamics: MD trajectories -> Parquet shards of C-alpha contact maps + labels.

Any topology + trajectories MDAnalysis reads. Per frame: the contact map of the selected
atoms (pairs closer than ``cutoff`` angstrom, upper triangle, bit-packed: 214 residues =
22,791 bits = 2.8 kB), optionally the distance map, labels (RMSD to each reference
structure after superposition, radius of gyration, optional extra selections' radius of
gyration), trajectory and frame ids, ``sample_id``. The residue count, cutoff, selection
and sources go into the Parquet schema metadata. Decoded to 0/1 float vectors in Ray
Data (``data.format=contacts``). Needs the ``protein`` extra (MDAnalysis).
"""

from __future__ import annotations

import functools
import gc
import json
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from elastic.data.footers import footer
from elastic.data.formats import DataFormat, register_format
from elastic.data.shards import OutputError, check_split_dir, write_split
from elastic.errors import ConfigError, DataError


class ProteinError(ValueError):
    """A one-line, user-facing problem with a topology, trajectory or reference."""


@dataclass(frozen=True)
class Converted:
    rows: int
    residues: int
    trajectories: int


def _mda():
    try:
        import MDAnalysis
    except ImportError:
        raise ProteinError("protein data needs MDAnalysis: pip install -e '.[protein]'") from None
    warnings.filterwarnings("ignore", module="MDAnalysis")
    return MDAnalysis


def contact_bits(positions: np.ndarray, cutoff: float) -> tuple[np.ndarray, np.ndarray]:
    """Upper-triangle (i < j) contacts of ``positions`` [N, 3], bit-packed, and the
    upper-triangle distances (float16)."""
    d = np.sqrt(((positions[:, None, :] - positions[None, :, :]) ** 2).sum(-1))
    iu = np.triu_indices(len(positions), k=1)
    upper = d[iu]
    return np.packbits(upper < cutoff), upper.astype(np.float16)


def unpack_contacts(packed: np.ndarray, n_bits: int) -> np.ndarray:
    """[rows, bytes] uint8 -> [rows, n_bits] float32 of 0/1."""
    return np.unpackbits(packed, axis=1, count=n_bits).astype(np.float32)


def _load(what: str, *files: str):
    """A Universe of ``files``, or a one-line ProteinError; ``what`` names the fix."""
    mda = _mda()
    for f in files:
        if not Path(f).is_file():
            raise ProteinError(f"{f} does not exist: give an existing {what}")
    if len(files) > 1 and Path(files[-1]).stat().st_size == 0:
        raise ProteinError(f"{files[-1]} has no frames: give a trajectory with frames")
    # a reader that fails half-built complains from its __del__ when collected ("Exception
    # ignored in ..."): collect it while unraisable exceptions are muted
    hook = sys.unraisablehook
    sys.unraisablehook = lambda _: None
    try:
        try:
            return mda.Universe(*files)
        except Exception as e:
            problem = (str(e).strip().splitlines() or [type(e).__name__])[0]
        gc.collect()
    finally:
        sys.unraisablehook = hook
    if len(files) > 1 and any(s in problem for s in ("No frames", "endoffile", "empty file")):
        raise ProteinError(f"{files[-1]} has no frames ({problem}): give a trajectory with frames")
    if len(files) > 1:
        raise ProteinError(
            f"{files[-1]} does not go with {files[0]} ({problem}): "
            "give a trajectory of the same system as its topology"
        )
    raise ProteinError(
        f"{files[0]} cannot be read ({problem}): give a {what} in a format MDAnalysis reads"
    )


def _select(u, selection: str, what: str, source: str):
    try:
        return u.select_atoms(selection)
    except Exception as e:  # SelectionError, or ValueError for a bad value
        raise ProteinError(
            f"{what} {selection!r} is not a valid MDAnalysis selection in {source} "
            f"({str(e).strip()}): fix the selection"
        ) from None


def _make_whole(u, groups: list, source: str) -> None:
    """Every frame read from ``u`` has the molecules holding ``groups`` whole (a periodic
    box splits them: the raw C-alpha chain jumps by a box length, and radius of gyration,
    RMSD and contacts come out wrong). Bonds come from the topology or, where it has none
    (a .gro, a .pdb), are guessed from the first frame with periodic distances."""
    if u.dimensions is None:
        return
    from MDAnalysis import transformations
    from MDAnalysis.guesser.default_guesser import DefaultGuesser

    atoms = sum(groups[1:], groups[0]).unique
    if not _bonded(atoms).all():
        residues = atoms.residues.atoms
        try:
            guesser = DefaultGuesser(None, box=u.dimensions)
            u.add_bonds(guesser.guess_bonds(residues, residues.positions), guessed=True)
        except ValueError as e:
            raise ProteinError(
                f"{source} has no bonds and a periodic box, and its bonds cannot be guessed "
                f"({str(e).splitlines()[0]}): give a topology with bonds (the run's .tpr, .psf)"
            ) from None
    lone = atoms[~_bonded(atoms)]
    if len(lone):
        raise ProteinError(
            f"{source} has a periodic box but no bonds to atom {lone[0].name} of residue "
            f"{lone[0].resname}{lone[0].resid}, so its molecule cannot be made whole: "
            "give a topology with bonds (the run's .tpr, .psf)"
        )
    whole = sum(atoms.fragments[1:], atoms.fragments[0])
    u.trajectory.add_transformations(transformations.unwrap(whole))


def _bonded(atoms) -> np.ndarray:
    """Per atom: whether it has a bond."""
    if not hasattr(atoms, "bonds"):
        return np.zeros(len(atoms), bool)
    return np.isin(atoms.ix, atoms.bonds.to_indices())


def convert(
    topology: str,
    trajectories: list[str],
    out: str | Path,
    references: dict[str, str] | None = None,
    cutoff: float = 8.0,
    selection: str = "name CA",
    distances: bool = False,
    extra_selections: dict[str, str] | None = None,
    shards: int = 4,
    first_sample_id: int = 0,
) -> Converted:
    """Write ``out/part-*.parquet`` for the frames of ``trajectories`` (each read with
    ``topology``). Molecules split across a periodic box are made whole first, in the
    references too. Labels: ``rmsd_<name>`` per reference, ``rg``, ``rg_<name>`` per extra
    selection."""
    if not trajectories:
        raise ProteinError("no trajectories given: give one or more with the topology")
    _check_settings(out, cutoff, shards, first_sample_id)
    _mda()
    from MDAnalysis.analysis import rms

    refs = {}
    for name, path in (references or {}).items():
        r = _load(f"structure for reference {name}", path)
        ref_atoms = _select(r, selection, "selection", path)
        if len(ref_atoms):
            _make_whole(r, [ref_atoms], f"reference {name}={path}")
        refs[name] = ref_atoms.positions.copy()
    columns: dict[str, list] = {
        k: [] for k in ("sample_id", "trajectory", "frame", "contacts", "rg")
    }
    if distances:
        columns["distances"] = []
    for name in refs:
        columns[f"rmsd_{name}"] = []
    for name in extra_selections or {}:
        columns[f"rg_{name}"] = []
    residues = None
    sid = first_sample_id
    for t, traj in enumerate(trajectories):
        u = _load("topology and trajectory", topology, traj)
        atoms = _select(u, selection, "selection", topology)
        if len(atoms) < 2:
            raise ProteinError(f"selection {selection!r} picks {len(atoms)} atoms in {topology}")
        if residues is None:
            residues = len(atoms)
        elif len(atoms) != residues:
            raise ProteinError(
                f"{traj} has {len(atoms)} atoms in {selection!r}, the trajectories before it "
                f"{residues}: contact maps of different sizes cannot share a dataset"
            )
        for name, ref in refs.items():
            if len(ref) != residues:
                raise ProteinError(
                    f"reference {name} has {len(ref)} atoms in {selection!r}, "
                    f"{topology} {residues}: give a reference of the same protein"
                )
        if len(u.trajectory) == 0:
            raise ProteinError(f"{traj} has no frames: give a trajectory with frames")
        extras = {}
        for name, sel in (extra_selections or {}).items():
            extras[name] = _select(u, sel, f"rg selection {name}", topology)
            if not len(extras[name]):
                raise ProteinError(
                    f"rg selection {name}={sel!r} picks no atoms in {topology}: fix the selection"
                )
        _make_whole(u, [atoms, *extras.values()], topology)
        for ts in u.trajectory:
            pos = atoms.positions
            bits, dist = contact_bits(pos, cutoff)
            columns["sample_id"].append(sid)
            columns["trajectory"].append(t)
            columns["frame"].append(ts.frame)
            columns["contacts"].append(bits.tobytes())
            columns["rg"].append(float(atoms.radius_of_gyration()))
            if distances:
                columns["distances"].append(dist.tobytes())
            for name, ref in refs.items():
                columns[f"rmsd_{name}"].append(float(rms.rmsd(pos, ref, superposition=True)))
            for name, group in extras.items():
                columns[f"rg_{name}"].append(float(group.radius_of_gyration()))
            sid += 1
    assert residues is not None
    sources = {"topology": topology, "trajectories": trajectories}
    meta = _metadata(residues, cutoff, selection, sources, references or {})
    _write(Path(out), columns, meta, shards)
    return Converted(len(columns["sample_id"]), residues, len(trajectories))


def _metadata(residues: int, cutoff: float, selection: str, sources: dict, refs: dict) -> dict:
    return {
        b"elastic.format": b"contacts",
        b"elastic.residues": str(residues).encode(),
        b"elastic.contact_bits": str(residues * (residues - 1) // 2).encode(),
        b"elastic.cutoff_angstrom": str(cutoff).encode(),
        b"elastic.selection": selection.encode(),
        b"elastic.sources": json.dumps(sources).encode(),
        b"elastic.references": json.dumps(refs).encode(),
    }


def _check_settings(out: str | Path, cutoff: float, shards: int, first_sample_id: int) -> None:
    """Refuse settings that would write a useless dataset, before any work is done."""
    if not 0 < cutoff < math.inf:
        # nan, 0 or below: no pair is in contact; inf: every pair is
        raise ProteinError(f"cutoff {cutoff} is not valid: give a contact distance > 0 (angstrom)")
    if shards < 1:
        raise ProteinError(f"shards {shards} is not valid: give 1 or more")
    if first_sample_id < 0:
        raise ProteinError(f"first sample id {first_sample_id} is not valid: give 0 or more")
    try:
        check_split_dir(out)
    except OutputError as e:
        raise ProteinError(str(e)) from None


def _write(out: Path, columns: dict[str, list], meta: dict, shards: int) -> None:
    types = {"sample_id": pa.int64(), "trajectory": pa.int32(), "frame": pa.int32()}
    types.update(contacts=pa.binary(), distances=pa.binary())
    table = pa.table({k: pa.array(v, types.get(k, pa.float32())) for k, v in columns.items()})
    try:
        # frames come in time order: write_split mixes them (seeded)
        write_split(table.replace_schema_metadata(meta), out, shards, seed=0)
    except OutputError as e:
        raise ProteinError(str(e)) from None


def kabsch_rmsd(a: np.ndarray, b: np.ndarray) -> float:
    """RMSD of two [N, 3] structures after optimal superposition."""
    a, b = a - a.mean(0), b - b.mean(0)
    u, _, vt = np.linalg.svd(a.T @ b)
    d = np.sign(np.linalg.det(u @ vt))
    r = u @ np.diag([1.0, 1.0, d]) @ vt
    return float(np.sqrt(((a @ r - b) ** 2).sum(1).mean()))


def synthetic(
    out: str | Path,
    frames: int,
    residues: int = 214,
    cutoff: float = 8.0,
    seed: int = 0,
    shards: int = 4,
    first_sample_id: int = 0,
) -> Converted:
    """Contact-map shards of the converter's schema without MDAnalysis, for scale tests:
    a chain of C-alphas (3.8 A apart) morphing between a compact "closed" and an
    extended "open" fold, with thermal noise; labels rmsd_open, rmsd_closed, rg."""
    _check_settings(out, cutoff, shards, first_sample_id)
    if frames < 1 or residues < 2:
        raise ProteinError(
            f"{frames} frames of {residues} residues: give frames >= 1, residues >= 2"
        )
    rng = np.random.default_rng(seed)

    def chain(stiffness: float) -> np.ndarray:
        steps = rng.normal(size=(residues, 3))
        steps[1:] += stiffness * steps[:-1]  # correlated steps: more extended
        steps *= 3.8 / np.linalg.norm(steps, axis=1, keepdims=True)
        return np.cumsum(steps, 0)

    closed, opened = chain(0.0), chain(2.0)
    columns: dict[str, list] = {
        k: []
        for k in ("sample_id", "trajectory", "frame", "contacts", "rg", "rmsd_open", "rmsd_closed")
    }
    for f in range(frames):
        t = rng.random()
        pos = (1 - t) * closed + t * opened + rng.normal(scale=0.5, size=closed.shape)
        bits, _ = contact_bits(pos, cutoff)
        columns["sample_id"].append(first_sample_id + f)
        columns["trajectory"].append(0)
        columns["frame"].append(f)
        columns["contacts"].append(bits.tobytes())
        columns["rg"].append(float(np.sqrt(((pos - pos.mean(0)) ** 2).sum(1).mean())))
        columns["rmsd_open"].append(kabsch_rmsd(pos, opened))
        columns["rmsd_closed"].append(kabsch_rmsd(pos, closed))
    sources = {"synthetic": {"frames": frames, "residues": residues, "seed": seed}}
    refs = {"open": "synthetic", "closed": "synthetic"}
    _write(
        Path(out),
        columns,
        _metadata(residues, cutoff, "synthetic C-alpha chain", sources, refs),
        shards,
    )
    return Converted(frames, residues, 1)


def contact_width(shard: str) -> int | None:
    """Bits of a contact map in a contacts shard (from its metadata), else None."""
    meta = footer(shard).schema.metadata or {}
    value = meta.get(b"elastic.contact_bits")
    return int(value) if value else None


def decode_contacts(
    batch: pa.Table, input_column: str, target_column: str, width: int
) -> dict[str, np.ndarray]:
    """Bit-packed contact maps -> uint8 [N, ceil(width / 8)], still packed (a step's rows
    are unpacked in the training worker: :meth:`ContactsFormat.finisher`); the label as
    float32."""
    column = batch[input_column].combine_chunks()
    n = len(column)
    nbytes = (width + 7) // 8
    flat = np.frombuffer(column.buffers()[2], dtype=np.uint8)
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int32)[
        column.offset : column.offset + n + 1
    ]
    if n and not np.all(np.diff(offsets) == nbytes):
        raise DataError(
            f"contact maps of different sizes in one batch (expected {nbytes} bytes a map): "
            "every shard of a dataset needs the same protein"
        )
    packed = (
        flat[offsets[0] : offsets[0] + n * nbytes].reshape(n, nbytes)
        if n
        else np.zeros((0, nbytes), np.uint8)
    )
    return {
        "sample_id": batch["sample_id"].to_numpy().astype(np.int64, copy=False),
        "x": packed,
        "y": batch[target_column].to_numpy().astype(np.float32, copy=False),
    }


class ContactsFormat(DataFormat):
    """``data.format=contacts``: bit-packed contact maps (:func:`convert`), kept packed
    through Ray Data, the object store and the worker's cache (a row is 1/32 of its
    float32 map) and unpacked to 0/1 vectors a step at a time in the training worker;
    every shard of both splits must hold maps of one size."""

    name = "contacts"
    description = "bit-packed contact maps written by datasets/protein/prepare.py"

    def decoder(self, cfg: Any, shard: str) -> tuple[Any, dict[str, Any]]:
        return decode_contacts, {"width": contact_width(shard)}

    def finisher(self, cfg: Any, shard: str) -> Any:
        width = contact_width(shard)
        assert width is not None, f"{shard} is not a contact-map shard"
        return functools.partial(unpack_contacts, n_bits=width)

    def input_width(self, cfg: Any, files: list[str]) -> int | None:
        widths = [contact_width(f) for f in files]
        for f, width in zip(files, widths, strict=True):
            if width is None:
                raise ConfigError(
                    f"{f} is not a contact-map shard (no elastic.contact_bits metadata): "
                    "write it with datasets/protein/prepare.py or set data.format"
                )
            if width != widths[0]:
                raise ConfigError(
                    f"{f} holds contact maps of {width} bits, {files[0]} of {widths[0]}: "
                    "proteins of different residue counts cannot share a dataset"
                )
        return widths[0]

    def missing_hint(self, cfg: Any) -> str | None:
        return (
            "convert trajectories with python datasets/protein/prepare.py (--adk OUT: the example)"
        )


register_format(ContactsFormat())
