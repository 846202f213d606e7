"""Helpers every config section's dataclass uses, wherever the section lives (the
config package composes sections that the data and observe packages define): a key's
fixed choices on its field, and the one-line checks of a value. At the bottom of the
import graph, beside the errors."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, get_args

from elastic.errors import ConfigError

CHOICES = "choices"
"""The field metadata that holds a key's fixed set of values (:func:`one_of`)."""


def one_of(choices: Any, default: str) -> Any:
    """A key whose value is one of the ``Literal`` type ``choices``, with this default.

    OmegaConf 2.3 refuses ``Literal`` annotations in structured configs, so the key is
    typed ``str`` and its choices ride on the field: validation (and its message) and
    the docs test read them from there (:func:`choices_of`), nowhere else."""
    values = get_args(choices)
    if default not in values:
        raise ValueError(f"default {default!r} is not one of {values}")
    return field(default=default, metadata={CHOICES: values})


def choices_of(f: dataclasses.Field[Any]) -> tuple[str, ...] | None:
    """The fixed set of values of the key ``f``, or None where it takes any value."""
    return f.metadata.get(CHOICES)


def allowed(key: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not valid: use one of {', '.join(choices)}")


def positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key}={value} is not valid: it must be {bound}")
