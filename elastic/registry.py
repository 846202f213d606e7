"""Named registries of what plugins add: data formats, model families, tasks.

Each is a dict from the name a config picks (``data.format=NAME``, ``model=NAME``,
``model.task=NAME``) to the object; :meth:`Registry.add` is how built-ins and plugins
register. A name is taken once: a second object under a taken name (a plugin reusing a
built-in's name, two plugins picking the same one) is refused in one line naming both,
instead of silently replacing the first. The same object registered again (its module
imported twice) is not a conflict.
"""

from __future__ import annotations

from typing import TypeVar

from elastic.errors import ConfigError

T = TypeVar("T")


def source(obj: object) -> str:
    """Where ``obj`` is defined: ``module.QualifiedName`` of a class, or of an instance's
    class."""
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


class Registry(dict[str, T]):
    """Names to registered objects of one kind; the config key ``key`` picks one."""

    def __init__(self, kind: str, key: str) -> None:
        super().__init__()
        self.kind, self.key = kind, key

    def add(self, name: str, obj: T) -> T:
        """Register ``obj`` under ``name``; a different object already there is refused."""
        old = self.get(name)
        if old is not None and source(old) != source(obj):
            raise ConfigError(
                f"{self.kind} {name!r} is registered twice, by {source(old)} and by "
                f"{source(obj)}: give one another name ({self.key}=NAME picks it)"
            )
        self[name] = obj
        return obj
