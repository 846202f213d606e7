"""Electron diffraction: convergent-beam electron diffraction (CBED) patterns of cubic
crystals, simulated with abTEM's multislice, as Parquet shards.

For each crystal, probe positions are drawn inside the unit cell and one multislice
run per position gives the pattern at every thickness of a series (exit planes), so a
pattern costs ~0.1 s of a core. Patterns are resampled onto one angular grid (mrad) for
every crystal, so one CNN sees them all. Labels: structure type, material, thickness and
the projected potential under the probe (the inverse problem of the Summit work).

Generation runs as Ray tasks on a local Ray cluster of its own. Needs the ``cbed``
extra (abTEM, ASE); :func:`synthetic` writes the same schema without them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from elastic.data.shards import in_val, write_split

STRUCTURES = ("diamond", "fcc", "bcc", "rocksalt", "zincblende", "perovskite")
# material -> (structure type, lattice constant in A); all cubic, viewed along [001]
MATERIALS: dict[str, tuple[str, float]] = {
    "Si": ("diamond", 5.431),
    "Ge": ("diamond", 5.658),
    "C": ("diamond", 3.567),
    "Cu": ("fcc", 3.615),
    "Au": ("fcc", 4.078),
    "Al": ("fcc", 4.050),
    "Fe": ("bcc", 2.870),
    "W": ("bcc", 3.165),
    "Mo": ("bcc", 3.147),
    "MgO": ("rocksalt", 4.212),
    "NaCl": ("rocksalt", 5.640),
    "GaAs": ("zincblende", 5.653),
    "ZnS": ("zincblende", 5.410),
    "SrTiO3": ("perovskite", 3.905),
    "BaTiO3": ("perovskite", 4.000),
}
THICKNESS_UNIT_NM = 10.0
"""The ``target`` column holds thickness in units of 10 nm (O(1) for a regression head)."""
PATCH = 16
PATCH_SPAN_A = 3.2
"""The ``potential`` label: PATCH x PATCH samples of the projected potential over a
PATCH_SPAN_A square centred on the probe."""


class CBEDError(ValueError):
    """A one-line, user-facing problem with the CBED generator's input."""


@dataclass(frozen=True)
class Settings:
    """The microscope and the sampling (all patterns of a dataset share them)."""

    energy_kev: float = 200.0
    semiangle_mrad: float = 10.0
    size: int = 64
    """Pattern pixels a side, on a grid spanning +-max_angle_mrad."""
    max_angle_mrad: float = 32.0
    extent_a: float = 24.0
    """Lateral supercell size (A); sets the angular sampling before resampling."""
    sampling_a: float = 0.1
    thickness_step_nm: float = 2.5
    max_thickness_nm: float = 20.0

    def metadata(self) -> dict[bytes, bytes]:
        return {
            b"elastic.format": b"cbed",
            b"elastic.structures": json.dumps(STRUCTURES).encode(),
            b"elastic.pattern_size": str(self.size).encode(),
            b"elastic.max_angle_mrad": str(self.max_angle_mrad).encode(),
            b"elastic.energy_kev": str(self.energy_kev).encode(),
            b"elastic.semiangle_mrad": str(self.semiangle_mrad).encode(),
            b"elastic.thickness_unit_nm": str(THICKNESS_UNIT_NM).encode(),
            b"elastic.potential_patch": json.dumps([PATCH, PATCH_SPAN_A]).encode(),
        }


def crystal(material: str) -> Any:
    """The cubic unit cell of ``material`` as ASE Atoms."""
    from ase import Atoms
    from ase.build import bulk

    structure, a = MATERIALS[material]
    if structure == "perovskite":
        a_site, b_site = material[:2], material[2:4]
        return Atoms(
            f"{a_site}{b_site}O3",
            scaled_positions=[
                (0, 0, 0),
                (0.5, 0.5, 0.5),
                (0.5, 0.5, 0),
                (0.5, 0, 0.5),
                (0, 0.5, 0.5),
            ],
            cell=[a, a, a],
            pbc=True,
        )
    return bulk(material, structure, a=a, cubic=True)


