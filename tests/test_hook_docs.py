"""Every hookspec is documented (with an example) and exercised by some test.

Like datasette's documentation tests: adding a hook without docs or tests fails CI.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from accelopt import hookspecs

ROOT = Path(__file__).resolve().parent.parent
HOOKS = sorted(name for name in dir(hookspecs) if name.startswith("accelopt_"))
DOCS = (ROOT / "docs" / "hooks.md").read_text()


def _section(hook: str) -> str:
    match = re.search(rf"^### {hook}\n(.*?)(?=^### |\Z)", DOCS, flags=re.S | re.M)
    return match.group(1) if match else ""


def test_there_are_hooks_for_the_four_hook_points():
    for point in ("accelopt_allocate", "accelopt_select_next", "accelopt_transfer_order",
                  "accelopt_layer_build"):
        assert point in HOOKS


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented_with_an_example(hook):
    section = _section(hook)
    assert section, f"docs/hooks.md has no '### {hook}' section"
    assert "```python" in section and f"def {hook}(" in section, (
        f"docs/hooks.md: the {hook} section needs a python example implementing it"
    )
    assert getattr(hookspecs, hook).__doc__, f"hookspecs.{hook} has no docstring"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_exercised_by_a_test(hook):
    other_tests = [p for p in ROOT.joinpath("tests").glob("test_*.py")
                   if p.name != Path(__file__).name]
    users = [p.name for p in other_tests if hook in p.read_text()]
    assert users, f"no test under tests/ mentions {hook}; add one that exercises it"


def test_documented_hooks_exist():
    documented = re.findall(r"^### (accelopt_\w+)", DOCS, flags=re.M)
    assert sorted(documented) == HOOKS
