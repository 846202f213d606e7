"""Images, ImageNet-style: class folders -> Parquet -> Ray Data decode -> a ResNet.
Converted from images the tests write (PNG and JPEG, grayscale and RGB) and from
scikit-learn's bundled digits; needs the ``images`` extra (skipped without it)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("PIL", reason="the images extra is not installed: pip install -e '.[images]'")

from conftest import train  # noqa: E402
from PIL import Image  # noqa: E402

from elastic.datasets.images import ImageError, classes_of, convert, decode_images, shift_augment  # noqa: E402
from elastic.errors import ConfigError  # noqa: E402
from elastic_harness.localcluster import REPO  # noqa: E402

PREPARE = str(REPO / "datasets" / "images" / "prepare.py")


def write_tree(root, per_class=12):
    """3 classes of 12x12 images whose mean brightness is the class: PNG and JPEG,
    grayscale and RGB, one in a nested folder."""
    rng = np.random.default_rng(0)
    for label, name in enumerate(["cat", "dog", "eel"]):
        d = root / name
        (d / "more").mkdir(parents=True)
        for i in range(per_class):
            a = np.clip(rng.normal(60 + 70 * label, 10, (12, 12)), 0, 255).astype(np.uint8)
            if i % 3 == 0:
                Image.fromarray(np.stack([a] * 3, -1), "RGB").save(d / f"{i}.jpg", quality=95)
            elif i % 3 == 1:
                Image.fromarray(a, "L").save(d / f"{i}.png")
            else:
                Image.fromarray(a, "L").save(d / "more" / f"{i}.png")
    (root / "cat" / "notes.txt").write_text("not an image: ignored")


def read_split(path):
    return pq.read_table(sorted(path.glob("*.parquet")))


def test_class_folders_become_shards_with_labels_ids_and_class_names(tmp_path):
    write_tree(tmp_path / "src")
    done = convert(tmp_path / "src", tmp_path / "out", val_fraction=0.25, shards=3)
    assert done.classes == ["cat", "dog", "eel"]
    train_t, val_t = read_split(tmp_path / "out/train"), read_split(tmp_path / "out/val")
    assert train_t.num_rows == done.train_rows and val_t.num_rows == done.val_rows
    assert done.train_rows + done.val_rows == 36 and done.val_rows > 0
    assert len(list((tmp_path / "out/train").glob("*.parquet"))) == 3
    both = train_t.to_pylist() + val_t.to_pylist()
    assert sorted(r["sample_id"] for r in both) == list(range(36))  # stable, unique ids
    for r in both:  # the label is the class folder the file came from
        assert r["path"].split("/")[0] == done.classes[r["label"]]
    assert classes_of(sorted((tmp_path / "out/val").glob("*.parquet"))[0]) == done.classes
    # the classes are mixed in the row order (folders are sorted by class)
    labels = train_t["label"].to_pylist()
    assert labels != sorted(labels)
    # same input, same seed: the same split and the same shards
    convert(tmp_path / "src", tmp_path / "again", val_fraction=0.25, shards=3)
    assert read_split(tmp_path / "again/val").equals(val_t)


def test_synthetic_images_take_the_same_path(tmp_path):
    cmd = [sys.executable, PREPARE, "--synthetic", str(tmp_path / "s"), "--images", "40"]
    out = subprocess.run(cmd + ["--classes", "4", "--size", "12"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert len(list((tmp_path / "s/raw").glob("class*/*.png"))) == 40
    t = pq.read_table(sorted((tmp_path / "s").glob("*/*.parquet")))
    assert t.num_rows == 40 and set(t["label"].to_pylist()) == {0, 1, 2, 3}
    assert set(t.schema.names) == {"sample_id", "image", "label", "path"}


def test_a_corrupt_image_names_the_file_and_no_shard_is_written(tmp_path):
    write_tree(tmp_path / "src", per_class=3)
    bad = tmp_path / "src" / "dog" / "broken.png"
    good = (tmp_path / "src" / "dog" / "1.png").read_bytes()
    bad.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(ImageError, match="broken.png does not decode as an image"):
        convert(tmp_path / "src", tmp_path / "out")
    assert not list(tmp_path.glob("out/**/*.parquet"))
    # the command line says the same in one line, exit 2
    out = subprocess.run(
        [sys.executable, PREPARE, str(tmp_path / "src"), str(tmp_path / "out")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "broken.png" in out.stderr


def test_folders_without_classes_or_images_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImageError, match="no class sub-folders"):
        convert(tmp_path / "empty", tmp_path / "out")
    (tmp_path / "empty" / "cat").mkdir()
    with pytest.raises(ImageError, match="no images"):
        convert(tmp_path / "empty", tmp_path / "out")


def test_decode_resizes_converts_channels_and_labels(tmp_path):
    write_tree(tmp_path / "src", per_class=3)
    convert(tmp_path / "src", tmp_path / "out", val_fraction=0)
    table = read_split(tmp_path / "out/train")
    gray = decode_images(table, "image", "label", size=16, channels=1)
    assert gray["x"].shape == (9, 1, 16, 16) and gray["x"].dtype == np.float32
    assert gray["x"].min() >= -0.5 and gray["x"].max() <= 0.5
    np.testing.assert_array_equal(gray["y"], table["label"].to_numpy())
    # brightness follows the class, through JPEG, RGB->L and the resize
    means = [gray["x"][gray["y"] == c].mean() for c in range(3)]
    assert means[0] < means[1] < means[2]
    rgb = decode_images(table, "image", "label", size=8, channels=3)
    assert rgb["x"].shape == (9, 3, 8, 8)


def test_shift_augment_is_fixed_by_seed_epoch_and_sample():
    x = np.random.default_rng(1).random((6, 1, 10, 10), dtype=np.float32) - 0.5
    ids = np.arange(100, 106)
    a = shift_augment(x, ids, epoch=0, seed=0, max_shift=2)
    np.testing.assert_array_equal(a, shift_augment(x, ids, epoch=0, seed=0, max_shift=2))
    # a sample's view does not depend on which other samples share its batch
    np.testing.assert_array_equal(a[3:], shift_augment(x[3:], ids[3:], 0, 0, 2))
    assert not np.array_equal(a, shift_augment(x, ids, epoch=1, seed=0, max_shift=2))
    assert not np.array_equal(a, x)
    np.testing.assert_array_equal(shift_augment(x, ids, 0, 0, 0), x)


def test_image_data_needs_an_image_model(small_data, tmp_path):
    from elastic.config.compose import compose, typed_config

    for extra, message in [
        (
            ["+experiment=smoke", "data.format=image"],
            "needs an image model, not model=mlp: use model=resnet",
        ),
        (
            ["+experiment=images_resnet", "model.in_channels=3"],
            "model.in_channels=3 but data.image.channels=1",
        ),
        (["+experiment=images_resnet", "data.image.channels=2"], r"use 1 \(grayscale\) or 3"),
        (["+experiment=images_resnet", "data.image.augment_shift=8"], "data.image.augment_shift=8"),
    ]:
        cfg, experiment = compose([*extra, f"data.path={small_data}/train"])
        with pytest.raises(ConfigError, match=message):
            typed_config(cfg, experiment)


@pytest.mark.slow
def test_digits_train_a_resnet_that_generalises(tmp_path, ray_session):
    """scikit-learn's digits as PNG class folders -> prepare.py -> a ResNet through the
    real pipeline; held-out accuracy far above chance (0.1) after 60 steps."""
    out = subprocess.run(
        [sys.executable, PREPARE, "--digits", str(tmp_path / "digits")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert len(list((tmp_path / "digits/raw/7").glob("*.png"))) > 150
    summary = train(
        [
            "+experiment=images_resnet",
            f"data.path={tmp_path}/digits/train",
            f"data.val_path={tmp_path}/digits/val",
            f"run.storage_path={tmp_path}/runs",
            "trainer.max_steps=60",
            "checkpoint.every_steps=0",
            "logger=none",
        ]
    )
    assert summary["status"] == "finished"
    assert summary["val"]["accuracy"] >= 0.6, summary["val"]
    assert summary["samples_exactly_once"] is True
    meta = pq.read_schema(sorted((tmp_path / "digits/train").glob("*.parquet"))[0]).metadata
    assert json.loads(meta[b"elastic.classes"]) == [str(d) for d in range(10)]


def _break_image(shard, row: int) -> tuple[int, str]:
    """Truncate ``row``'s image in ``shard`` (the PNG header survives, the pixels do not);
    its sample_id and source path."""
    t = pq.read_table(shard)
    images = t["image"].to_pylist()
    images[row] = images[row][:40]
    broken = t.set_column(t.schema.get_field_index("image"), "image", pa.array(images))
    pq.write_table(broken.replace_schema_metadata(t.schema.metadata), shard)
    return t["sample_id"][row].as_py(), t["path"][row].as_py()


def _run_images(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            str(REPO / "launch/run.py"),
            "+experiment=images_resnet",
            f"data.path={tmp_path}/out/train",
            "data.val_path=null",
            "data.image.size=16",
            "data.global_batch_size=8",
            "trainer.max_steps=20",
            "logger=none",
            f"run.storage_path={tmp_path}/runs",
            f"hydra.run.dir={tmp_path}/hydra",
            *extra,
        ],  # fmt: skip
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=240,
    )


@pytest.mark.slow
def test_an_image_that_does_not_decode_at_train_time_ends_the_run_in_one_line(
    tmp_path, ray_session
):
    """Shards written by something else than the converter (which decodes every image)
    can hold a broken image. Among the first rows (decoded before Ray starts) the run
    never starts; further on, the run stops at the first step that meets it. Both times
    one line naming the sample, its source file and the data, exit 2, no restarts. (The
    second on the session's Ray: an embedded cluster's start tests nothing here.)"""
    import shutil

    import ray

    session = f"cluster.address={ray.get_runtime_context().gcs_address}"

    write_tree(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "out", val_fraction=0.0, shards=2)
    first, second = sorted((tmp_path / "out/train").glob("*.parquet"))
    intact = tmp_path / "intact.parquet"
    shutil.copy(first, intact)
    for shard, row, before_ray in ((first, 1, True), (second, 3, False)):
        sid, source = _break_image(shard, row)
        out = _run_images(tmp_path, *(() if before_ray else (session,)))
        assert out.returncode == 2, out.stderr[-3000:]
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, out.stderr[-3000:]
        assert f"sample_id {sid} (source {source}) does not decode as an image" in errors[0]
        assert f"data.path={tmp_path}/out/train" in errors[0]
        assert "Error count: 2" not in out.stdout + out.stderr  # not retried
        assert ("connected to" not in out.stdout) == before_ray, out.stdout[-2000:]  # Ray
        shutil.copy(intact, first)
