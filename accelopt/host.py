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
* times the call for the run's timeline (``timer``) and turns a plugin's exception into a
  :class:`PluginHookError` naming the plugin and the hook.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pluggy

from accelopt import hookspecs
from accelopt.errors import AccelOptError, PluginHookError
from accelopt.plugin import PluginSpec

HookTimer = Callable[[str, float, float], None]
HOOK_LOCK = threading.RLock()
"""Held around every hook call of this process (reentrant: a hook may trigger another)."""


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
        self._firstresult: dict[str, bool] = {}
        self._plain: dict[str, list[tuple[Any, tuple[str, ...]]]] = {}
        for name in dir(self.pm.hook):
            if not name.startswith("accelopt_"):
                continue
            caller = getattr(self.pm.hook, name)
            self._firstresult[name] = bool(caller.spec.opts.get("firstresult"))
            impls = caller.get_hookimpls()  # pluggy order: called last-first
            if impls:
                self._impls[name] = impls
                self._wrappers[name] = [i for i in impls if i.wrapper or i.hookwrapper]
                self._plain[name] = [(i.function, i.argnames) for i in reversed(impls)]
                for impl in impls:
                    self._code_owner[getattr(impl.function, "__code__", None)] = impl.plugin_name
        self._implemented = frozenset(self._impls)
        self.timer: HookTimer | None = None

    # -- questions ---------------------------------------------------------------------------

    def implements(self, hook: str) -> bool:
        """Whether any active plugin implements ``hook`` (lets hot paths skip the call)."""
        return hook in self._implemented

    def implementing(self, hooks: frozenset[str]) -> list[str]:
        """The active plugins (activation order) that implement any of ``hooks``."""
        owners = {impl.plugin_name for hook in hooks for impl in self._impls.get(hook, ())}
        return [name for name in self.names if name in owners]

    # -- calls -------------------------------------------------------------------------------

    def call(self, hook: str, **kwargs: Any) -> Any:
        """Call a hook on every implementing plugin: a list of answers, or the first answer
        that is not ``None`` for a *firstresult* hook."""
        impls = self._impls.get(hook)
        if impls is None:  # nobody implements it: the answer pluggy would give, for free
            return None if self._firstresult[hook] else []
        return self._execute(hook, impls, kwargs, self._firstresult[hook],
                             None if self._wrappers[hook] else self._plain[hook])

    def chain(
        self, hook: str, value: Any, make_kwargs: Callable[[Any], dict[str, Any]], *,
        reverse: bool = False,
    ) -> Any:
        """Call a hook plugin by plugin, building each call's arguments from the value the
        previous plugin returned (``None`` keeps it). Used where several plugins transform
        the same object: layers at build time, payloads in transit, the loss, the optimizer.
        ``reverse`` walks the plugins last-first (decoders undo encoders in reverse)."""
        impls = self._impls.get(hook)
        if impls is None:
            return value
        wrappers = self._wrappers[hook]
        links = [i for i in impls if not (i.wrapper or i.hookwrapper)]
        for impl in links if reverse else reversed(links):
            plain = None if wrappers else [(impl.function, impl.argnames)]
            out = self._execute(hook, [impl, *wrappers], make_kwargs(value), True, plain)
            if out is not None:
                value = out
        return value

    def call_one(self, plugin: str, hook: str, **kwargs: Any) -> Any:
        """Call one plugin's implementation of a hook (each plugin gets its own config)."""
        impls = self._impls.get(hook, ())
        own = [i for i in impls if i.plugin_name == plugin and not (i.wrapper or i.hookwrapper)]
        if not own:
            return None
        wrappers = self._wrappers[hook]
        plain = None if wrappers else [(i.function, i.argnames) for i in reversed(own)]
        return self._execute(hook, [*own, *wrappers], kwargs, True, plain)

    def _execute(self, hook: str, impls: list[Any], kwargs: dict[str, Any],
                 firstresult: bool, plain: list[tuple[Any, tuple[str, ...]]] | None) -> Any:
        """The one path every hook call takes (see the module docstring). ``plain``: the
        implementations' functions and argument names in call order when no wrapper is
        involved (then called directly, exactly as pluggy would), else ``None``."""
        timer = self.timer
        with HOOK_LOCK:
            start = time.perf_counter() if timer is not None else 0.0
            try:
                if plain is None:
                    return self.pm._hookexec(hook, impls, kwargs, firstresult)
                results = []
                for function, argnames in plain:
                    result = function(*[kwargs[a] for a in argnames])
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
                if timer is not None:
                    timer(hook, start, time.perf_counter())

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
