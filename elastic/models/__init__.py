"""Model families, one module each, and the registry that names them.

A family is a typed config (a dataclass subclassing :class:`ModelConfig`: its fields
are the ``model.*`` keys) that builds its ``torch.nn.Module`` and names its task.
``MODEL_SCHEMAS`` maps ``model=NAME`` to it; Hydra type-checks ``conf/model/NAME.yaml``
against it.
"""

from __future__ import annotations

from elastic.models.base import ImageModelConfig, ModelConfig
from elastic.models.cvae import CVAEConfig
from elastic.models.mlp import MLPConfig
from elastic.models.resnet import ResNetConfig
from elastic.models.vit import ViTConfig
from elastic.registry import Registry

MODEL_SCHEMAS: Registry[type[ModelConfig]] = Registry("model", "model")
for _schema in (MLPConfig, ResNetConfig, ViTConfig, CVAEConfig):
    MODEL_SCHEMAS.add(_schema.name, _schema)


def register_model(schema: type) -> type:
    """Make the dataclass ``schema`` (a :class:`ModelConfig` subclass) the family
    ``model=<its name default>`` (a plugin's model). It must give ``name``, ``task`` (a
    registered task, :mod:`elastic.tasks`) and ``output_dim``, and ``build() ->
    torch.nn.Module``; ``validate()`` checks its own keys (raise
    :class:`~elastic.errors.ConfigError`), ``input_dim`` if it takes flat vectors
    (checked against the data). Usable as a class decorator."""
    from dataclasses import is_dataclass

    name = getattr(schema, "name", None)
    if not (isinstance(schema, type) and issubclass(schema, ModelConfig) and is_dataclass(schema)):
        raise TypeError(
            f"model schema {getattr(schema, '__name__', schema)!r} must be a dataclass "
            "subclassing elastic.models.ModelConfig"
        )
    if not isinstance(name, str):
        raise TypeError(f"model schema {schema.__name__} lacks a name (a str default)")
    return MODEL_SCHEMAS.add(name, schema)


__all__ = ["MODEL_SCHEMAS", "ImageModelConfig", "ModelConfig", "register_model"]
