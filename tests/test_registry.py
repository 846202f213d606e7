"""The registries of formats, model families and tasks: a name is taken once."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from elastic.data.formats import FORMATS, DataFormat, register_format
from elastic.errors import ConfigError
from elastic.models import MODEL_SCHEMAS, ModelConfig, register_model
from elastic.tasks import TASKS, Task, register_task


class Array(DataFormat):  # another class under the built-in's name
    name = "array"


@dataclass
class MLP(ModelConfig):
    name: str = "mlp"
    task: str = "regression"


class Regression(Task):
    name = "regression"


@pytest.mark.parametrize(
    "register, obj, line",
    [
        (register_format, Array(), "data format 'array' is registered twice, by "
         "elastic.data.formats.DataFormat and by test_registry.Array: give one another name "
         "(data.format=NAME picks it)"),
        (register_model, MLP, "model 'mlp' is registered twice, by elastic.models.mlp.MLPConfig "
         "and by test_registry.MLP"),
        (register_task, Regression, "task 'regression' is registered twice, by "
         "elastic.tasks.regression.Regression and by test_registry.Regression"),
    ],
)  # fmt: skip
def test_a_second_object_under_a_taken_name_is_refused_naming_both(register, obj, line):
    registry = {register_format: FORMATS, register_model: MODEL_SCHEMAS, register_task: TASKS}
    before = dict(registry[register])
    with pytest.raises(ConfigError) as e:
        register(obj)
    assert line in str(e.value) and "\n" not in str(e.value)
    assert registry[register] == before  # the built-in is kept


def test_the_same_object_registered_again_is_not_a_conflict():
    fmt = FORMATS["array"]
    assert register_format(fmt) is fmt
    assert register_task(TASKS["vae"]) is TASKS["vae"]


def test_a_model_that_is_not_a_typed_config_is_refused():
    @dataclass
    class Loose:  # duck-typed, as plugins could be before the typed base
        name: str = "loose"
        task: str = "regression"
        output_dim: int = 1

    with pytest.raises(TypeError, match="must be a dataclass subclassing"):
        register_model(Loose)
    assert "loose" not in MODEL_SCHEMAS
