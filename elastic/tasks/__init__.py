"""Tasks: what a model is trained to do (its targets, loss and metrics), by name.

``model.task=NAME`` picks a registered :class:`Task`; the core (the checks before Ray,
the training loop, validation) asks it and never names a task itself. The built-ins are
a module each here (regression, classification, multitask, vae); a task of your own is a
plugin module that subclasses :class:`Task` and registers it with :func:`register_task`
(README "Your own task").
"""

from __future__ import annotations

from elastic.tasks import classification, multitask, regression, vae
from elastic.tasks.base import TASKS, MetricSums, Task, register_task, task_of

__all__ = [
    "TASKS",
    "MetricSums",
    "Task",
    "register_task",
    "task_of",
    "classification",
    "multitask",
    "regression",
    "vae",
]
