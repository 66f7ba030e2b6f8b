"""Check a hookspec module against its reference documentation (datasette-style docs tests).

Each hookspec's docstring ends with three fields, ``Called:``, ``Ranks:`` and ``Thread:``
(where and by whom it is called, on which processes, on which thread); the reference page
repeats the signature and the three fields under a ``### hook_name`` heading. These helpers
read both sides so a test can compare them; ``tests/test_hook_docs.py`` uses them for
accelopt's own hooks, and a plugin that publishes hookspecs of its own can reuse them.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

FIELDS = ("Called", "Ranks", "Thread")


def signature_line(name: str, spec: Callable[..., Any]) -> str:
    """``name(arg: Type, ...) -> Return`` as the reference page writes it (annotations as
    written in the hookspec)."""
    sig = inspect.signature(spec)

    def text(annotation: Any) -> str:
        return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)

    args = ", ".join(f"{p.name}: {text(p.annotation)}" for p in sig.parameters.values())
    return f"{name}({args}) -> {text(sig.return_annotation)}"


def fields(spec: Callable[..., Any]) -> dict[str, str]:
    """The docstring's ``Called``/``Ranks``/``Thread`` fields, whitespace collapsed (a field
    runs to the next field or the end of the docstring)."""
    names = "|".join(FIELDS)
    return _collapsed(rf"^({names}):\s*(.*?)(?=^(?:{names}):|\Z)", inspect.getdoc(spec) or "")


def summary(spec: Callable[..., Any]) -> str:
    """The docstring's first paragraph."""
    doc = inspect.getdoc(spec) or ""
    return " ".join(doc.split("\n\n")[0].split())


def section(page: str, hook: str) -> str:
    """The text under ``### hook`` on a reference page (empty if there is none)."""
    match = re.search(rf"^### {re.escape(hook)}\n(.*?)(?=^### |^## |\Z)", page, flags=re.S | re.M)
    return match.group(1) if match else ""


def documented_fields(text: str) -> dict[str, str]:
    """The ``- **Called:** ...`` list items of a section, whitespace collapsed."""
    names = "|".join(FIELDS)
    return _collapsed(rf"^- \*\*({names}):\*\*\s*(.*?)(?=^- \*\*|^\s*$|^```|\Z)", text)


def documented_signature(text: str) -> str | None:
    """The first inline-code signature of a section (`` `name(...) -> R` ``)."""
    match = re.search(r"^`(accelopt_\w+\(.*?\) -> .*?)`", text, flags=re.M)
    return match.group(1) if match else None


def _collapsed(pattern: str, text: str) -> dict[str, str]:
    """field -> its text with whitespace collapsed, for every match of ``pattern``."""
    return {key: " ".join(value.split())
            for key, value in re.findall(pattern, text, flags=re.S | re.M)}
