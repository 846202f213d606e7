"""Bring your own dataset format and model (README): a plugin module and a config
directory outside the repository, trained end to end by the real entry point through
Ray Data and DeepSpeed, with no edit to the library."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXTENSION = Path(__file__).resolve().parent / "extension"


def _user_project(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The plugin and its configs copied outside the repository, and the environment
    that loads it."""
    project = tmp_path / "my_project"
    shutil.copytree(EXTENSION, project)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(project), os.environ.get("PYTHONPATH", "")]),
        "ELASTIC_PLUGINS": "spectra_plugin",
        "WANDB_MODE": "offline",
    }
    sys.path.insert(0, str(project))
    try:
        from spectra_plugin import write_spectra
    finally:
        sys.path.remove(str(project))
    write_spectra(str(tmp_path / "data/train"), 768, 128, seed=0)
    write_spectra(str(tmp_path / "data/val"), 192, 128, seed=1, first_id=10_000)
    return project, env


def _run(project: Path, env: dict[str, str], cwd: Path, *overrides: str):
    return subprocess.run(
        [
            sys.executable,
            str(REPO / "launch/run.py"),
            "--config-dir",
            str(project / "conf"),
            "+experiment=spectra",
            f"data.path={cwd}/data/train",
            f"data.val_path={cwd}/data/val",
            f"run.storage_path={cwd}/runs",
            "logger=none",
            *overrides,
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_a_plugin_format_and_model_train_end_to_end(tmp_path):
    project, env = _user_project(tmp_path)
    proc = _run(project, env, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary_path = proc.stdout.split("[elastic] summary: ")[1].split()[0]
    summary = json.loads(Path(summary_path).read_text())
    assert summary["status"] == "finished" and summary["experiment"] == "spectra"
    assert summary["samples_exactly_once"] is True
    assert [e["trained"] for e in summary["epochs_closed"]] == [768, 768, 768]
    # the peak's third of the spectrum is the class: learnable far above chance (1/3)
    assert summary["val"]["accuracy"] >= 0.8, summary["val"]


def test_a_plugin_is_checked_before_ray_starts(tmp_path):
    """Mistakes with a plugin's format and model end in one line before Ray starts,
    as the library's own do: a model without enough classes for the labels, an
    unknown key of the plugin's model or of its format's settings, a bad value of a
    setting, and a plugin that cannot be imported."""
    project, env = _user_project(tmp_path)
    for overrides, extra_env, needle in [
        (["model.output_dim=2"], {}, "holds class labels 0..2 but model.output_dim=2"),
        (["+model.chanels=[4]"], {}, "unknown config key model.chanels"),
        (["+data.spectrum.paek=2"], {}, "unknown config key data.spectrum.paek"),
        (["data.spectrum.peak=-1"], {}, "data.spectrum.peak=-1.0 is not valid"),
        (["data.spectrum.peak=nan"], {}, "data.spectrum.peak=nan is not valid"),
        ([], {"ELASTIC_PLUGINS": "spectra_plugni"}, "plugin 'spectra_plugni'"),
    ]:
        proc = _run(project, {**env, **extra_env}, tmp_path, *overrides)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert len(lines) == 1 and needle in lines[0], lines
    assert not (tmp_path / "runs").exists()
