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

from elastic.errors import ConfigError

PLUGINS_ENV = "ELASTIC_PLUGINS"
BUILTIN = ("elastic.datasets.images", "elastic.datasets.protein")
ENTRY_POINT_GROUP = "elastic.plugins"


def plugin_modules() -> list[str]:
    """The modules ``ELASTIC_PLUGINS`` names (what workers must import too)."""
    return [m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]


def load_plugins() -> None:
    """Import the built-in formats and every plugin; idempotent (imports are cached)."""
    for name in [*BUILTIN, *plugin_modules()]:
        try:
            importlib.import_module(name)
        except ImportError as e:
            if name in BUILTIN:
                raise
            raise ConfigError(
                f"plugin {name!r} (in {PLUGINS_ENV}) cannot be imported ({e}): put its folder "
                "on PYTHONPATH or install its package"
            ) from None
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        ep.load()
