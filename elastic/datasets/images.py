"""Images, ImageNet-style: class folders of JPEG/PNG -> Parquet shards of the encoded
bytes + label, decoded (and resized) in Ray Data's ``map_batches``, augmented on the
worker with a shift that is a pure function of (seed, epoch, sample_id).

Needs the ``images`` extra (Pillow; scikit-learn for the digits example).
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from elastic.data.footers import footer
from elastic.data.formats import DataFormat, register_format
from elastic.data.shards import in_val, write_split
from elastic.errors import ConfigError, DataError

EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


class ImageError(ValueError):
    """A one-line, user-facing problem with an input image or folder."""


@dataclass(frozen=True)
class Converted:
    train_rows: int
    val_rows: int
    classes: list[str]


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise ImageError(
            "images need Pillow: pip install -e '.[images]' (the images extra)"
        ) from None
    return Image


def list_images(src: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """Class names (sorted sub-folder names) and (relative path, label) of every image."""
    if not src.is_dir():
        raise ImageError(f"{src} is not a directory: pass a folder of class sub-folders")
    classes = sorted(d.name for d in src.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise ImageError(f"{src} has no class sub-folders (expected {src}/<class>/<image>.png)")
    items = []
    for label, name in enumerate(classes):
        for root, _, files in os.walk(src / name):
            for f in sorted(files):
                if f.lower().endswith(EXTENSIONS):
                    items.append((os.path.relpath(os.path.join(root, f), src), label))
    if not items:
        raise ImageError(f"{src} has class folders but no images ({', '.join(EXTENSIONS)})")
    items.sort()
    return classes, items


def _checked_bytes(path: Path) -> bytes:
    image, data = _pil(), path.read_bytes()
    try:
        with image.open(io.BytesIO(data)) as im:
            im.load()  # verify() misses truncated pixel data; load() decodes it all
    except Exception as e:  # PIL raises many types for bad files
        raise ImageError(f"{path} does not decode as an image ({e}): fix or remove it") from None
    return data


def convert(
    src: str | Path,
    out: str | Path,
    val_fraction: float = 0.1,
    shards: int = 8,
    seed: int = 0,
) -> Converted:
    """``src/<class>/*.png|jpg`` -> ``out/train`` and ``out/val`` Parquet shards with
    columns sample_id (int64, stable: the index in the sorted file list), image (the
    file's encoded bytes), label (int32), path; the class names in the schema metadata.
    Rows are in a seeded random order, so that the classes mix in every step.

    Every image is decoded once here, so a bad one fails the conversion (naming the file)
    before any shard is written; shards are written to a temp name then renamed."""
    src, out = Path(src), Path(out)
    if not 0 <= val_fraction < 1:
        raise ImageError(f"val_fraction={val_fraction} is not valid: use 0 <= f < 1")
    classes, items = list_images(src)
    rows = {"train": [], "val": []}  # type: dict[str, list[tuple[int, str, int]]]
    for sample_id, (rel, label) in enumerate(items):
        split = "val" if in_val(rel, val_fraction, seed) else "train"
        rows[split].append((sample_id, rel, label))
    blobs = {rel: _checked_bytes(src / rel) for rel, _ in items}
    meta = {
        b"elastic.classes": json.dumps(classes).encode(),
        b"elastic.source": str(src.resolve()).encode(),
        b"elastic.format": b"image",
    }
    for split, split_rows in rows.items():
        table = pa.table(
            {
                "sample_id": pa.array([r[0] for r in split_rows], pa.int64()),
                "image": pa.array([blobs[r[1]] for r in split_rows], pa.binary()),
                "label": pa.array([r[2] for r in split_rows], pa.int32()),
                "path": pa.array([r[1] for r in split_rows], pa.string()),
            }
        ).replace_schema_metadata(meta)
        # folders are sorted by class: write_split mixes the rows (seeded)
        write_split(table, out / split, shards, seed)
    return Converted(len(rows["train"]), len(rows["val"]), classes)


def decode_images(
    batch: pa.Table, input_column: str, target_column: str, size: int, channels: int
) -> dict[str, np.ndarray]:
    """Encoded images -> float32 [N, C, size, size] in [-0.5, 0.5]; labels as int64."""
    image = _pil()
    mode = "L" if channels == 1 else "RGB"
    column = batch[input_column].to_pylist()
    x = np.empty((len(column), channels, size, size), dtype=np.float32)
    for i, data in enumerate(column):
        try:
            with image.open(io.BytesIO(data)) as im:
                im = im.convert(mode)
                if im.size != (size, size):
                    im = im.resize((size, size), image.Resampling.BILINEAR)
                a = np.asarray(im, dtype=np.float32)
        except Exception as e:
            sid = batch["sample_id"][i].as_py()
            source = f" (source {batch['path'][i].as_py()})" if "path" in batch.column_names else ""
            raise DataError(
                f"sample_id {sid}{source} does not decode as an image ({e}): re-convert the "
                "dataset without it (datasets/images/prepare.py checks every image)"
            ) from None
        x[i] = a[None] if channels == 1 else a.transpose(2, 0, 1)
    x = x / 255.0 - 0.5
    return {
        "sample_id": batch["sample_id"].to_numpy().astype(np.int64, copy=False),
        "x": x,
        "y": batch[target_column].to_numpy().astype(np.int64, copy=False),
    }


def shift_augment(
    x: np.ndarray, sample_id: np.ndarray, epoch: int, seed: int, max_shift: int
) -> np.ndarray:
    """Shift every image by up to ``max_shift`` pixels (zero fill), by an offset that is
    a pure function of (seed, epoch, sample_id): the same sample gets the same view in an
    epoch whichever worker trains it, after a resume too, and a new one next epoch."""
    if max_shift <= 0 or len(x) == 0:
        return x
    n, _, h, w = x.shape
    ids = sample_id.astype(np.uint64)
    mix = (ids * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(
        (seed * 1_000_003 + epoch) & (2**63 - 1)
    )
    mix ^= mix >> np.uint64(31)
    mix *= np.uint64(0xBF58476D1CE4E5B9)
    mix ^= mix >> np.uint64(29)
    span = np.uint64(2 * max_shift + 1)
    dy = (mix % span).astype(np.int64) - max_shift
    dx = ((mix // span) % span).astype(np.int64) - max_shift
    p = max_shift
    padded = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)), constant_values=-0.5)
    out = np.empty_like(x)
    for i in range(n):
        top, left = p + dy[i], p + dx[i]
        out[i] = padded[i, :, top : top + h, left : left + w]
    return out


def classes_of(shard: str) -> list[str]:
    meta = footer(shard).schema.metadata or {}
    return json.loads(meta.get(b"elastic.classes", b"[]"))


def synthetic_folders(
    out: str | Path, images: int, classes: int = 10, size: int = 32, seed: int = 0
) -> int:
    """Class folders of generated PNGs (a class is a brightness and a stripe direction,
    plus noise): the converter's input at any scale, without a download."""
    image = _pil()
    rng = np.random.default_rng(seed)
    out = Path(out)
    yy, xx = np.mgrid[0:size, 0:size]
    for i in range(images):
        label = i % classes
        angle = np.pi * label / classes
        stripes = np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * 0.6)
        a = 128 + 60 * stripes + rng.normal(0, 25, (size, size))
        d = out / f"class{label:03d}"
        d.mkdir(parents=True, exist_ok=True)
        image.fromarray(np.clip(a, 0, 255).astype(np.uint8), mode="L").save(d / f"{i:07d}.png")
    return images


def digits_to_folders(out: str | Path) -> int:
    """scikit-learn's bundled digits (1,797 8x8 images, 10 classes) as PNG class folders:
    the same input a user's ImageNet-style folder tree is."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImageError(
            "the digits example needs scikit-learn: pip install -e '.[images]'"
        ) from None
    image = _pil()
    digits = load_digits()
    out = Path(out)
    for i, (pixels, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        d = out / str(label)
        d.mkdir(parents=True, exist_ok=True)
        a = np.clip(pixels * (255.0 / 16.0), 0, 255).astype(np.uint8)
        image.fromarray(a, mode="L").save(d / f"{i:05d}.png")
    return len(digits.images)


@dataclass
class ImageSettings:
    """``data.image.*``: how ``data.format=image`` decodes and augments."""

    size: int = 32
    """Decoded images are resized to size x size."""
    channels: int = 1
    """1 (grayscale) or 3 (RGB)."""
    augment_shift: int = 0
    """Shift each training image by up to this many pixels, by an offset fixed by
    data.seed, the epoch and the sample_id (the same on any worker, after a resume too);
    0 = no augmentation."""


class ImageFormat(DataFormat):
    """``data.format=image``: encoded image bytes (PNG, JPEG, ...) decoded and resized to
    ``data.image.size`` in Ray Data; training images shifted by ``data.image.augment_shift``."""

    name = "image"
    description = "encoded image bytes (PNG, JPEG, ...) and an integer label"
    settings = ImageSettings

    def extra_columns(self, cfg: Any, schema: pa.Schema) -> list[str]:
        return ["path"] if "path" in schema.names else []  # the source, for a decode error

    def decoder(self, cfg: Any, shard: str) -> tuple[Any, dict[str, Any]]:
        s = self.settings_of(cfg)
        return decode_images, {"size": s.size, "channels": s.channels}

    def input_width(self, cfg: Any, files: list[str]) -> int | None:
        return None  # decoded to data.image.size: checked against the model in check()

    def input_shape(self, cfg: Any, model: Any) -> tuple[int, ...]:
        s = self.settings_of(cfg)
        return (s.channels, s.size, s.size)

    def target_shape(self, cfg: Any, model: Any) -> tuple[tuple[int, ...], Any]:
        return (), np.int64

    def check(self, cfg: Any, model: Any) -> None:
        d = self.settings_of(cfg)
        if d.size < 4:
            raise ConfigError(f"data.image.size={d.size} is not valid: it must be >= 4")
        if d.channels not in (1, 3):
            raise ConfigError(
                f"data.image.channels={d.channels} is not valid: use 1 (grayscale) or 3 (RGB)"
            )
        if not 0 <= d.augment_shift < d.size // 2:
            raise ConfigError(
                f"data.image.augment_shift={d.augment_shift} is not valid: use 0..{d.size // 2 - 1}"
            )
        # here, not at the top: elastic.models imports torch, which no read task needs
        from elastic.models.base import ImageModelConfig

        if not isinstance(model, ImageModelConfig):
            raise ConfigError(
                f"data.format=image needs an image model, not model={model.name}: use "
                "model=resnet or model=vit"
            )
        channels = model.in_channels
        if channels != d.channels:
            raise ConfigError(
                f"model.in_channels={channels} but data.image.channels={d.channels}: "
                "make them equal"
            )
        side = model.image_size  # models whose shape depends on the side
        if side is not None and not model.input_size and side != d.size:
            raise ConfigError(
                f"model.image_size={side} but data.image.size={d.size}: make them equal"
            )

    def missing_hint(self, cfg: Any) -> str | None:
        return (
            "convert your class folders with python datasets/images/prepare.py SRC OUT (or "
            "--digits OUT for the example) and point data.path/data.val_path at OUT/train and "
            "OUT/val"
        )

    def augment(self, x: np.ndarray, sample_id: np.ndarray, epoch: int, cfg: Any) -> np.ndarray:
        return shift_augment(x, sample_id, epoch, cfg.seed, self.settings_of(cfg).augment_shift)


register_format(ImageFormat())
