"""The typed base of every model family's config.

A family is a dataclass whose fields are the ``model.*`` keys, subclassing
:class:`ModelConfig`: the core reads these properties, never probes for keys. A family
overrides what it has (a field or a property of the same name); the rest keep the
defaults here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn


class ModelConfig:
    """What the core asks of a model config (``model=NAME``): its name and task, its
    outputs, the input it takes, and how to build it."""

    name: str
    task: str
    """A registered task's name (:mod:`elastic.tasks`): regression, classification,
    multitask, vae, or a plugin's."""

    @property
    def output_dim(self) -> int:
        """The model's outputs a row (classes, regressed values: what the task reads)."""
        raise NotImplementedError(f"model={self.name} declares no output_dim")

    @property
    def classes(self) -> int:
        """multitask: how many of the outputs are class logits (0 otherwise)."""
        return 0

    @property
    def input_dim(self) -> int | None:
        """Width of a flat input row, when the model takes flat vectors (checked against
        the data before Ray starts); None: it takes another shape."""
        return None

    @property
    def takes_images(self) -> bool:
        """It takes images (channels x side x side), not flat rows."""
        return False

    def validate(self) -> None:
        """Config errors of the family's own keys (raise :class:`ConfigError`); its
        task's checks of the model (:meth:`elastic.tasks.Task.check_model`) run first."""

    def build(self) -> nn.Module:
        raise NotImplementedError(f"model={self.name} has no build()")


class ImageModelConfig(ModelConfig):
    """The image families' (ResNet, ViT) shared keys and checks."""

    in_channels: int
    input_size: int
    """Flat array inputs of in_channels x input_size x input_size values are reshaped to
    images; 0 = the data are images already."""

    @property
    def input_dim(self) -> int | None:
        return self.in_channels * self.input_size**2 if self.input_size else None

    @property
    def takes_images(self) -> bool:
        return not self.input_size

    @property
    def image_size(self) -> int | None:
        """The image side the model is built for; None: any (fully convolutional)."""
        return None

    def validate(self) -> None:
        if self.in_channels < 1 or self.output_dim < 1:
            raise ConfigError("model.in_channels and model.output_dim must be >= 1")
        if self.input_size < 0:
            raise ConfigError(f"model.input_size={self.input_size} is not valid: use 0 or >= 4")
