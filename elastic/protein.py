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

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from elastic.data import DataError, write_split


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


def _universe(topology: str, trajectory: str):
    mda = _mda()
    for f in (topology, trajectory):
        if not Path(f).is_file():
            raise ProteinError(f"{f} does not exist: give an existing topology and trajectory")
    try:
        return mda.Universe(topology, trajectory)
    except Exception as e:
        raise ProteinError(
            f"{trajectory} does not go with {topology} ({str(e).splitlines()[0]}): "
            "give a trajectory of the same system as its topology"
        ) from None


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
    ``topology``). Molecules split across a periodic box are made whole first (when the
    topology has bonds). Labels: ``rmsd_<name>`` per reference, ``rg``, ``rg_<name>`` per
    extra selection."""
    mda = _mda()
    from MDAnalysis.analysis import rms

    out = Path(out)
    refs = {}
    for name, path in (references or {}).items():
        if not Path(path).is_file():
            raise ProteinError(f"reference {name}={path} does not exist")
        refs[name] = mda.Universe(path).select_atoms(selection).positions.copy()
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
        u = _universe(topology, traj)
        atoms = u.select_atoms(selection)
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
            raise ProteinError(f"{traj} has no frames")
        if u.dimensions is not None and hasattr(u.atoms, "bonds") and len(u.atoms.bonds):
            # molecules split across the periodic box are made whole (only the molecules
            # holding the selected atoms: not the solvent)
            from MDAnalysis import transformations

            whole = sum(atoms.fragments[1:], atoms.fragments[0])
            u.trajectory.add_transformations(transformations.unwrap(whole))
        extras = {n: u.select_atoms(s) for n, s in (extra_selections or {}).items()}
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
    _write(out, columns, _metadata(residues, cutoff, selection, sources, references or {}), shards)
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


def _write(out: Path, columns: dict[str, list], meta: dict, shards: int) -> None:
    types = {"sample_id": pa.int64(), "trajectory": pa.int32(), "frame": pa.int32()}
    types.update(contacts=pa.binary(), distances=pa.binary())
    table = pa.table({k: pa.array(v, types.get(k, pa.float32())) for k, v in columns.items()})
    # frames come in time order: write_split mixes them (seeded)
    write_split(table.replace_schema_metadata(meta), out, shards, seed=0)


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
    meta = pq.read_schema(shard).metadata or {}
    value = meta.get(b"elastic.contact_bits")
    return int(value) if value else None


def decode_contacts(
    batch: pa.Table, input_column: str, target_column: str, width: int
) -> dict[str, np.ndarray]:
    """Bit-packed contact maps -> float32 [N, width] of 0/1; the label as float32."""
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
        "x": unpack_contacts(packed, width),
        "y": batch[target_column].to_numpy().astype(np.float32, copy=False),
    }
