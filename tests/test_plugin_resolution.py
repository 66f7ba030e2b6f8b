"""Selecting plugins: order, constraints, and the one-line errors that name the culprits."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accelopt.errors import PluginResolutionError
from accelopt.plugin import PluginSpec, Registry, resolve, valid_combinations


def spec(name: str, **kw) -> PluginSpec:
    return PluginSpec(name=name, factory=lambda c: object(), **kw)


def registry(*specs: PluginSpec) -> Registry:
    return Registry(loaded={s.name: s for s in specs})


def names(specs) -> list[str]:
    return [s.name for s in specs]


def test_command_line_order_is_kept():
    reg = registry(spec("a"), spec("b"), spec("c"))
    assert names(resolve(["c", "a", "b"], reg)) == ["c", "a", "b"]


def test_before_and_after_reorder():
    reg = registry(spec("a", after=("b",)), spec("b"), spec("c", before=("a",)))
    assert names(resolve(["a", "b", "c"], reg)) == ["b", "c", "a"]


def test_constraints_on_unselected_plugins_are_ignored():
    reg = registry(spec("a", after=("zzz",)), spec("b"))
    assert names(resolve(["a", "b"], reg)) == ["a", "b"]


def test_cycle_is_an_error_naming_plugins():
    reg = registry(spec("a", after=("b",)), spec("b", after=("a",)))
    with pytest.raises(PluginResolutionError, match="'a', 'b'.*cycle"):
        resolve(["a", "b"], reg)


def test_unknown_plugin_lists_installed_and_closest():
    reg = registry(spec("salus"), spec("tictac"))
    with pytest.raises(PluginResolutionError) as info:
        resolve(["salsu"], reg)
    message = str(info.value)
    assert "unknown plugin 'salsu'" in message
    assert "salus, tictac" in message and "did you mean 'salus'" in message
    assert "\n" not in message


def test_conflict_names_both():
    reg = registry(spec("a", conflicts=("b",)), spec("b"))
    with pytest.raises(PluginResolutionError, match="'a' and 'b' conflict"):
        resolve(["b", "a"], reg)


def test_missing_requirement_names_both_and_the_fix():
    reg = registry(spec("a", requires=("b",)), spec("b"))
    with pytest.raises(PluginResolutionError, match=r"'a' requires plugin 'b'.*\+plugins=\[a,b\]"):
        resolve(["a"], reg)
    assert names(resolve(["a", "b"], reg)) == ["a", "b"]


def test_a_requirement_that_is_not_installed_says_so_not_select_both():
    """Selecting both would only be refused as unknown: the fix is to install it."""
    reg = registry(spec("req_missing", requires=("nonexistent_plugin",)))
    with pytest.raises(PluginResolutionError, match=r"^plugin 'req_missing' requires plugin "
                       r"'nonexistent_plugin', which is not installed; install it \(`accelopt "
                       r"plugins` lists what is\), or remove 'req_missing' from \+plugins$"):
        resolve(["req_missing"], reg)
    reg.broken["nonexistent_plugin"] = "ImportError: no module"
    with pytest.raises(PluginResolutionError, match="which is installed but failed to load "
                       r"\(ImportError: no module\)"):
        resolve(["req_missing"], reg)


def test_a_plugin_whose_explicit_entry_failed_to_load_is_named_as_failed_not_unknown(
        monkeypatch):
    monkeypatch.setenv("ACCELOPT_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("ACCELOPT_PLUGINS", "plugins_for_tests:LIFO,no_such_module_notdc:PLUGIN")
    with pytest.warns(RuntimeWarning, match="cannot load 'no_such_module_notdc:PLUGIN'"):
        reg = Registry.discover()
    with pytest.raises(PluginResolutionError, match=r"^plugin 'notdc' is not available: "
                       r"ACCELOPT_PLUGINS entry 'no_such_module_notdc:PLUGIN' failed to load "
                       r"\(ModuleNotFoundError: No module named 'no_such_module_notdc'\); fix "
                       "that entry or remove it from \\+plugins$"):
        resolve(["notdc"], reg)
    with pytest.raises(PluginResolutionError, match=r"unknown plugin 'other' \(available: lifo\)"
                       r".*\(ACCELOPT_PLUGINS entry 'no_such_module_notdc:PLUGIN' failed to "
                       "load: ModuleNotFoundError"):
        resolve(["other"], reg)
    monkeypatch.setenv("ACCELOPT_PLUGINS", "no_such_module_notdc")  # attr PLUGIN by default
    with pytest.warns(RuntimeWarning):
        reg = Registry.discover()
    with pytest.raises(PluginResolutionError, match=r"^plugin 'notdc' is not available: "
                       r"ACCELOPT_PLUGINS entry 'no_such_module_notdc' failed to load"):
        resolve(["notdc"], reg)
    with pytest.raises(PluginResolutionError, match="ACCELOPT_PLUGINS entry "
                       "'no_such_module_notdc' failed to load"):
        resolve(["no_such_module_notdc"], reg)


def test_exclusive_slot_names_both():
    reg = registry(spec("srtf", slots=("scheduler",)), spec("fair", slots=("scheduler",)))
    with pytest.raises(PluginResolutionError, match="'srtf' and 'fair'.*'scheduler'"):
        resolve(["srtf", "fair"], reg)


def test_duplicate_selection_is_an_error():
    with pytest.raises(PluginResolutionError, match="twice"):
        resolve(["a", "a"], registry(spec("a")))


def test_spec_validation():
    with pytest.raises(ValueError, match="identifier"):
        spec("not-valid")

    @dataclass
    class Cfg:
        x: int = 1

    assert spec("ok", config=Cfg).default_config().x == 1
    with pytest.raises(TypeError):
        spec("bad", config=int)


def test_valid_combinations_respect_constraints():
    specs = [spec("a", conflicts=("b",)), spec("b"), spec("c", requires=("a",))]
    combos = valid_combinations(specs)
    assert [] in combos and ["a"] in combos and ["b"] in combos
    assert ["a", "b"] not in combos and ["c"] not in combos
    assert ["a", "c"] in combos
    assert all(len(c) <= 1 for c in valid_combinations(specs, max_size=1))


@st.composite
def plugin_sets(draw):
    n = draw(st.integers(1, 6))
    pool = [f"p{i}" for i in range(n)]
    specs = []
    for name in pool:
        others = [p for p in pool if p != name]
        specs.append(
            spec(
                name,
                before=tuple(draw(st.lists(st.sampled_from(others), max_size=2))) if others else (),
                slots=tuple(draw(st.lists(st.sampled_from(["s1", "s2"]), max_size=1))),
            )
        )
    selection = draw(st.permutations(pool))
    return specs, list(selection)


@settings(max_examples=200, deadline=None)
@given(plugin_sets())
def test_resolution_either_satisfies_every_constraint_or_explains(data):
    specs, selection = data
    reg = registry(*specs)
    try:
        ordered = names(resolve(selection, reg))
    except PluginResolutionError as exc:
        assert "\n" not in str(exc)
        return
    assert sorted(ordered) == sorted(selection)
    position = {n: i for i, n in enumerate(ordered)}
    for s in specs:
        for other in s.before:
            assert position[s.name] < position[other]
    slots = [slot for s in specs for slot in s.slots]
    assert len(slots) == len(set(slots))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("ref", "name", "code", "line"), [
    ("FACTORY_RAISES", "factoryboom", 1,
     "error: plugin 'factoryboom' could not be created: ValueError: factory exploded"),
    ("SET_CONFIG", "setcfg", 2,
     "error: plugin 'setcfg': SetConfig is not a valid OmegaConf schema (Unexpected type "
     "annotation: set); use int, float, str, bool, Enum, Optional[...], list[...], "
     "dict[str, ...] or nested dataclasses for its fields"),
    # accepted (any value passed unchecked) where the plugin guide says it is refused
    ("ANY_CONFIG", "anycfg", 2,
     "error: plugin 'anycfg': AnyConfig is not a valid OmegaConf schema (field 'anything' is "
     "Any: a value of any type would pass unchecked); use int, float, str, bool, Enum, "
     "Optional[...], list[...], dict[str, ...] or nested dataclasses for its fields"),
])
def test_a_plugin_that_cannot_be_built_is_one_line_naming_it(tmp_path, capfd, monkeypatch, ref,
                                                            name, code, line):
    """A raising factory or a config type OmegaConf cannot hold: one line naming the plugin
    (what the conformance suite says), no traceback out of Hydra or omegaconf."""
    from clirun import accelopt_in_process

    monkeypatch.setenv("ACCELOPT_PLUGINS", f"plugins_for_tests:{ref}")
    result = accelopt_in_process("run", f"+plugins=[{name}]", "workload=tiny",
                                 "cluster.mode=none", "run.compare=none", "run.progress=false",
                                 cwd=tmp_path, capfd=capfd)
    assert result.returncode == code, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [line]


def test_a_factory_refusing_a_setting_keeps_its_error_and_gains_the_plugins_name():
    from accelopt.errors import ConfigError

    def refuses(config):
        raise ConfigError("unknown policy 'nope'")

    with pytest.raises(ConfigError, match="^plugin 'pol' could not be created: unknown policy"):
        PluginSpec(name="pol", factory=refuses).instantiate()

    def names_itself(config):
        raise ConfigError("plugins.pol.policy: unknown policy 'nope'")

    with pytest.raises(ConfigError, match="^plugins.pol.policy: unknown policy 'nope'$"):
        PluginSpec(name="pol", factory=names_itself).instantiate()
