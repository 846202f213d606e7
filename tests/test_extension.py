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
    # one shard, one row group: on 2 workers one rank's validation share is empty
    write_spectra(str(tmp_path / "data/val"), 192, 128, seed=1, first_id=10_000, shards=1)
    return project, env


def _run(project: Path, env: dict[str, str], cwd: Path, *overrides: str, exp: str = "spectra"):
    return subprocess.run(
        [
            sys.executable,
            str(REPO / "launch/run.py"),
            "--config-dir",
            str(project / "conf"),
            f"+experiment={exp}",
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
def test_a_plugin_format_model_and_task_train_end_to_end(tmp_path):
    """The plugin's format, model and task (multi-label: which thirds of a spectrum hold
    a peak) train through the real entry point; its metrics are the task's."""
    project, env = _user_project(tmp_path)
    proc = _run(project, env, tmp_path, exp="spectra_peaks")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary_path = proc.stdout.split("[elastic] summary: ")[1].split()[0]
    summary = json.loads(Path(summary_path).read_text())
    assert summary["status"] == "finished" and summary["experiment"] == "spectra_peaks"
    assert summary["samples_exactly_once"] is True
    assert [e["trained"] for e in summary["epochs_closed"]] == [768, 768, 768]
    val = summary["val"]
    assert set(val) == {"loss", "samples", "exact_match", "label_accuracy"}, val
    assert val["samples"] == 192
    # learnt far above chance: a constant answer gets every label right in at most
    # ~0.2 of the rows, and at most ~0.6 of the labels (each is 1 with p 0.6)
    assert val["exact_match"] >= 0.7 and val["label_accuracy"] >= 0.85, val


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


def _break(project: Path, old: str, new: str) -> None:
    """The user's plugin with one mistake in it: ``old`` replaced by ``new``."""
    plugin = project / "spectra_plugin.py"
    text = plugin.read_text()
    assert old in text, old
    plugin.write_text(text.replace(old, new, 1))


FLAT = "    x = x.astype(np.float32)\n"
TWO_ROWS = "    x = x.astype(np.float32).reshape(len(raw), 2, length // 2)\n"
REGISTER = "register_format(SpectrumFormat())\n"
UNDECLARED = (
    "class Undeclared(SpectrumFormat):\n"
    "    def input_shape(self, cfg, model):\n"
    "        return None  # no shape declared: the model takes what the decoder gives\n\n\n"
    "register_format(Undeclared())\n"
)
MISTAKES = {
    # a plugin that raises while it imports: a traceback and exit 1 before
    "import": ([(REGISTER, REGISTER + "frobnicate()\n")], "fails on import with NameError"),
    # a decoder giving rows of another shape than the model's input_dim
    "shape": (
        [(FLAT, TWO_ROWS)],
        "decodes inputs of shape 2x64 a row, but its input_shape() says 128",
    ),
    # the same where the format declares no shape: the model itself is run on the rows
    "model_input": (
        [(FLAT, TWO_ROWS), (REGISTER, UNDECLARED)],
        "model=spectrum_cnn cannot take the decoded inputs: its forward pass on 4 rows of "
        "shape 2x64",
    ),
    # a decoder that raises on every batch (found in the workers, 10 retries, before)
    "decoder": (
        [
            (
                '"y": column_to_numpy(batch[target_column])',
                '"y": column_to_numpy(batch[target_colum])',
            )
        ],
        "data.format=spectrum's decoder (decode_spectra) on sample_id 0..3 raised NameError",
    ),
    "build": (
        [("return nn.Sequential(*layers)", "return nn.Sequential(*layer)")],
        "model=spectrum_cnn's build() raised NameError",
    ),
    # a model without a forward pass (nn.Module's raises NotImplementedError)
    "forward": (
        [("return nn.Sequential(*layers)", "return nn.Module()")],
        "model=spectrum_cnn cannot take the decoded inputs: its forward pass on 4 rows",
    ),
    # a format under a built-in's name: it replaced the built-in without a word
    "duplicate": (
        [('    name = "spectrum"\n', '    name = "image"\n')],
        "data format 'image' is registered twice, by elastic.datasets.images.ImageFormat and "
        "by spectra_plugin.SpectrumFormat: give one another name",
    ),
    # labels as the task cannot use them: a class the model does not have
    "labels": (
        [("batch[target_column]),", "batch[target_column]) + 3,")],
        "but model=spectrum_cnn has classes 0..2",
    ),
}


# the fast tier's; the others run in the full suite
FAST = ("decoder", "duplicate", "import", "shape")


@pytest.mark.parametrize(
    "mistake",
    [m if m in FAST else pytest.param(m, marks=pytest.mark.slow) for m in sorted(MISTAKES)],
)
def test_a_mistake_in_a_plugins_code_is_one_line_before_ray_starts(tmp_path, mistake):
    """Errors raised in a plugin's own code, or shapes it gets wrong, end the run with
    one line naming the function, its file and line where it raised, exit 2, before
    Ray starts and before anything is written."""
    project, env = _user_project(tmp_path)
    edits, needle = MISTAKES[mistake]
    for old, new in edits:
        _break(project, old, new)
    proc = _run(project, env, tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert len(lines) == 1 and needle in lines[0], lines
    if mistake in ("import", "decoder", "build"):
        assert "(spectra_plugin.py:" in lines[0], lines  # where in the plugin
    assert "connected to" not in proc.stdout
    assert not (tmp_path / "runs").exists()


def test_a_forgotten_plugin_is_named_in_the_one_line(tmp_path):
    project, env = _user_project(tmp_path)
    env = {k: v for k, v in env.items() if k != "ELASTIC_PLUGINS"}
    proc = _run(project, env, tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "model=spectrum_cnn is not a registered model family" in lines[0], lines
    assert "ELASTIC_PLUGINS=module" in lines[0], lines


@pytest.mark.slow
def test_a_decoder_that_fails_on_a_later_row_ends_the_run_at_once(tmp_path):
    """A decoder error on rows the check before Ray does not read, raised inside Ray
    Data in a worker, fails the same way on every retry: one line naming the decoder,
    the rows, the error and its line; exit 2; the worker group is not restarted (Ray
    Train restarted it 10 times, 290 s and 805 lines of tracebacks)."""
    project, env = _user_project(tmp_path)
    _break(
        project,
        FLAT,
        FLAT + "    if batch['sample_id'].to_numpy().max() >= 700:\n"
        "        raise ValueError('frame 700 is corrupt')\n",
    )
    proc = _run(project, env, tmp_path, "scaling.max_failures=3")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: data.format=spectrum's decoder (decode_spectra) on "), last
    assert "raised ValueError: frame 700 is corrupt (spectra_plugin.py:" in last, last
    with open(tmp_path / "runs/spectra/metrics.jsonl") as f:
        events = [r["event"] for r in map(json.loads, f) if "event" in r]
    assert events.count("world_size") == 1 and "restart" not in events, events


def test_an_error_in_a_plugins_code_is_named_and_a_passing_one_goes_on():
    """What becomes a UserCodeError (never retried): an exception the code raises,
    named with the function, the exception, the plugin's file:line and the fix. What
    goes on as it was (retried by Ray Train as before): the machine's trouble, memory
    or I/O, which need not happen again; and a RunError the code raised on purpose."""
    from elastic.errors import DataError, UserCodeError, user_code

    def decode() -> None:
        raise KeyError("spectrum")

    with pytest.raises(UserCodeError) as e, user_code("data.format=x's decoder (decode)", "fix it"):
        decode()
    assert str(e.value).startswith(
        "data.format=x's decoder (decode) raised KeyError: 'spectrum' (test_extension.py:"
    )
    assert str(e.value).endswith("): fix it")
    for transient in (MemoryError(), OSError(5, "Input/output error"), DataError("row 7")):
        with pytest.raises(type(transient)), user_code("x", "y"):
            raise transient
