"""What a rank process cannot discover by itself: plugins and extensions the parent added in
code (a test's uninstalled ``PluginSpec``, a policy registered by a decorator), sent to each
spawned rank with the run so that it activates exactly the plugins the parent validated.

Objects travel by reference (pickle), so a spec's factory and config, and an extension
object, must be defined at module level of an importable module (or of the script that
started the run, outside its ``if __name__ == "__main__":``); anything else is refused in
one line before a process starts.
"""

from __future__ import annotations

import io
import pickle
import types
from dataclasses import dataclass, field
from typing import Any

from accelopt.drivers.processes import not_found_in_ranks
from accelopt.errors import UserError
from accelopt.extensions import code_extensions, restore_code_extensions
from accelopt.plugin import PluginSpec, Registry


@dataclass
class Carried:
    plugins: dict[str, PluginSpec] = field(default_factory=dict)
    extensions: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def of(cls, registry: Registry | None, selected: list[str] | None = None) -> Carried:
        """The parent's in-code additions (only the selected plugins, when given)."""
        added = dict(registry.added) if registry is not None else {}
        if selected is not None:
            added = {n: s for n, s in added.items() if n in selected}
        carried = cls(plugins=added, extensions=code_extensions())
        carried.check()
        return carried

    def check(self) -> None:
        for name, spec in self.plugins.items():
            _refuse_unsendable(spec, f"plugin '{name}' was added in code",
                               "define its factory and config")
        for group, objects in self.extensions.items():
            for name, obj in objects.items():
                _refuse_unsendable(obj, f"{group}: '{name}' was registered in code",
                                   "define it")

    def apply(self, registry: Registry) -> None:
        """In a rank: make the parent's additions known to this process."""
        restore_code_extensions(self.extensions)
        for spec in self.plugins.values():
            registry.add(spec)


def _refuse_unsendable(obj: Any, what: str, define: str) -> None:
    """Refuse, in one line saying ``what`` it is, an object a rank could not receive: one that
    does not pickle (``define``: what to put at module level), or one naming a class or
    function of ``__main__`` the ranks would not find."""
    try:
        missing = _missing_in_ranks(obj)
    except Exception as exc:
        raise UserError(
            f"{what} and cannot be sent to the cluster's rank processes "
            f"({type(exc).__name__}: {exc}); {define} at module level of an importable "
            "module, or install it") from None
    if missing:
        raise UserError(f"{what} and cannot be sent to the cluster's rank processes: {missing}")


def _missing_in_ranks(obj: Any) -> str:
    """Pickle ``obj`` as it will be sent (raising where it cannot be), and say which class or
    function of ``__main__`` that it names by reference a rank would not find, and why ('' for
    none): pickling alone let those through, and every rank then failed to load the run."""
    named: list[Any] = []

    class _Noting(pickle.Pickler):
        def reducer_override(self, value: Any) -> Any:
            if isinstance(value, (type, types.FunctionType)) \
                    and getattr(value, "__module__", None) == "__main__":
                named.append(value)
            return NotImplemented

    _Noting(io.BytesIO()).dump(obj)
    for each in dict.fromkeys(named):
        why = not_found_in_ranks(each)
        if why:
            kind = "class" if isinstance(each, type) else "function"
            return f"{kind} {each.__qualname__} {why}"
    return ""
