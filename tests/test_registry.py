"""Discovery through entry points: lazy, tolerant of broken plugins, switchable."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

from accelopt.errors import PluginResolutionError
from accelopt.plugin import Registry


def test_builtin_plugins_come_through_entry_points():
    registry = Registry.discover()
    assert "noop" in registry.entry_points
    assert registry.entry_points["noop"].group == "accelopt.plugins"
    spec = registry.get("noop")
    assert spec.name == "noop" and spec.description


def test_discovery_does_not_import_plugins():
    registry = Registry.discover()
    assert registry.loaded == {}  # names only until a plugin is asked for


def test_broken_entry_point_is_a_warning_not_a_crash():
    registry = Registry.discover()
    registry.entry_points["ghost"] = EntryPoint(
        name="ghost", value="no_such_module_xyz:PLUGIN", group="accelopt.plugins"
    )
    with pytest.warns(RuntimeWarning, match="'ghost'.*could not be loaded"):
        loaded = registry.all()
    assert "noop" in [s.name for s in loaded]
    assert "ghost" not in registry.names()
    with pytest.raises(PluginResolutionError, match="failed to load"):
        registry.get("ghost")


def test_entry_point_pointing_at_wrong_object_is_broken():
    registry = Registry()
    registry.entry_points["wrong"] = EntryPoint(
        name="wrong", value="accelopt.plugin:Registry", group="accelopt.plugins"
    )
    with pytest.warns(RuntimeWarning, match="must point to an accelopt.PluginSpec"):
        registry.all()


def test_autoload_can_be_disabled(monkeypatch):
    monkeypatch.setenv("ACCELOPT_DISABLE_PLUGIN_AUTOLOAD", "1")
    registry = Registry.discover()
    assert registry.names() == []
    with pytest.raises(PluginResolutionError, match="unknown plugin 'noop'"):
        registry.get("noop")


def test_explicit_plugins_load_even_without_autoload(monkeypatch):
    monkeypatch.setenv("ACCELOPT_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("ACCELOPT_PLUGINS", "plugins_for_tests:LIFO")
    assert Registry.discover().names() == ["lifo"]


def test_installed_is_not_enabled(run_tiny):
    record = run_tiny()
    assert record.info.plugins == ()
    assert record.plugin_rows == []