def _resample_matrix(coords: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Linear-interpolation weights from samples at ``coords`` to ``targets`` (zero
    outside), as a [len(targets), len(coords)] matrix."""
    eye = np.eye(len(coords))
    return np.stack([np.interp(targets, coords, row, left=0, right=0) for row in eye], axis=1)


def _patch(projected: np.ndarray, cell_a: float, positions: np.ndarray) -> np.ndarray:
    """PATCH x PATCH samples of one unit cell's projected potential (periodic), centred
    on each probe position: [n, PATCH * PATCH] float32."""
    from scipy.ndimage import map_coordinates

    offsets = (np.arange(PATCH) - (PATCH - 1) / 2) * (PATCH_SPAN_A / PATCH)
    gx, gy = np.meshgrid(offsets, offsets, indexing="ij")
    scale = projected.shape[0] / cell_a
    out = np.empty((len(positions), PATCH * PATCH), np.float32)
    for i, (x, y) in enumerate(positions):
        coords = np.stack([((x + gx) % cell_a) * scale, ((y + gy) % cell_a) * scale])
        out[i] = map_coordinates(projected, coords, order=1, mode="grid-wrap").ravel()
    return out


def simulate(material: str, positions: int, seed: int, settings: Settings) -> dict[str, Any]:
    """CBED patterns of ``material`` at ``positions`` probe positions (uniform in the unit
    cell, from ``seed``) x every thickness of the series. Columns as in the shards,
    without sample_id; rows ordered by position then thickness."""
    import abtem
    import dask

    abtem.config.set({"device": "cpu", "diagnostics.progress_bar": False})
    s = settings
    unit = crystal(material)
    a = float(unit.cell[0, 0])
    nxy = math.ceil(s.extent_a / a)
    cells_per_step = max(1, round(s.thickness_step_nm * 10 / a))
    steps = max(1, round(s.max_thickness_nm * 10 / (cells_per_step * a)))
    atoms = unit * (nxy, nxy, cells_per_step * steps)
    potential = abtem.Potential(
        atoms,
        sampling=s.sampling_a,
        slice_thickness=a / 2,
        projection="infinite",
        exit_planes=2 * cells_per_step,
    )
    probe = abtem.Probe(energy=s.energy_kev * 1e3, semiangle_cutoff=s.semiangle_mrad)
    probe.grid.match(potential)
    rng = np.random.default_rng(seed)
    xy = rng.uniform(0, a, size=(positions, 2))
    scan = abtem.CustomScan(xy + a * (nxy // 2))  # probe away from the supercell edge
    with dask.config.set(scheduler="synchronous"):  # one core per Ray task
        waves: Any = probe.multislice(potential, scan=scan)
        dp = waves.diffraction_patterns(max_angle=s.max_angle_mrad * 1.2).compute()
        one_cell: Any = abtem.Potential(unit, sampling=s.sampling_a, projection="infinite")
        projected = np.asarray(one_cell.project().compute().array, dtype=np.float64)
    patterns = np.asarray(dp.array, dtype=np.float64)[1:]  # [thickness, position, kx, ky]
    thickness_nm = np.arange(1, steps + 1) * cells_per_step * a / 10
    # resample onto the common angular grid (mrad), the zero angle at pixel n // 2
    target = np.linspace(-s.max_angle_mrad, s.max_angle_mrad, s.size)
    mats = []
    for axis, step in enumerate(dp.angular_sampling):
        n = patterns.shape[2 + axis]
        mats.append(_resample_matrix((np.arange(n) - n // 2) * step, target))
    grid = np.einsum("ia,tpab,jb->ptij", mats[0], patterns, mats[1])
    grid /= grid.sum(axis=(2, 3), keepdims=True)  # each pattern sums to 1 (dose-free)
    n_rows = positions * steps
    patch = _patch(projected, a, xy)
    structure = STRUCTURES.index(MATERIALS[material][0])
    thick = np.tile(thickness_nm, positions).astype(np.float32)
    return {
        "pattern": grid.reshape(n_rows, s.size * s.size).astype(np.float32),
        "structure": np.full(n_rows, structure, np.int32),
        "material": [material] * n_rows,
        "thickness_nm": thick,
        "probe_xy": np.repeat(xy, steps, axis=0).astype(np.float32),
        "potential": np.repeat(patch, steps, axis=0),
        "target": np.stack(
            [np.full(n_rows, structure, np.float32), thick / THICKNESS_UNIT_NM], axis=1
        ),
    }


def _fixed(values: np.ndarray) -> pa.FixedSizeListArray:
    values = np.ascontiguousarray(values)
    return pa.FixedSizeListArray.from_arrays(pa.array(values.ravel()), values.shape[1])


def to_table(columns: dict[str, Any], first_id: int, settings: Settings) -> pa.Table:
    n = len(columns["structure"])
    return pa.table(
        {
            "sample_id": pa.array(np.arange(first_id, first_id + n), pa.int64()),
            "pattern": _fixed(columns["pattern"]),
            "structure": pa.array(columns["structure"], pa.int32()),
            "material": pa.array(columns["material"], pa.string()),
            "thickness_nm": pa.array(columns["thickness_nm"], pa.float32()),
            "probe_xy": _fixed(columns["probe_xy"]),
            "potential": _fixed(columns["potential"]),
            "target": _fixed(columns["target"]),
        }
    ).replace_schema_metadata(settings.metadata())


def write_dataset(
    tables: list[pa.Table], out: str | Path, val_fraction: float, shards: int, seed: int
) -> tuple[int, int]:
    """Split rows into train/val by (material, thickness) group; write both splits."""
    table = pa.concat_tables(tables)
    mats = table["material"].to_pylist()
    thick = table["thickness_nm"].to_numpy()
    # held-out (material, thickness) groups: no pattern of a validation group is trained on
    val = np.array(
        [
            in_val(f"{m}:{float(t):.3f}", val_fraction, seed)
            for m, t in zip(mats, thick, strict=True)
        ]
    )
    out = Path(out)
    write_split(table.filter(pa.array(~val)), out / "train", shards, seed)
    write_split(table.filter(pa.array(val)), out / "val", max(1, shards // 4), seed)
    return int((~val).sum()), int(val.sum())


def _check_materials(materials: list[str]) -> None:
    unknown = [m for m in materials if m not in MATERIALS]
    if unknown:
        raise CBEDError(
            f"unknown material {', '.join(unknown)}: use some of {', '.join(MATERIALS)}"
        )
    if not materials:
        raise CBEDError("no materials given: use some of " + ", ".join(MATERIALS))


def generate(
    out: str | Path,
    materials: list[str],
    positions: int,
    settings: Settings = Settings(),
    val_fraction: float = 0.25,
    shards: int = 8,
    seed: int = 0,
    chunk: int = 4,
    num_cpus: int | None = None,
) -> tuple[int, int]:
    """Simulate every material at ``positions`` probe positions as Ray tasks of ``chunk``
    positions each (on a local Ray cluster of its own, unless this process is already
    connected to one), with a progress bar; write
    train/val shards. Returns (train rows, val rows)."""
    _check_materials(materials)
    if positions < 1:
        raise CBEDError(f"positions={positions} is not valid: use >= 1")
    if not 0 <= val_fraction < 1:
        raise CBEDError(f"val_fraction={val_fraction} is not valid: use 0 <= f < 1")
    try:
        import abtem  # noqa: F401
        import ase  # noqa: F401
    except ImportError:
        raise CBEDError(
            "simulating CBED needs abTEM and ASE: pip install -e '.[cbed]' (the cbed extra), "
            "or use --synthetic"
        ) from None
    import ray
    from tqdm import tqdm

    jobs = []
    for m_index, material in enumerate(materials):
        for start in range(0, positions, chunk):
            n = min(chunk, positions - start)
            # a chunk's seed depends on (seed, material, chunk) only: same data at any -j
            jobs.append((material, n, seed * 1_000_003 + m_index * 10_007 + start))
    own = not ray.is_initialized()  # a caller's Ray (tests) is used as it is
    if own:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        task = ray.remote(num_cpus=1)(simulate)
        refs = {task.remote(m, n, s, settings): i for i, (m, n, s) in enumerate(jobs)}
        results: list[Any] = [None] * len(jobs)
        pending = list(refs)
        with tqdm(total=positions * len(materials), unit="position", desc="simulating") as bar:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                results[refs[done[0]]] = ray.get(done[0])
                bar.update(jobs[refs[done[0]]][1])
    finally:
        if own:
            ray.shutdown()
    tables, first = [], 0
    for columns in results:  # job order, not completion order: ids are reproducible
        tables.append(to_table(columns, first, settings))
        first += len(columns["structure"])
    return write_dataset(tables, out, val_fraction, shards, seed)


def synthetic(
    out: str | Path,
    rows: int,
    settings: Settings = Settings(),
    val_fraction: float = 0.25,
    shards: int = 8,
    seed: int = 0,
) -> tuple[int, int]:
    """The same schema without abTEM, for scale tests: a central disk plus Bragg disks on
    a square grid whose spacing follows the material's lattice constant and whose
    intensities follow the structure type and thickness; noise on top."""
    s = settings
    rng = np.random.default_rng(seed)
    names = list(MATERIALS)
    ang = np.linspace(-s.max_angle_mrad, s.max_angle_mrad, s.size)
    ky, kx = np.meshgrid(ang, ang, indexing="ij")
    tables, written = [], 0
    wavelength_pm = 2.508  # 200 keV
    thicknesses = (
        np.arange(1, round(s.max_thickness_nm / s.thickness_step_nm) + 1) * s.thickness_step_nm
    )
    while written < rows:
        n = min(4096, rows - written)
        mats = rng.choice(names, size=n)
        thick = rng.choice(thicknesses, size=n).astype(np.float32)
        patterns = np.zeros((n, s.size, s.size), np.float32)
        for i, (m, t) in enumerate(zip(mats, thick, strict=True)):
            structure, a = MATERIALS[m]
            g = wavelength_pm / (a * 100) * 1000 * 2  # (200) spacing, mrad
            weight = 0.3 + 0.1 * STRUCTURES.index(structure)
            img = (kx**2 + ky**2 < s.semiangle_mrad**2).astype(np.float32)
            for hx in (-1, 0, 1):
                for hy in (-1, 0, 1):
                    if hx or hy:
                        r2 = (kx - hx * g) ** 2 + (ky - hy * g) ** 2
                        img += weight * (1 - np.exp(-t / 10)) * (r2 < s.semiangle_mrad**2)
            img += rng.gamma(1.0, 0.05, img.shape).astype(np.float32)
            patterns[i] = img / img.sum()
        structure_ids = np.array([STRUCTURES.index(MATERIALS[m][0]) for m in mats], np.int32)
        xy = rng.uniform(0, 3, size=(n, 2)).astype(np.float32)
        columns = {
            "pattern": patterns.reshape(n, -1),
            "structure": structure_ids,
            "material": [str(m) for m in mats],
            "thickness_nm": thick,
            "probe_xy": xy,
            "potential": rng.standard_normal((n, PATCH * PATCH)).astype(np.float32),
            "target": np.stack([structure_ids.astype(np.float32), thick / THICKNESS_UNIT_NM], 1),
        }
        tables.append(to_table(columns, written, settings))
        written += n
    return write_dataset(tables, out, val_fraction, shards, seed)
