"""Plugins: modules that register dataset formats and model families when imported.

The built-in formats (:data:`BUILTIN`) and a user's own modules load the same way: listed
in ``ELASTIC_PLUGINS`` (comma-separated module names, importable on the driver and on
every Ray worker: on ``PYTHONPATH``, or installed), or declared by an installed package as
an ``elastic.plugins`` entry point. Loaded once per process, before the config is
composed (a model family's schema must be known to Hydra) and on each worker.
"""

from __future__ import annotations

import importlib
import os
from importlib.metadata import entry_points

from elastic.errors import ConfigError, exception_text, user_code_site

PLUGINS_ENV = "ELASTIC_PLUGINS"
BUILTIN = ("elastic.datasets.images", "elastic.datasets.protein")
ENTRY_POINT_GROUP = "elastic.plugins"


def plugin_modules() -> list[str]:
    """The modules ``ELASTIC_PLUGINS`` names (what workers must import too)."""
    return [m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]


def load_plugins() -> None:
    """Import the built-in formats and every plugin; idempotent (imports are cached).

    A plugin that cannot be found, or that raises while it imports (a typo, a missing
    package of its own), is a :class:`ConfigError`: one line naming the plugin, what it
    raised and where, before Ray starts."""
    for name in [*BUILTIN, *plugin_modules()]:
        if name in BUILTIN:
            importlib.import_module(name)
            continue
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and (name == e.name or name.startswith(f"{e.name}.")):
                # the plugin itself (or its package) is not there
                raise ConfigError(
                    f"plugin {name!r} (in {PLUGINS_ENV}) cannot be imported ({e}): put its "
                    "folder on PYTHONPATH or install its package"
                ) from None
            raise ConfigError(_failed(f"plugin {name!r} (in {PLUGINS_ENV})", e)) from None
        except Exception as e:
            raise ConfigError(_failed(f"plugin {name!r} (in {PLUGINS_ENV})", e)) from None
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as e:
            raise ConfigError(
                _failed(f"plugin {ep.value!r} (entry point {ep.name!r} of {ENTRY_POINT_GROUP})", e)
            ) from None


def _failed(plugin: str, e: Exception) -> str:
    """One line: the plugin raised ``e`` while it was imported."""
    return (
        f"{plugin} fails on import with {type(e).__name__}: {exception_text(e)} "
        f"({user_code_site(e)}): "
        "fix the plugin module (or drop it from the list)"
    )
