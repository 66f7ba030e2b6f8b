"""The activated plugins of one run, behind a narrow calling interface.

The runtime never touches pluggy directly: it calls :meth:`PluginHost.call`, which adds the
two things pluggy leaves to us: an error that names the plugin and the hook that raised,
and an optional timing record of each hook call for the run's timeline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import pluggy

from accelopt import hookspecs
from accelopt.errors import AccelOptError, PluginHookError
from accelopt.plugin import PluginSpec

HookTimer = Callable[[str, float, float], None]


class PluginHost:
    """Owns the pluggy manager with the active plugins registered in activation order."""

    def __init__(self, active: Sequence[tuple[PluginSpec, object]] = ()) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.names: tuple[str, ...] = tuple(spec.name for spec, _ in active)
        self.instances: dict[str, object] = {}
        # pluggy calls the most recently registered implementation first, so register in
        # reverse to have plugins called in activation (command-line) order.
        for spec, instance in reversed(list(active)):
            self.pm.register(instance, name=spec.name)
            self.instances[spec.name] = instance
        self.pm.check_pending()
        self._code_owner: dict[object, str] = {}
        for name, instance in self.instances.items():
            for hook_caller in self.pm.get_hookcallers(instance) or []:
                for impl in hook_caller.get_hookimpls():
                    if impl.plugin is instance:
                        self._code_owner[getattr(impl.function, "__code__", None)] = name
        self.timer: HookTimer | None = None
        self._callers = {
            name: getattr(self.pm.hook, name)
            for name in dir(self.pm.hook)
            if name.startswith("accelopt_") and getattr(self.pm.hook, name).get_hookimpls()
        }
        self._implemented = frozenset(self._callers)
        self._no_answer: dict[str, Any] = {
            name: None if getattr(self.pm.hook, name).spec.opts.get("firstresult") else ()
            for name in dir(self.pm.hook)
            if name.startswith("accelopt_")
        }

    def implementing(self, hooks: frozenset[str]) -> list[str]:
        """The active plugins (activation order) that implement any of ``hooks``."""
        return [name for name in self.names
                if any(caller.name in hooks
                       for caller in self.pm.get_hookcallers(self.instances[name]) or [])]

    def implements(self, hook: str) -> bool:
        """Whether any active plugin implements ``hook`` (lets hot paths skip the call)."""
        return hook in self._implemented

    def call(self, hook: str, **kwargs: Any) -> Any:
        """Call a hook; a plugin's exception becomes :class:`PluginHookError`."""
        caller = self._callers.get(hook)
        if caller is None:  # nobody implements it: the answer pluggy would give, for free
            return self._no_answer[hook]
        timer = self.timer
        start = time.perf_counter() if timer is not None else 0.0
        try:
            return caller(**kwargs)
        except AccelOptError:
            raise
        except Exception as exc:
            raise PluginHookError(self._owner_of(exc), hook, exc) from exc
        finally:
            if timer is not None:
                timer(hook, start, time.perf_counter())

    def chain(
        self, hook: str, value: Any, make_kwargs: Callable[[Any], dict[str, Any]], *,
        reverse: bool = False,
    ) -> Any:
        """Call a hook plugin by plugin, building each call's arguments from the value the
        previous plugin returned (``None`` keeps it). Used where several plugins transform
        the same object: layers at build time, payloads in transit. ``reverse`` walks the
        plugins last-first (decoders undo encoders in reverse)."""
        if hook not in self._implemented:
            return value
        impls = getattr(self.pm.hook, hook).get_hookimpls()  # pluggy order: last-first
        for impl in impls if reverse else reversed(impls):
            kwargs = make_kwargs(value)
            try:
                out = impl.function(**{k: kwargs[k] for k in impl.argnames})
            except AccelOptError:
                raise
            except Exception as exc:
                raise PluginHookError(impl.plugin_name, hook, exc) from exc
            if out is not None:
                value = out
        return value

    def call_one(self, plugin: str, hook: str, **kwargs: Any) -> Any:
        """Call one plugin's implementation of a hook (each plugin gets its own config)."""
        for impl in getattr(self.pm.hook, hook).get_hookimpls():
            if impl.plugin_name == plugin:
                try:
                    return impl.function(**{k: kwargs[k] for k in impl.argnames})
                except AccelOptError:
                    raise
                except Exception as exc:
                    raise PluginHookError(plugin, hook, exc) from exc
        return None

    def _owner_of(self, exc: BaseException) -> str:
        tb = exc.__traceback__
        owner = "<unknown>"
        while tb is not None:
            name = self._code_owner.get(tb.tb_frame.f_code)
            if name is not None:
                owner = name
            tb = tb.tb_next
        return owner
