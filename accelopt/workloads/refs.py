"""``"package.module:factory"`` references: workloads may name a model or dataset built elsewhere.

The zoo knows its own names; anything else a workload needs (a plugin's sparse dataset, a
user's model) is named by an import reference and built by calling the factory with the same
keyword arguments the zoo builders take. This keeps the core free of any plugin import while
letting a workload run unchanged with or without the plugin that optimises it.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def is_ref(name: str | None) -> bool:
    """A reference has the form ``module.path:attribute`` (zoo names never contain ':')."""
    return bool(name) and ":" in str(name)


def resolve_ref(ref: str, what: str) -> Callable[..., Any]:
    """Import the factory ``ref`` points to, or raise ``ValueError`` in one line that says why."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr.isidentifier():
        raise ValueError(f"{what} reference {ref!r} must look like 'package.module:factory'")
    try:
        module = import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} reference {ref!r}: cannot import {module_name!r} ({exc})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"{what} reference {ref!r}: {module_name!r} has no callable {attr!r}")
    return factory  # type: ignore[no-any-return]
