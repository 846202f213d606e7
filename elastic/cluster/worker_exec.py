"""Start a Ray worker process: what Ray's ``setup_worker.py`` does, without importing Ray.

The raylet starts every Python worker as ``python setup_worker.py <worker args>``: Ray's
script imports Ray (about a second of CPU) to set the runtime env's variables, then
execs bash, which execs the real worker (``default_worker.py``), which imports Ray again.
A worker group start, a restart after a failure and a read task's process each pay it.
This script does the same for what elastic's jobs give their workers (environment
variables, this Python) with the standard library only, and execs the worker directly;
anything else (a command prefix such as a container or conda, another entry point,
another language) goes to Ray's own script unchanged.

Installed by :func:`elastic.cluster.ray_internals.fast_worker_start`. Run as a script by
the raylet: it imports nothing of elastic.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys

CONTEXT, LANGUAGE = "--serialized-runtime-env-context", "--language"
MARK = "ELASTIC_WORKER_EXEC"
"""Set in the worker's environment: it was started here (the tests check it)."""


def _split(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """The two options Ray's setup script reads, and the worker's own arguments."""
    ours: dict[str, str] = {}
    rest: list[str] = []
    args = iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if name in (CONTEXT, LANGUAGE):
            ours[name] = value if eq else next(args, "")
        else:
            rest.append(arg)
    return ours, rest


def _a_path(python: str) -> bool:
    """``python`` is an absolute path with nothing for a shell to do: Ray's script hands
    it to bash (a command line such as ``uv run ...``, a name found on PATH, ``~`` or
    ``$VAR`` in it), elastic's execs it as it is."""
    return os.path.isabs(python) and shlex.quote(python) == python


def _ray_setup_worker(argv: list[str]) -> None:
    """Hand the start to Ray's own script (found beside Ray, not by importing it)."""
    for path in sys.path:
        script = os.path.join(path or ".", "ray", "_private", "workers", "setup_worker.py")
        if os.path.isfile(script):
            os.execv(sys.executable, [sys.executable, script, *argv])
    raise SystemExit("elastic worker_exec: Ray's setup_worker.py is not on sys.path")


def main(argv: list[str]) -> None:
    ours, rest = _split(argv)
    try:
        context = json.loads(ours.get(CONTEXT) or "{}")
    except ValueError:
        context = None
    plain = (
        isinstance(context, dict)
        and ours.get(LANGUAGE) == "PYTHON"
        and not context.get("command_prefix")
        and not context.get("override_worker_entrypoint")
        and not context.get("java_jars")
        and set(context) <= {"command_prefix", "env_vars", "py_executable",
                             "override_worker_entrypoint", "java_jars"}
        and _a_path(context.get("py_executable") or sys.executable)
    )  # fmt: skip
    if not plain:
        _ray_setup_worker(argv)
        return
    assert isinstance(context, dict)
    for key, value in (context.get("env_vars") or {}).items():
        # as Ray's update_envs: $X and ${X} expanded, an unset ${X} removed
        os.environ[key] = re.sub(r"\$\{[A-Z0-9_]+\}", "", os.path.expandvars(value))
    os.environ[MARK] = "1"
    python = context.get("py_executable") or sys.executable
    os.execv(python, [python, *rest])


if __name__ == "__main__":
    main(sys.argv[1:])
