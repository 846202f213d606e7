"""torch's compiler front end (``torch._dynamo``), imported only by what compiles.

Eager code in torch 2.13 and DeepSpeed 0.19.8 imports ``torch._dynamo`` without
compiling anything: every optimizer step (``torch/optim/optimizer.py``, ``_use_grad``:
``import torch._dynamo`` and two ``graph_break()`` calls), the optimizer's
``add_param_group`` and ``state_dict`` (``torch._disable_dynamo``), ZeRO 3's module
hooks (``torch.compiler.disable``). That import is ~2 CPU s in every worker process at
every worker-group start, for a compiler elastic never runs.

:func:`defer` puts a stand-in under the name ``torch._dynamo``. It answers the two
calls eager code makes the way the real module does outside a compiled region:
``graph_break()`` does nothing, and ``disable(fn)`` returns ``fn`` wrapped so that it
calls the real ``disable(fn)`` once the real module is loaded. Any other attribute (what
``torch.compile``, a submodule import or a user's plugin reaches for) loads the real
module first and answers from it; from then on ``torch._dynamo`` is the real module.
So the stand-in never changes a result, only when the import is paid.
``tests/test_engine.py`` checks both halves: a real DeepSpeed run (ZeRO 0-3, checkpoint
and restore) never loads the real module, and ``torch.compile`` after :func:`defer`
compiles and honours a function disabled before it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import threading
import types
from typing import Any

NAME = "torch._dynamo"
_lock = threading.RLock()
_FROM_REAL = ("__path__", "__file__")  # a submodule's import loads the real one first


class _Deferred(types.ModuleType):
    """The stand-in: ``graph_break`` and ``disable`` without the import, the rest from
    the real module (loaded on first use)."""

    def __init__(self) -> None:
        super().__init__(NAME, "torch._dynamo, loaded when more than eager code needs it")
        self.__dict__["_real"] = None
        # what importlib reads without loading: a module that is not initializing
        self.__spec__ = importlib.util.find_spec(NAME)

    def _load(self) -> types.ModuleType:
        with _lock:
            real = self.__dict__["_real"]
            if real is None:
                if sys.modules.get(NAME) is self:
                    del sys.modules[NAME]
                real = importlib.import_module(NAME)
                self.__dict__["_real"] = real
            return real

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name not in _FROM_REAL:
            raise AttributeError(name)  # copy/pickle probes: not a reason to load
        return getattr(self._load(), name)

    @property
    def trace_rules(self) -> Any:
        """``torch.distributed.init_process_group`` clears this module's caches when
        ``torch._dynamo`` is imported: nothing to clear before the real one is."""
        real = self.__dict__["_real"]
        return real.trace_rules if real is not None else _NO_TRACE_RULES

    def graph_break(self, msg: str = "") -> None:
        real = self.__dict__["_real"]
        if real is not None:
            real.graph_break(msg)

    def disable(
        self, fn: Any = None, recursive: bool = True, *, reason: Any = None, wrapping: bool = True
    ) -> Any:
        real = self.__dict__["_real"]
        if real is not None:
            return real.disable(fn, recursive, reason=reason, wrapping=wrapping)
        if fn is None:
            return functools.partial(self.disable, recursive=recursive, reason=reason)
        disabled: list[Any] = []

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if disabled:
                return disabled[0](*args, **kwargs)
            real = self.__dict__["_real"]
            if real is None:  # nothing compiles without the real module: plain eager
                return fn(*args, **kwargs)
            disabled.append(real.disable(fn, recursive, reason=reason))
            return disabled[0](*args, **kwargs)

        return call


_NO_TRACE_RULES = types.SimpleNamespace(clear_lru_cache=lambda: None)


def defer() -> None:
    """Install the stand-in, if ``torch._dynamo`` is not imported yet. Call it before
    DeepSpeed or an optimizer is built; idempotent."""
    with _lock:
        if NAME in sys.modules:
            return
        import torch

        stand_in = _Deferred()
        sys.modules[NAME] = stand_in
        torch._dynamo = stand_in


def loaded() -> bool:
    """Whether the real ``torch._dynamo`` has been imported in this process."""
    module = sys.modules.get(NAME)
    return module is not None and not (
        isinstance(module, _Deferred) and module.__dict__["_real"] is None
    )
