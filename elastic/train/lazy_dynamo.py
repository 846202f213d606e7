"""torch's compiler front end (``torch._dynamo``), imported only by what compiles.

Eager code in torch 2.13 and DeepSpeed 0.19.8 imports ``torch._dynamo`` without
compiling anything: every optimizer step (``torch/optim/optimizer.py``, ``_use_grad``:
``import torch._dynamo`` and two ``graph_break()`` calls), the optimizer methods torch
wraps in ``torch._disable_dynamo`` (``add_param_group``, ``zero_grad``, ``state_dict``,
``load_state_dict``), ZeRO 3's module hooks (``torch.compiler.disable``),
``torch.distributed.init_process_group`` (``trace_rules.clear_lru_cache()``). That
import is ~2 CPU s in every worker process at every worker-group start, for a compiler
elastic never runs.

:func:`defer` puts a stand-in under the name ``torch._dynamo`` that answers those uses
as the real module does outside a compiled region: ``graph_break()`` does nothing,
``disable(f)`` of a plain function returns ``f`` wrapped so that it calls the real
``disable(f)`` once the real module is loaded, and ``trace_rules.clear_lru_cache()``
has no cache to clear. Anything else (any other attribute or assignment, ``disable``
of a module or class, a submodule's import: what ``torch.compile``, a plugin or a
library reaches for) imports the real module first and is answered by it; from then
on ``torch._dynamo`` is the real module, and a submodule the real import brought in is
not run a second time. What differs until then: the real import's side effect of
allowing nested jagged tensors' ``_DimRange`` in ``torch.load(weights_only=True)``; and
under ``torch.compile`` a function disabled before the load is reached through a small
wrapper that dynamo traces up to the real ``disable`` (a graph break, as for any
disabled function).

Private torch API, checked against torch 2.13.0: ``tests/test_engine.py`` runs DeepSpeed
at every ZeRO stage, bf16, Adam, clipping and a checkpoint round trip without loading the
real module, then ``torch.compile``, a submodule import and ``disable`` of a module
through the stand-in, each answered as by the real module.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
import threading
import types
from typing import Any

NAME = "torch._dynamo"


_stand_in: _Deferred | None = None  # the one defer() installed, if any
_lock = threading.Lock()


def _real() -> types.ModuleType | None:
    """The real module, once its import has finished."""
    if _stand_in is not None:
        return _stand_in.__dict__["_real"]
    return sys.modules.get(NAME)


def _load() -> types.ModuleType:
    """Import the real module (once) and point the stand-in at it."""
    stand_in = _stand_in
    if stand_in is None:
        return importlib.import_module(NAME)
    real = stand_in.__dict__["_real"]
    if real is not None:
        return real
    with _lock:  # the pop only: the import waits on Python's own import lock
        if sys.modules.get(NAME) is stand_in:
            del sys.modules[NAME]
    try:
        real = importlib.import_module(NAME)
    except BaseException:
        with _lock:
            sys.modules.setdefault(NAME, stand_in)
        raise
    stand_in.__dict__["_real"] = real
    return real


class _Deferred(types.ModuleType):
    """The stand-in: ``graph_break``, ``disable`` of a function and ``trace_rules``
    without the import; everything else from the real module, loaded on first use."""

    def __init__(self, spec: importlib.machinery.ModuleSpec) -> None:
        super().__init__(NAME, "torch._dynamo, imported when more than eager code needs it")
        self.__dict__["_real"] = None
        # what an import statement (a module not initializing) and inspect read,
        # without loading; not __path__: a submodule's import loads the package first
        self.__dict__.update(
            __spec__=spec, __loader__=spec.loader, __file__=spec.origin, __package__=NAME
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name not in ("__path__", "__all__"):
            raise AttributeError(name)  # copy/pickle/inspect probes: no reason to load
        return getattr(_load(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(_load(), name, value)

    def __delattr__(self, name: str) -> None:
        delattr(_load(), name)

    @property
    def trace_rules(self) -> Any:
        real = _real()
        return real.trace_rules if real is not None else _NoTraceRules()

    def graph_break(self, msg: str = "") -> None:
        real = _real()
        if real is not None:
            real.graph_break(msg)

    def disable(self, fn: Any = None, recursive: bool = True, **kwargs: Any) -> Any:
        real = _real()
        if real is not None or not (inspect.isfunction(fn) or inspect.ismethod(fn)):
            # loaded, or a module, a class, a decorator factory: as dynamo does it
            return (real or _load()).disable(fn, recursive, **kwargs)
        return _disabled_later(fn, recursive, kwargs)


def _disabled_later(fn: Any, recursive: bool, kwargs: dict[str, Any]) -> Any:
    """``fn``, called as it is while nothing can compile (no real module), through the
    real ``disable(fn)`` from the moment the real module is loaded."""
    kwargs.pop("wrapping", None)  # ours always wraps
    disabled: list[Any] = []

    @functools.wraps(fn)
    def call(*args: Any, **kw: Any) -> Any:
        if not disabled:
            real = _real()
            if real is None:
                return fn(*args, **kw)
            disabled.append(real.disable(fn, recursive, **kwargs))
        return disabled[0](*args, **kw)

    return call


class _NoTraceRules:
    """``trace_rules`` before the real module: no caches to clear; anything else is
    the real one's."""

    def clear_lru_cache(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(_load().trace_rules, name)


class _AlreadyLoaded(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """An import of ``torch._dynamo.<x>`` that reached the stand-in first: Python's
    import system checks ``sys.modules`` for ``<x>``, then reads the package's
    ``__path__``, which loads the real package, whose own import may bring ``<x>`` in;
    the import system would then run ``<x>`` a second time, a second copy beside the
    one dynamo uses. An import (not a reload: that passes its module as ``target``) that
    asks the finders for a module already in ``sys.modules`` can only be that one: this
    hands it the module already loaded."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        module = sys.modules.get(name)
        if target is not None or module is None or not name.startswith(NAME + "."):
            return None
        old = getattr(module, "__spec__", None)
        spec = importlib.util.spec_from_loader(name, self, origin=old.origin if old else None)
        assert spec is not None
        spec.loader_state = old
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return sys.modules[spec.name]

    def exec_module(self, module: types.ModuleType) -> None:
        spec = module.__spec__
        if spec is not None and spec.loader is self:  # the import system replaced it
            module.__spec__ = spec.loader_state


def defer() -> None:
    """Install the stand-in, if ``torch._dynamo`` is not imported yet (else nothing
    changes); idempotent. :func:`elastic.train.engine.init_distributed` calls it, the
    worker's entry first thing: it helps only before anything imports the real one."""
    global _stand_in
    with _lock:
        if NAME in sys.modules:
            return
        import torch

        spec = importlib.util.find_spec(NAME)  # finds the package, runs nothing
        assert spec is not None, NAME
        sys.meta_path.insert(0, _AlreadyLoaded())
        _stand_in = _Deferred(spec)
        sys.modules[NAME] = _stand_in
        torch.__dict__["_dynamo"] = _stand_in


def loaded() -> bool:
    """Whether the real ``torch._dynamo`` has been imported in this process."""
    return _real() is not None
