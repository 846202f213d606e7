"""Model families, one module each, and the registry that names them.

A family is a typed config (a dataclass: its keys are ``model.*``) that builds its
``torch.nn.Module`` and knows its task. ``MODEL_SCHEMAS`` maps ``model=NAME`` to it; Hydra
type-checks ``conf/model/NAME.yaml`` against it.
"""

from __future__ import annotations

from elastic.models.cvae import CVAEConfig
from elastic.models.mlp import MLPConfig
from elastic.models.resnet import ResNetConfig
from elastic.models.vit import ViTConfig

MODEL_SCHEMAS: dict[str, type] = {
    "mlp": MLPConfig,
    "resnet": ResNetConfig,
    "vit": ViTConfig,
    "cvae": CVAEConfig,
}


def register_model(schema: type) -> type:
    """Make the dataclass ``schema`` the family ``model=<its name default>`` (a plugin's
    model). It must have the keys ``name``, ``task`` (one of
    :data:`~elastic.models.losses.TASKS`) and ``output_dim``, and the methods
    ``validate()`` (raise :class:`~elastic.errors.ConfigError`) and ``build() ->
    torch.nn.Module``; ``input_dim`` if it takes flat vectors (checked against the data).
    Usable as a class decorator."""
    name = getattr(schema, "name", None)
    missing = [
        k for k in ("name", "task", "output_dim", "validate", "build") if not hasattr(schema, k)
    ]
    if not isinstance(name, str) or missing:
        raise TypeError(f"model schema {schema.__name__} lacks {', '.join(missing) or 'a name'}")
    MODEL_SCHEMAS[name] = schema
    return schema
