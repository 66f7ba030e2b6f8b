"""The activated plugins of one run, behind a narrow calling interface.

The runtime never touches pluggy directly: every hook call, whichever shape it has (all
plugins, a chain where each plugin transforms the previous one's output, one plugin's
configure), goes through :meth:`PluginHost._execute`. That one place

* honours pluggy's semantics everywhere: ``tryfirst``/``trylast`` order, *firstresult*, and
  ``@hookimpl(wrapper=True)`` wrappers (for a chained hook a wrapper wraps each plugin's link),
  executing through pluggy itself whenever a wrapper is involved; without one it calls the
  implementations directly, in pluggy's order, which is what keeps a per-iteration hook
  call in the hot path at well under a microsecond of dispatch;
* serialises the process's hook calls with one lock, so a plugin never sees two of its hook
  calls at once, whether they come from lanes, the transport's receiving threads or
  autograd's thread;
* times the call for the run's timeline (``trace``) and turns a plugin's exception into a
  :class:`PluginHookError` naming the plugin and the hook.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pluggy

from accelopt import hookspecs
from accelopt.errors import AccelOptError, PluginHookError
from accelopt.plugin import PluginSpec

HOOK_LOCK = threading.RLock()
"""Held around every hook call of this process (reentrant: a hook may trigger another)."""
_acquire, _release = HOOK_LOCK.acquire, HOOK_LOCK.release


Route = tuple[list[Any], bool,
              "tuple[tuple[Any, tuple[str, ...] | None, bool | None], ...] | None"]
"""How to call one hook: (pluggy's implementations, firstresult, the direct call list when no
wrapper is involved: see :func:`_direct`)."""


class PluginHost:
    """Owns the pluggy manager with the active plugins registered in activation order."""

    def __init__(self, active: Sequence[tuple[PluginSpec, object]] = ()) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.names: tuple[str, ...] = tuple(spec.name for spec, _ in active)
        self.specs: dict[str, PluginSpec] = {spec.name: spec for spec, _ in active}
        self.instances: dict[str, object] = {}
        # pluggy calls the most recently registered implementation first, so register in
        # reverse to have plugins called in activation (command-line) order.
        for spec, instance in reversed(list(active)):
            self.pm.register(instance, name=spec.name)
            self.instances[spec.name] = instance
        self.pm.check_pending()
        self._code_owner: dict[object, str] = {}
        self._impls: dict[str, list[Any]] = {}
        self._wrappers: dict[str, list[Any]] = {}
        self._routes: dict[str, Route] = {}
        self._links: dict[str, list[Route]] = {}
        self._no_answer: dict[str, Any] = {}
        self._spec_args: dict[str, tuple[str, ...]] = {}
        for name in dir(self.pm.hook):
            if not name.startswith("accelopt_"):
                continue
            caller = getattr(self.pm.hook, name)
            firstresult = bool(caller.spec.opts.get("firstresult"))
            self._no_answer[name] = None if firstresult else []
            impls = caller.get_hookimpls()  # pluggy order: called last-first
            if not impls:
                continue
            spec_args = self._spec_args[name] = tuple(caller.spec.argnames)
            wrappers = [i for i in impls if i.wrapper or i.hookwrapper]
            plain = [i for i in reversed(impls) if not (i.wrapper or i.hookwrapper)]
            self._impls[name], self._wrappers[name] = impls, wrappers
            self._routes[name] = (impls, firstresult,
                                  None if wrappers else _direct(plain, spec_args))
            self._links[name] = [([i, *wrappers], True,
                                  None if wrappers else _direct([i], spec_args))
                                 for i in plain]
            for impl in impls:
                self._code_owner[getattr(impl.function, "__code__", None)] = impl.plugin_name
        self._implemented = frozenset(self._impls)
        self.trace: list[tuple[str, float, float]] | None = None
        """When a list: every call appends (hook, start, end), ``time.perf_counter`` seconds
        (the run's ``hooks`` timeline track)."""

    # -- questions ---------------------------------------------------------------------------

    def hooks_of(self, plugin: str) -> frozenset[str]:
        """The hooks the plugin called ``plugin`` implements in this host."""
        return frozenset(hook for hook, impls in self._impls.items()
                         if any(i.plugin_name == plugin for i in impls))

    def implements(self, hook: str) -> bool:
        """Whether any active plugin implements ``hook`` (lets hot paths skip the call)."""
        return hook in self._implemented

    # -- calls -------------------------------------------------------------------------------

    def call(self, hook: str, **kwargs: Any) -> Any:
        """Call a hook on every implementing plugin: a list of answers, or the first answer
        that is not ``None`` for a *firstresult* hook."""
        route = self._routes.get(hook)
        if route is None:  # nobody implements it: the answer pluggy would give, for free
            return self._no_answer[hook]
        return self._execute(hook, route, kwargs)

    def bound(self, hook: str) -> Callable[..., Any] | None:
        """A caller of ``hook`` taking its arguments positionally, in the hookspec's order
        (``None`` when nobody implements it): the same path as :meth:`call` without building
        a keyword dict or a Python frame of its own, for the events a job's step fires every
        iteration."""
        route = self._routes.get(hook)
        if route is None:
            return None
        return functools.partial(self._execute, hook, route, None)

    def chain(
        self, hook: str, value: Any, make_kwargs: Callable[[Any], dict[str, Any]], *,
        reverse: bool = False,
    ) -> Any:
        """Call a hook plugin by plugin, building each call's arguments from the value the
        previous plugin returned (``None`` keeps it). Used where several plugins transform
        the same object: layers at build time, payloads in transit, the loss, the optimizer.
        ``reverse`` walks the plugins last-first (decoders undo encoders in reverse)."""
        links = self._links.get(hook)
        if links is None:
            return value
        for route in reversed(links) if reverse else links:
            out = self._execute(hook, route, make_kwargs(value))
            if out is not None:
                value = out
        return value

    def call_one(self, plugin: str, hook: str, **kwargs: Any) -> Any:
        """Call one plugin's implementation of a hook (each plugin gets its own config)."""
        for route in self._links.get(hook, ()):
            if route[0][0].plugin_name == plugin:
                return self._execute(hook, route, kwargs)
        return None

    def _execute(self, hook: str, route: Route, kwargs: dict[str, Any] | None,
                 *args: Any) -> Any:
        """The one path every hook call takes (see the module docstring): with the keyword
        arguments, or (``kwargs=None``) with the arguments in the hookspec's order."""
        impls, firstresult, direct = route
        trace = self.trace
        _acquire()  # acquire/release, not `with`: a third of the cost on this hot path
        start = time.perf_counter() if trace is not None else 0.0
        try:
            if kwargs is None and (direct is None or direct[0][2] is not None):
                kwargs = dict(zip(self._spec_args[hook], args, strict=True))
            if direct is None:  # a wrapper is involved: pluggy runs it
                return self.pm._hookexec(hook, impls, kwargs, firstresult)
            results = []
            for function, argnames, _ in direct:
                if argnames is None:  # it takes every argument, as the hookspec orders them
                    result = function(*args) if kwargs is None else function(**kwargs)
                else:
                    result = function(*[kwargs[a] for a in argnames])  # type: ignore[index]
                if result is not None:
                    if firstresult:
                        return result
                    results.append(result)
            return None if firstresult else results
        except AccelOptError as exc:
            if getattr(exc, "hook", None) is None:
                exc.hook = hook  # type: ignore[attr-defined]  # raised by a hook, on purpose
            raise
        except Exception as exc:
            raise PluginHookError(self._owner_of(exc, impls), hook, exc) from exc
        finally:
            if trace is not None:
                trace.append((hook, start, time.perf_counter()))
            _release()

    def _owner_of(self, exc: BaseException, impls: list[Any]) -> str:
        """The plugin whose code raised: the deepest frame that belongs to one, else the only
        plugin called."""
        tb = exc.__traceback__
        owner = None
        while tb is not None:
            name = self._code_owner.get(tb.tb_frame.f_code)
            if name is not None:
                owner = name
            tb = tb.tb_next
        if owner is None:
            plain = {i.plugin_name for i in impls if not (i.wrapper or i.hookwrapper)}
            owner = plain.pop() if len(plain) == 1 else "<unknown>"
        return owner


def _direct(impls: list[Any], spec_args: tuple[str, ...]
            ) -> tuple[tuple[Any, tuple[str, ...] | None, bool | None], ...]:
    """(function, argument names, a marker) per implementation, in call order. The names are
    ``None`` for an implementation that takes every argument of the spec (then called with
    the keywords or the positional arguments as they are, the cheapest calls Python has);
    the marker of the first entry is not ``None`` when some implementation takes a subset
    (then a positional call first builds the keywords)."""
    subset = any(tuple(i.argnames) != spec_args for i in impls)
    return tuple((i.function, None if tuple(i.argnames) == spec_args else tuple(i.argnames),
                  True if subset else None) for i in impls)
