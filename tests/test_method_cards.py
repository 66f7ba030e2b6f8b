"""Every bundled plugin has a method card that names every one of its config keys.

Like the hook docs test: adding a key to a plugin's config dataclass without saying what it
does in ``plugins/<name>/README.md`` fails CI. A key counts as documented when the card
shows it as `` `key` `` or ``key=`` (an example command line).
"""

from __future__ import annotations

import dataclasses
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = sorted(
    ep.name for ep in entry_points(group="accelopt.plugins")
    if ep.value.startswith("accelopt_plugins.")
)


def test_the_bundled_plugins_are_found() -> None:
    assert {"salus", "tictac", "slide", "gpu_kernels", "offload", "gradcomm"} <= set(BUNDLED)


@pytest.mark.parametrize("name", BUNDLED)
def test_method_card_documents_every_config_key(name: str) -> None:
    (ep,) = [ep for ep in entry_points(group="accelopt.plugins") if ep.name == name]
    spec = ep.load()
    card = ROOT / "plugins" / name / "README.md"
    assert card.is_file(), f"plugin {name} has no method card at {card.relative_to(ROOT)}"
    text = card.read_text()
    assert dataclasses.is_dataclass(spec.config), f"{name}: its config must be a dataclass"
    missing = [f.name for f in dataclasses.fields(spec.config)
               if f"`{f.name}`" not in text and f"{f.name}=" not in text]
    assert not missing, f"{card.relative_to(ROOT)} does not mention config keys {missing}"
