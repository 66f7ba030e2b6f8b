"""Keep torch from importing dynamo (its compiler) in a process that compiles nothing.

Why: two of torch's optimizer wrappers import ``torch._dynamo`` the first time they run,
only to talk to a compiler that is not running. ``torch._disable_dynamo`` (around
``Optimizer.add_param_group``, ``zero_grad``, ``state_dict``...) imports it to ask for a
"disabled" version of the function, and ``_use_grad_for_differentiable`` (around every
optimizer's ``step``) imports it to call ``graph_break()``, a no-op outside compilation.
Building and stepping a job's optimizer therefore imports dynamo: ~1.1 s of CPU on this
2-core VM, paid by a one-process run before its first iteration and by the ranks'
forkserver on the critical path of every cluster run's start (``benchmarks/startup.py``).

What :func:`defer_dynamo_import` does, for the wrappers torch has made so far:

* a ``torch._disable_dynamo`` wrapper looks its disabled function up first in an attribute
  of the wrapped function (its cache); that attribute is set to the function itself, which
  is what the disabled version runs when nothing is being compiled;
* a ``_use_grad_for_differentiable`` wrapper gets the same code without the two
  ``graph_break()`` calls (and without the import).

Nothing can be compiled before dynamo is imported, so until then both are exactly what
torch would run. The moment anything starts importing dynamo (``torch.compile``, a
``DistributedDataParallel``, a user's ``import torch._dynamo``), an import hook puts
torch's own wrappers back, before dynamo's first line runs, and removes itself: from then
on torch behaves exactly as it would have, compiled frames included.

The wrappers' shapes are torch's private details: whichever of them this torch does not
have as expected is left alone (torch then imports dynamo as usual; nothing breaks).
"""

from __future__ import annotations

import gc
import importlib.abc
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

_CACHE = "__dynamo_disable"
"""The attribute of a wrapped function where ``torch._disable_dynamo``'s wrapper caches its
disabled version (``torch/_compile.py``)."""

_DYNAMO = "torch._dynamo"


def _use_grad_for_differentiable(func: Callable[..., Any]) -> Callable[..., Any]:
    """torch's ``_use_grad_for_differentiable`` (``torch/optim/optimizer.py``) as it runs when
    nothing compiles: the ``graph_break()`` calls, no-ops outside compilation, left out. Only
    the code of the function it makes is used, swapped into torch's own wrappers, where
    ``torch`` is read from their module's globals."""

    def _use_grad(*args: Any, **kwargs: Any) -> Any:
        self = args[0]
        prev_grad = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            ret = func(*args, **kwargs)
        finally:
            torch.set_grad_enabled(prev_grad)
        return ret

    return _use_grad


_done = False


class _Restore(importlib.abc.MetaPathFinder):
    """Puts torch's own wrappers back when dynamo's import starts (finds nothing itself)."""

    def __init__(self, cached: Sequence[types.FunctionType],
                 swapped: Sequence[tuple[types.FunctionType, types.CodeType]]) -> None:
        self.cached, self.swapped = cached, swapped

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname == _DYNAMO:
            self.restore()
        return None

    def restore(self) -> None:
        for fn in self.cached:
            if fn.__dict__.get(_CACHE) is fn:
                del fn.__dict__[_CACHE]
        for wrapper, code in self.swapped:
            wrapper.__code__ = code
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def defer_dynamo_import() -> int:
    """Make the optimizer wrappers torch has created so far run without importing dynamo
    until something else imports it (see the module docstring); returns how many wrappers
    were changed. Once per process (a forked rank inherits the forkserver's): a second call
    returns 0 at once."""
    global _done
    if _done or _DYNAMO in sys.modules:
        return 0
    _done = True
    disabler, use_grad = _disable_dynamo_code(), _use_grad_code()
    if disabler is None and use_grad is None:
        return 0
    replacement = _use_grad_replacement() if use_grad is not None else None
    cached: list[types.FunctionType] = []
    swapped: list[tuple[types.FunctionType, types.CodeType]] = []
    for obj in _every_tracked_object():  # functions are tracked: every wrapper made so far
        if type(obj) is not types.FunctionType:
            continue
        if obj.__code__ is disabler:
            fn = obj.__closure__[disabler.co_freevars.index("fn")].cell_contents  # type: ignore[index]
            if isinstance(fn, types.FunctionType) and _CACHE not in fn.__dict__:
                fn.__dict__[_CACHE] = fn
                cached.append(fn)
        elif obj.__code__ is use_grad and replacement is not None:
            obj.__code__ = replacement
            swapped.append((obj, use_grad))
    if cached or swapped:
        sys.meta_path.insert(0, _Restore(cached, swapped))
    return len(cached) + len(swapped)


def _every_tracked_object() -> list[object]:
    """Every object the collector tracks, frozen ones included: ``gc.get_objects()`` leaves
    out what ``gc.freeze()`` moved to the permanent generation (the ``accelopt`` command
    freezes its imports when its run starts, ``collector.run_starts``, before the run sets
    torch up), so they are unfrozen for the scan and frozen again after it, with whatever
    the process made since (never garbage either: imports and configuration)."""
    frozen = gc.get_freeze_count()
    if frozen:
        gc.unfreeze()
    try:
        return gc.get_objects()
    finally:
        if frozen:
            gc.freeze()


def _inner_code(factory: object, name: str, freevars: set[str]) -> types.CodeType | None:
    """The code of the function called ``name`` that ``factory`` makes, if it closes over
    exactly ``freevars``."""
    for const in getattr(getattr(factory, "__code__", None), "co_consts", ()):
        if (isinstance(const, types.CodeType) and const.co_name == name
                and set(const.co_freevars) == freevars):
            return const
    return None


def _disable_dynamo_code() -> types.CodeType | None:
    """The code of the wrapper ``torch._disable_dynamo(fn)`` returns, if it caches as this
    module expects."""
    try:
        from torch import _compile
    except ImportError:
        return None
    code = _inner_code(getattr(_compile, "_disable_dynamo", None), "inner", {"fn", "recursive"})
    return code if code is not None and _CACHE in code.co_consts else None


def _use_grad_code() -> types.CodeType | None:
    """The code of the wrapper ``_use_grad_for_differentiable(func)`` returns, if it is the
    one this module's replacement mirrors (it imports dynamo only to break graphs) and its
    module has ``torch`` among its globals, as the replacement expects."""
    try:
        from torch.optim import optimizer
    except ImportError:
        return None
    code = _inner_code(getattr(optimizer, "_use_grad_for_differentiable", None),
                       "_use_grad", {"func"})
    if code is None or set(code.co_names) != {"torch._dynamo", "_dynamo", "graph_break", "cast",
                                              "Optimizer", "is_grad_enabled",
                                              "set_grad_enabled", "defaults"}:
        return None
    return code if getattr(optimizer, "torch", None) is torch else None


def _use_grad_replacement() -> types.CodeType | None:
    """The code of :func:`_use_grad_for_differentiable`'s wrapper."""
    return _inner_code(_use_grad_for_differentiable, "_use_grad", {"func"})
