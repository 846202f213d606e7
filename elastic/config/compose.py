"""From command-line overrides to a validated config, with one-line errors.

:func:`preflight` composes the config with Hydra's compose API before the real Hydra
entry point runs, so any mistake (unknown key or experiment, wrong type, bad value,
missing data) ends the program with exit code 2 and one line naming the key and the fix,
before Hydra writes an output directory and before Ray starts.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from elastic.config.schema import RETIRED_KEYS, DataConfig, TrainConfig
from elastic.config.validate import resolve_paths, to_typed
from elastic.errors import EXIT_USER_ERROR, ConfigError, UserCodeError
from elastic.models import MODEL_SCHEMAS
from elastic.plugins import load_plugins

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def train_schema() -> type[TrainConfig]:
    """:class:`TrainConfig` whose ``data`` also holds ``data.<format>.*``: the settings
    dataclass of every registered format that declares one (plugins' formats too), so a
    format's own keys are typed and defaulted with no edit here."""
    import dataclasses

    from elastic.data.formats import FORMATS

    load_plugins()
    taken = {f.name for f in dataclasses.fields(DataConfig)}
    groups = []
    for name, fmt in sorted(FORMATS.items()):
        if fmt.settings is None:
            continue
        if not dataclasses.is_dataclass(fmt.settings) or name in taken:
            raise TypeError(
                f"format {name!r}: its settings must be a dataclass, and data.{name} must not "
                "be a key already (rename the format)"
            )
        groups.append((name, fmt.settings, dataclasses.field(default_factory=fmt.settings)))
    if not groups:
        return TrainConfig
    data = dataclasses.make_dataclass("DataConfig", groups, bases=(DataConfig,))
    data.__doc__ = DataConfig.__doc__
    train = dataclasses.make_dataclass(
        "TrainConfig",
        [("data", data, dataclasses.field(default_factory=data))],
        bases=(TrainConfig,),
    )
    train.__doc__ = TrainConfig.__doc__
    return train


def register_schemas() -> None:
    """Register the schemas so ``conf/`` YAML is type-checked while Hydra composes it
    (the plugins' model families and formats too: they are loaded first)."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=train_schema())
    for name, schema in MODEL_SCHEMAS.items():
        cs.store(group="schema/model", name=name, node=schema)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _hydra_message(e: Exception, overrides: list[str], search: list[str] | None = None) -> str:
    """Turn Hydra/OmegaConf composition errors into one actionable line."""
    from hydra.errors import ConfigCompositionException, MissingConfigException

    text = str(e)
    if isinstance(e, MissingConfigException) and "experiment/" in text:
        name = text.split("experiment/", 1)[1].split("'", 1)[0]
        dirs = [CONF_DIR, *map(Path, search or [])]
        available = sorted({p.stem for d in dirs for p in (d / "experiment").glob("*.yaml")})
        places = " or ".join(f"{d}/experiment" for d in dirs)
        return (
            f"unknown experiment {name!r}: there is no {name}.yaml in {places}; "
            f"use one of: {', '.join(available)} (an experiment of your own: --config-dir DIR)"
        )
    unregistered = _unregistered_plugin(text)
    if unregistered:
        return unregistered
    cause = e.__cause__ if e.__cause__ is not None else e
    if isinstance(cause, OmegaConfBaseException):
        key = getattr(cause, "full_key", "") or ""
        msg = getattr(cause, "msg", str(cause)).splitlines()[0]
        if "not in struct" in msg or "Could not override" in text:
            override = text.split("'", 2)[1] if "'" in text else key
            retired = RETIRED_KEYS.get(override.split("=", 1)[0].lstrip("+~"))
            if retired:
                return f"config key in override {override!r} is retired: {retired}"
            return (
                f"unknown config key in override {override!r}: check its spelling against "
                "the keys in docs/config.md"
            )
        return f"bad value for {key}: {msg}; fix the override or the config file"
    if isinstance(e, ConfigCompositionException):
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if len(lines) > 1 and "ConfigKeyError" in lines[0]:
            # e.g. an experiment's model keys under another model: name the key
            where = lines[0].split(":", 1)[0]
            full = next(
                (ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), ""
            )
            return (
                f"{where}: {lines[1]}" + (f" ({full})" if full else "") + ": it was written "
                "for another choice in that config group; choose one that has the key, or an "
                "experiment written for yours"
            )
        return _one_line(lines[0]) + " (check the override against the README)"
    return _one_line(text)


def _unregistered_plugin(text: str) -> str | None:
    """A config that names a model family or a format's settings no loaded module
    registers: most often a plugin that was not loaded (``ELASTIC_PLUGINS`` unset)."""
    import re

    from elastic.data.formats import FORMATS
    from elastic.plugins import PLUGINS_ENV, plugin_modules

    loaded = ", ".join(plugin_modules()) or "none"
    hint = (
        f"if it comes from a plugin, load it: {PLUGINS_ENV}=module (its folder on PYTHONPATH; "
        f"{PLUGINS_ENV} now: {loaded})"
    )
    model = re.search(r"Could not load 'schema/model/([^']+)'", text)
    if model:
        return (
            f"model={model.group(1)} is not a registered model family (known: "
            f"{', '.join(sorted(MODEL_SCHEMAS))}): {hint}, or fix the name"
        )
    settings = re.search(r"Key '([^']+)' not in 'DataConfig'", text)
    if settings and settings.group(1) not in FORMATS:
        return (
            f"data.{settings.group(1)} is no key of data: a typo, or the settings of a format "
            f"named {settings.group(1)!r} that no loaded module registers (known formats: "
            f"{', '.join(sorted(FORMATS))}): {hint}"
        )
    return None


def _runtime_overrides(args: list[str]) -> list[str]:
    """The config overrides among Hydra's arguments (flags and hydra.* settings excluded)."""
    out = []
    for a in args:
        if a.startswith("-") or "=" not in a:
            continue
        if a.lstrip("+~").startswith("hydra.") or a.lstrip("+~").startswith("hydra/"):
            continue
        out.append(a)
    return out


def _expand_sweeps(overrides: list[str]) -> list[list[str]]:
    """Every combination a multirun (-m) would run, so each is checked up front."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = []
    for o in parsed:
        if o.is_sweep_override():
            key = o.get_key_element()
            choices.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            choices.append([str(o.input_line)])
    return [list(c) for c in itertools.product(*choices)]


def compose(overrides: list[str], search: list[str] | None = None) -> tuple[DictConfig, str]:
    """Compose ``conf/train.yaml`` with overrides; returns (config, experiment name).
    ``search``: more config directories (a user's experiments, models, data: what
    ``--config-dir`` and ``hydra.searchpath`` give Hydra), searched after ``conf/``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schemas()
    GlobalHydra.instance().clear()
    if search:
        dirs = ",".join(f"file://{os.path.abspath(d)}" for d in search)
        overrides = [*overrides, f"hydra.searchpath=[{dirs}]"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose("train", overrides=overrides, return_hydra_config=True)
    experiment = cfg.hydra.runtime.choices.get("experiment") or ""
    OmegaConf.set_struct(cfg, False)
    del cfg["hydra"]
    return cfg, experiment


def typed_config(cfg: DictConfig, experiment: str, output_dir: str = "") -> TrainConfig:
    """Validated typed config with absolute paths, experiment name and output dir set."""
    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, False)
    cfg.run.experiment = experiment
    cfg.run.output_dir = output_dir
    typed = resolve_paths(to_typed(cfg), os.getcwd())
    check_storage(typed)
    check_data(typed)
    return typed


STORAGE_PROBE_BYTES = 64 * 1024


def check_storage(cfg: TrainConfig) -> None:
    """The run's folder must take files: found now, not as a traceback after Ray
    started. Tried for real (a probe file written, synced and removed: nothing is left
    behind) in the run's folder, or the nearest folder above it that exists: permission
    bits do not tell root, a read-only mount or /proc the truth, and a full disk takes a
    new empty folder but no data."""
    import errno
    import tempfile

    path = cfg.run.storage_path
    run = os.path.join(path, cfg.run.name)
    existing = run
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    what = f"the run's folder {run}" if existing == run else f"run.storage_path={path}"
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", existing)
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".elastic-write-test-")
        try:
            os.write(fd, b"\0" * STORAGE_PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ConfigError(
                f"{what} is full ({existing}: {e.strerror}): free space there, or point "
                "run.storage_path at a filesystem with room for the checkpoints"
            ) from None
        raise ConfigError(
            f"{what} is not writable ({existing}: {e.strerror or e}): point "
            "run.storage_path at a directory you can write"
        ) from None


def check_data(cfg: TrainConfig) -> None:
    """Data errors at config time; synthetic data that is missing gets generated later."""
    from elastic.config.probe import probe
    from elastic.data.formats import data_format, input_width
    from elastic.data.shards import check_dataset, list_shards

    if cfg.data.synthetic is not None and not os.path.isdir(cfg.data.path):
        return
    hint = data_format(cfg.data.format).missing_hint(cfg.data)
    if hint and not os.path.exists(cfg.data.path):
        raise ConfigError(f"data.path={cfg.data.path} does not exist: {hint}")
    check_dataset(cfg.data)
    train_files = list_shards(cfg.data.path)
    files = train_files + (
        list_shards(cfg.data.val_path, "data.val_path") if cfg.data.val_path else []
    )
    data_format(cfg.data.format).check_target(cfg.data, cfg.model, files)
    width = input_width(cfg.data)
    expected = cfg.model.input_dim
    if width is not None and expected is not None and width != expected:
        key = next(k for k in ("input_size", "residues", "input_dim") if hasattr(cfg.model, k))
        fix = (
            f"delete {cfg.data.path} (and data.val_path) to regenerate it for this model"
            if cfg.data.synthetic is not None
            else f"set model.input_dim={width}"
            if key == "input_dim"
            else f"set model.in_channels x model.input_size^2 = {width}"
            if key == "input_size"
            else f"set model.residues to the maps' residue count ({width} contact values)"
        )
        raise ConfigError(
            f"model.{key} gives inputs of {expected} values but column "
            f"{cfg.data.input_column!r} in {cfg.data.path} has width {width}: {fix}"
        )
    # the first rows through the format's decoder, the model and the loss (plugins' code)
    probe(cfg, train_files)


def check_generated_path(cfg: TrainConfig, overrides: list[str]) -> None:
    """Synthetic data is generated where it is missing, but only at the experiment's own
    path: a mistyped data.path given on the command line would otherwise quietly get a
    fresh dataset of its own instead of the data the user meant."""
    if cfg.data.synthetic is None:
        return
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}
    for key, path in (("data.path", cfg.data.path), ("data.val_path", cfg.data.val_path)):
        if key in given and path and not os.path.exists(path):
            raise ConfigError(
                f"{key}={path} does not exist: synthetic data is generated only at the "
                f"experiment's own path; fix the path, drop the override, or write data there "
                "first with python datasets/synthetic/prepare.py"
            )


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USER_ERROR)


