"""What a rank process cannot discover by itself: plugins and extensions the parent added in
code (a test's uninstalled ``PluginSpec``, a policy registered by a decorator), sent to each
spawned rank with the run so that it activates exactly the plugins the parent validated.

Objects travel by reference (pickle), so a spec's factory and config, and an extension
object, must be defined at module level of an importable module; anything else is refused in
one line before a process starts.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

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
            try:
                pickle.dumps(spec)
            except Exception as exc:
                raise UserError(
                    f"plugin '{name}' was added in code and cannot be sent to the cluster's rank "
                    f"processes ({type(exc).__name__}: {exc}); define its factory and config at "
                    "module level of an importable module, or install it") from None
        for group, objects in self.extensions.items():
            for name, obj in objects.items():
                try:
                    pickle.dumps(obj)
                except Exception as exc:
                    raise UserError(
                        f"{group}: '{name}' was registered in code and cannot be sent to the "
                        f"cluster's rank processes ({type(exc).__name__}: {exc}); define it at "
                        "module level of an importable module, or install it") from None

    def apply(self, registry: Registry) -> None:
        """In a rank: make the parent's additions known to this process."""
        restore_code_extensions(self.extensions)
        for spec in self.plugins.values():
            registry.add(spec)
