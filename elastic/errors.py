"""The project's error classes, at the bottom of the import graph (they import nothing).

A :class:`RunError` fails again the same way on a retry (a bad row, a checkpoint that
does not fit the model, a non-finite loss): the run ends at its first occurrence with
its one-line message instead of Ray Train restarting the worker group on it. Only
infrastructure failures (a dead worker or node) count against ``scaling.max_failures``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


class ConfigError(ValueError):
    """A user-fixable configuration mistake; the message is one line naming key and fix."""


class RunError(Exception):
    """An error a retry cannot fix, found while training; one line naming the cause."""


class DataError(RunError, ValueError):
    """A dataset row that cannot be used, found while training (an image that does not
    decode, a contact map of another size): the run stops at once with this one line,
    since retrying cannot help. The last complete checkpoint is kept."""


class CheckpointError(RunError):
    """A checkpoint that cannot be resumed from (damaged, or written for another model)."""


class DivergedError(RunError):
    """Training produced a non-finite loss or gradient: the run stops at that step."""


class UserCodeError(RunError):
    """An exception raised inside a plugin's own code (a format's decoder, finisher or
    augmentation, a model's ``build``): it fails the same way on every retry, so the run
    ends at once with one line naming the function, the exception and the fix."""


class ClusterUnavailableError(RunError):
    """The cluster cannot hold a worker group now (nodes gone below
    ``scaling.min_workers``, for longer than ``scaling.placement_timeout_s``): not a
    mistake to fix but a state to wait out; the entry point ends with exit 75 (the same
    command resumes, e.g. a requeued batch job on new nodes)."""


class StorageFullError(RunError):
    """The run's storage has no room left (a checkpoint, a record): a retry would fill it
    again. The last complete checkpoint is kept."""


# every RunError class, by the name Ray's tracebacks carry it under
RUN_ERRORS = (
    "DataError",
    "CheckpointError",
    "DivergedError",
    "UserCodeError",
    "StorageFullError",
    "ClusterUnavailableError",
    "RunError",
)


def user_code_site(exc: BaseException) -> str:
    """``file.py:LINE`` of the innermost frame of ``exc``'s traceback that is neither the
    library's nor a package it runs on (numpy, torch, ...): where in a plugin it went
    wrong (else the innermost frame)."""
    import os
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    library = os.path.dirname(os.path.abspath(__file__)) + os.sep
    others = [f"{os.sep}site-packages{os.sep}{p}" for p in _RUNS_ON]
    own = [
        f
        for f in frames
        if not f.filename.startswith(library) and not any(o in f.filename for o in others)
    ]
    if not (own or frames):
        return "?"
    frame = (own or frames)[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno}"


_RUNS_ON = ("numpy", "torch", "pyarrow", "ray", "pandas", "deepspeed")


@contextmanager
def user_code(what: str, fix: str) -> Iterator[None]:
    """Run a plugin's code (``what``: e.g. "format 'frames' decoder"): an exception it
    raises becomes a :class:`UserCodeError`, one line naming ``what``, the exception, its
    place and the ``fix``. A :class:`RunError` it raises on purpose goes on as it is, and
    so does a :func:`transient` one (out of memory, an I/O error: retried as before)."""
    try:
        yield
    except RunError:
        raise
    except Exception as e:
        if transient(e):
            raise
        raise UserCodeError(
            f"{what} raised {type(e).__name__}: {exception_text(e)} ({user_code_site(e)}): {fix}"
        ) from e


def transient(e: BaseException) -> bool:
    """Whether ``e`` may well not happen again on a retry, wherever it was raised: the
    machine's state, not the code (memory, I/O, Ray's own errors)."""
    if isinstance(e, (MemoryError, OSError)) or "OutOfMemory" in type(e).__name__:
        return True
    return type(e).__module__.startswith("ray.")


def exception_text(e: BaseException, limit: int = 300) -> str:
    """``e``'s message on one line, at most ``limit`` characters."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_error(exc: BaseException) -> str | None:
    """The message of a :class:`RunError` anywhere in ``exc``'s chain, else None."""
    found = find_run_error(exc)
    return found[1] if found else None


def find_run_error(exc: BaseException) -> tuple[str, str] | None:
    """(class name, message) of a :class:`RunError` anywhere in ``exc``'s chain, else None.
    Ray wraps a worker's (or a Ray Data task's) exception on its way, and by then the
    error may only survive as the last line of the traceback text it carries."""
    for e in exception_chain(exc):
        if isinstance(e, RunError):
            return type(e).__name__, str(e).strip().splitlines()[-1]
        for line in reversed(str(e).strip().splitlines()):
            for name in RUN_ERRORS:
                _, sep, message = line.partition(f"{name}: ")
                if sep:
                    return name, message.strip()
    return None


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception behind it (``__cause__``, ``__context__``, and the
    ``cause`` Ray's wrappers carry), each once."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__, getattr(e, "cause", None)]


EXIT_USER_ERROR = 2


@contextmanager
def one_line_errors(*kinds: type[BaseException]) -> Iterator[None]:
    """A command's user mistakes (``kinds``) end it with one line on stderr, exit 2."""
    try:
        yield
    except kinds as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None