def quote_target(args: list[str]) -> list[str]:
    """``metrics.target=val/accuracy>=0.9`` as typed (shell-quoted): Hydra's override
    grammar has no unquoted ``<`` or ``>``, so the value is quoted for it."""
    out = []
    for a in args:
        key, eq, value = a.partition("=")
        needs_quotes = value[:1] not in ("'", '"') and any(c in value for c in "<>")
        if eq and key.lstrip("+~") == "metrics.target" and needs_quotes:
            a = f"{key}='{value}'"
        out.append(a)
    return out


def preflight(args: list[str]) -> None:
    """Check every run the command line asks for; exit 2 with one line on the first error."""
    from hydra.errors import HydraException

    overrides = _runtime_overrides(args)
    try:
        search = search_dirs(args)
    except ConfigError as e:
        fail(str(e))
    try:
        runs = _expand_sweeps(overrides)
    except HydraException as e:
        fail(f"cannot parse overrides ({_one_line(str(e).splitlines()[0])}): use key=value")
    for run_overrides in runs:
        try:
            cfg, experiment = compose(run_overrides, search)
            check_generated_path(typed_config(cfg, experiment), run_overrides)
        except (ConfigError, UserCodeError) as e:  # a plugin's code on the first rows
            fail(str(e))
        except (HydraException, OmegaConfBaseException) as e:
            fail(_hydra_message(e, run_overrides, search))


def search_dirs(args: list[str]) -> list[str]:
    """The config directories a command line adds to Hydra's search path: ``--config-dir
    DIR`` (``-cd DIR``, ``--config-dir=DIR``) and ``hydra.searchpath=[file://DIR,...]``."""
    dirs = []
    for i, a in enumerate(args):
        if a in ("--config-dir", "-cd") and i + 1 < len(args):
            dirs.append(args[i + 1])
        elif a.startswith("--config-dir="):
            dirs.append(a.split("=", 1)[1])
        elif a.lstrip("+").startswith("hydra.searchpath="):
            listed = a.split("=", 1)[1].strip("[]'\"")
            dirs += [p.strip().strip("'\"").removeprefix("file://") for p in listed.split(",")]
    for d in dirs:
        if not os.path.isdir(d):
            raise ConfigError(f"config directory {d} does not exist: fix --config-dir")
    return [os.path.abspath(d) for d in dirs if d]


def plain(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain data (for W&B and the record)."""
    container = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(container, dict)
    return {str(k): v for k, v in container.items() if k != "hydra"}
