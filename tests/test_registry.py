"""Discovery through entry points: lazy, tolerant of broken plugins, switchable."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

from accelopt.errors import PluginResolutionError
from accelopt.plugin import PluginWarning, Registry


@pytest.fixture(autouse=True)
def _forget_installed_test_packages():
    """The packages a test installs on a temporary sys.path (``_install``) leave their
    modules imported: a later test in the same process then finds ``accelopt_mine`` (the
    scaffold refuses a name whose module exists), so each test's are forgotten."""
    import sys

    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("accelopt_") and not name.startswith("accelopt_plugins"):
            del sys.modules[name]


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


def test_an_unknown_name_lists_only_what_can_be_selected(recwarn):
    """The line offered, as available, an installed plugin whose import fails (refused when
    picked) and left out, without a word, a name two packages declare."""
    registry = Registry()
    registry.entry_points["noop"] = EntryPoint(
        name="noop", value="accelopt_plugins.noop:PLUGIN", group="accelopt.plugins")
    registry.entry_points["ghost"] = EntryPoint(
        name="ghost", value="no_such_module_xyz:PLUGIN", group="accelopt.plugins")
    registry.clashes["twice"] = registry.broken["twice"] = "declared by two packages"
    with pytest.raises(PluginResolutionError) as info:
        registry.get("nosuch")
    assert "(available: noop)" in str(info.value), str(info.value)
    assert "not selectable: twice" in str(info.value)
    assert not [w for w in recwarn if issubclass(w.category, PluginWarning)]  # one line only


def test_an_entry_point_named_unlike_its_spec_says_how_to_fix_it():
    """Selecting it said "reinstall it", which leaves the two names as they were."""
    registry = Registry()
    registry.entry_points["renamed"] = EntryPoint(
        name="renamed", value="accelopt_plugins.noop:PLUGIN", group="accelopt.plugins")
    with pytest.warns(RuntimeWarning, match="declares name 'noop' but is registered as "
                      "'renamed'; give its entry point and its PluginSpec the same name"):
        registry.all()
    with pytest.raises(PluginResolutionError, match=r"the same name\); fix or reinstall its "
                       r"package, or remove it from \+plugins"):
        registry.get("renamed")


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


def _install(site, dist: str, module: str, entries: dict[str, str], code: str) -> None:
    """A package on ``site`` as pip leaves one: its module and its dist-info with entry
    points in the accelopt.plugins group (importlib.metadata finds it on sys.path)."""
    (site / f"{module}.py").write_text(code)
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "\n".join(f"{name} = {value}" for name, value in entries.items())
    (info / "entry_points.txt").write_text(f"[accelopt.plugins]\n{lines}\n")


FAKE = ("from accelopt import PluginSpec\n"
        "FAKE_SALUS = PluginSpec(name='salus', factory=lambda c: object(), description='fake')\n"
        "DUPE = PluginSpec(name='dupe', factory=lambda c: object())\n")


def test_a_package_declaring_a_builtin_name_never_replaces_the_builtin(tmp_path, monkeypatch,
                                                                       capsys):
    _install(tmp_path, "accelopt-fakesalus", "accelopt_fakesalus",
             {"salus": "accelopt_fakesalus:FAKE_SALUS"}, FAKE)
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry.discover()
    assert registry.get("salus").description != "fake"
    assert registry.source("salus") == "accelopt_plugins.salus:PLUGIN (built-in)"
    assert registry.broken == {
        "salus (accelopt_fakesalus:FAKE_SALUS (package accelopt-fakesalus))":
            "declares the name of the built-in plugin 'salus' (accelopt_plugins.salus:PLUGIN "
            "(built-in)), which is kept; rename its entry point"}
    from accelopt.cli.commands import list_plugins

    assert list_plugins(["--format", "plain"]) == 0
    out, err = capsys.readouterr()
    assert "  source: accelopt_plugins.salus:PLUGIN (built-in)" in out.splitlines()
    assert "broken salus (accelopt_fakesalus:FAKE_SALUS (package accelopt-fakesalus)): " in err


def test_a_name_two_packages_declare_is_refused_naming_both(tmp_path, monkeypatch):
    for dist in ("accelopt-one", "accelopt-two"):
        module = dist.replace("-", "_")
        _install(tmp_path, dist, module, {"dupe": f"{module}:DUPE"}, FAKE)
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry.discover()
    assert "dupe" not in registry.names()
    with pytest.raises(PluginResolutionError, match=r"plugin 'dupe' is declared by two "
                       r"installed packages \(accelopt_(one|two):DUPE \(package accelopt-\1\); "
                       r"accelopt_.*:DUPE .*\); uninstall one of them or rename its entry point"):
        registry.get("dupe")


