"""Plugin names a selection reads as a value (``+plugins=[true]`` is ``[True]``): refused
for a new plugin, and an installed one under such a name breaks nobody else's matrix."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

from accelopt.cli.hydra_run import plugin_selections
from accelopt.cli.scaffold import create_plugin
from accelopt.errors import ConfigError, PluginResolutionError, UserError
from accelopt.plugin import PluginSpec, PluginWarning, Registry

VALUE_NAMES = ["true", "False", "NULL", "inf", "NaN", "on", "yes"]


@pytest.fixture(autouse=True)
def _forget_installed_test_packages():
    """A package :func:`_install_true_plugin` puts on a temporary sys.path leaves its module
    imported; later tests must not find it."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("accelopt_truepkg"):
            del sys.modules[name]


@pytest.mark.parametrize("name", VALUE_NAMES)
def test_new_plugin_refuses_a_name_read_as_a_value(tmp_path: Path, name: str) -> None:
    with pytest.raises(UserError) as info:
        create_plugin(name, tmp_path)
    message = str(info.value)
    assert "as a value, not as a name" in message and f"'{name.lower()}_plugin'" in message
    assert "\n" not in message
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", VALUE_NAMES)
def test_a_plugin_spec_refuses_a_name_read_as_a_value(name: str) -> None:
    with pytest.raises(ValueError, match=f"plugin name '{name}' is read by .* as a value"):
        PluginSpec(name=name, factory=lambda config: object())


def test_names_that_only_contain_such_a_word_are_fine() -> None:
    for name in ("true_plugin", "nano", "info", "nullify", "online"):
        assert PluginSpec(name=name, factory=lambda config: object()).name == name


@pytest.mark.parametrize("override", ["+plugins=[true]", "+plugins=[noop,NaN]",
                                      "+plugins=[noop],[null]"])
def test_a_selection_hydra_reads_as_a_value_is_one_line(override: str) -> None:
    """It read as "unknown plugin 'True' ... did you mean 'true'" (an installed 'true' then
    unselectable by any spelling)."""
    with pytest.raises(ConfigError, match="Hydra's override grammar reads (true|nan|null) as "
                       "a value .*, not as a plugin name") as info:
        plugin_selections([override])
    assert "\n" not in str(info.value)


def _install_true_plugin(site: Path) -> None:
    """A third party's package declaring the entry point ``true`` (as pip leaves one)."""
    (site / "accelopt_truepkg.py").write_text(  # never imported: the name is refused first
        "from accelopt import PluginSpec\n"
        "PLUGIN = PluginSpec(name='true', factory=lambda config: object())\n")
    info = site / "accelopt_truepkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: accelopt-truepkg\n"
                                   "Version: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[accelopt.plugins]\ntrue = accelopt_truepkg:PLUGIN\n")


def test_an_installed_plugin_named_true_is_refused_once_and_breaks_no_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed, it was listed as available: every ``accelopt matrix`` then wrote
    ``+plugins=[true]`` and exited 2 (``argument of type 'bool' is not iterable``)."""
    _install_true_plugin(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry.discover()
    assert "true" not in registry.names() and "noop" in registry.names()
    with pytest.raises(PluginResolutionError, match=r"accelopt plugin 'true' "
                       r"\(accelopt_truepkg:PLUGIN \(package accelopt-truepkg\)\) cannot be "
                       r"used: its name is read by Hydra's override grammar as a value"):
        registry.get("true")
    with pytest.warns(PluginWarning, match="accelopt plugin 'true' .* cannot be used") as said:
        specs = registry.all()
    assert [str(w.message) for w in said].count(registry.broken["true"]) == 1
    assert "true" not in {s.name for s in specs}
    assert "accelopt_truepkg" not in sys.modules  # never imported
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginWarning)
        registry.all()  # said once


@pytest.mark.timeout(60)
def test_matrix_goes_on_beside_an_installed_plugin_named_true(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from accelopt.cli.commands import matrix

    _install_true_plugin(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(PluginWarning, match="accelopt plugin 'true'"):
        assert matrix(["--max-size", "1", "--format", "hydra", "workload=tiny"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("+plugins=[],") and "[noop]" in line and "true" not in line