def test_an_explicit_plugin_never_replaces_an_installed_one(tmp_path, monkeypatch):
    (tmp_path / "fake_explicit.py").write_text(FAKE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("ACCELOPT_PLUGINS", "fake_explicit:FAKE_SALUS")
    with pytest.warns(PluginWarning, match="'fake_explicit:FAKE_SALUS' is ignored: its plugin "
                      r"name 'salus' is taken by accelopt_plugins.salus:PLUGIN \(built-in\)"):
        registry = Registry.discover()
    assert registry.get("salus").description != "fake"
    assert "fake_explicit:FAKE_SALUS" in registry.broken


@pytest.mark.parametrize("reference", ["accelopt_mine:MINE", "accelopt_mine:MINE,accelopt_mine:MINE"])
def test_naming_an_installed_plugin_in_accelopt_plugins_again_is_silent(tmp_path, monkeypatch,
                                                                        reference):
    """The guide's `ACCELOPT_PLUGINS=accelopt_my_sched:PLUGIN pytest` after `pip install -e
    .`: the very spec its entry point names warned "... is taken by
    accelopt_my_sched:PLUGIN ...; give the PluginSpec another name"."""
    import warnings

    _install(tmp_path, "accelopt-mine", "accelopt_mine", {"mine": "accelopt_mine:MINE"},
             "from accelopt import PluginSpec\n"
             "MINE = PluginSpec(name='mine', factory=lambda c: object(), description='mine')\n"
             "OTHER = PluginSpec(name='mine', factory=lambda c: object(), description='not')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("ACCELOPT_PLUGINS", reference)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginWarning)
        registry = Registry.discover()
    assert registry.get("mine").description == "mine" and "mine" in registry.names()
    assert registry.broken == {}
    monkeypatch.setenv("ACCELOPT_PLUGINS", "accelopt_mine:OTHER")  # another spec: ignored
    with pytest.warns(PluginWarning, match="'accelopt_mine:OTHER' is ignored: its plugin name "
                      r"'mine' is taken by accelopt_mine:MINE \(package accelopt-mine\)"):
        assert Registry.discover().get("mine").description == "mine"


def test_the_command_prints_a_plugin_warning_as_one_line_without_accelopts_source():
    import warnings

    from accelopt.plugin import one_line_for_plugins

    formatted = one_line_for_plugins(warnings.formatwarning)
    assert formatted("ACCELOPT_PLUGINS: cannot load 'x:Y'", PluginWarning, "/a/plugin.py",
                     114) == "warning: ACCELOPT_PLUGINS: cannot load 'x:Y'\n"
    assert "/a/other.py:3: UserWarning: m" in formatted("m", UserWarning, "/a/other.py", 3)
    assert one_line_for_plugins(formatted) is formatted


def _main(monkeypatch, *args: str) -> int:
    """``accelopt ARGS`` in this process (its warning format undone afterwards)."""
    import warnings

    from accelopt.cli.main import main

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    # the plugins' warnings are what these tests provoke: recorded here, not left to
    # pytest's summary
    with pytest.raises(SystemExit) as exited, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(list(args))
    assert all(issubclass(w.category, PluginWarning) for w in caught), [
        str(w.message) for w in caught]
    return int(exited.value.code)


def test_plugin_commands_never_shadow_core_ones_and_a_bad_one_breaks_no_help(monkeypatch,
                                                                            capsys):
    monkeypatch.setenv("ACCELOPT_PLUGINS", "plugins_for_tests:CLI_MISCHIEF,"
                       "plugins_for_tests:CLI_NOT_A_LIST,plugins_for_tests:GREETER")
    assert _main(monkeypatch, "--help") == 0
    out = capsys.readouterr().out
    contributed = out.split("commands contributed by installed plugins:")[1]
    assert "hijack" not in contributed and "greet        say hello [greeter]" in contributed
    assert "plugin 'climischief': command 'run' is a core command; ignored" in contributed
    assert "plugin 'clibad' could not list its commands: plugin 'clibad' answered " \
        "accelopt_cli_commands with str 'greet'; expected a list of accelopt.CliCommand" in out
    assert _main(monkeypatch, "greet", "you") == 0
    assert capsys.readouterr().out == "hello you\n"


def test_a_plugin_command_that_raises_is_one_line_naming_the_plugin(monkeypatch, capsys):
    monkeypatch.setenv("ACCELOPT_PLUGINS", "plugins_for_tests:CLI_MISCHIEF")
    assert _main(monkeypatch, "cmdraise", "x") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: plugin 'climischief': command 'cmdraise' raised ValueError: "
                   "command exploded"]
    # its answer is not an exit code: said so (it was "raised ValueError: invalid literal
    # for int()", the core's own int() blamed on the command)
    assert _main(monkeypatch, "cmdword") == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: plugin 'climischief': command 'cmdword' returned 'done'; a command returns "
        "its exit code (an int) or None"]
