"""A method named like a hook but not marked ``@hookimpl`` is refused when the plugin is
registered, in one line naming the plugin, the method and the fix. pluggy registers only
marked methods: such a method was never called and the run ended with exit 0 as if the plugin
worked (a misspelt hook, an extra argument, a default or an ``async def`` were each refused)."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

from accelopt import PluginSpec, ReportRow, hookimpl
from accelopt.errors import PluginResolutionError
from accelopt.host import PluginHost


class NoDecorator:
    def __init__(self, config: Any = None) -> None:
        self.n = 0

    def accelopt_iteration_end(self, context: Any, result: Any) -> None:
        self.n += 1

    @hookimpl
    def accelopt_report_rows(self, run: Any) -> list[ReportRow]:
        return [ReportRow("nodeco", f"n={self.n}")]


NODECO = PluginSpec(name="nodeco", factory=NoDecorator, description="a hook left undecorated")


def _host(name: str, instance: object) -> PluginHost:
    return PluginHost([(PluginSpec(name=name, factory=lambda config: instance), instance)])


def test_an_undecorated_hook_method_is_refused_naming_plugin_method_and_fix() -> None:
    with pytest.raises(PluginResolutionError) as info:
        _host("nodeco", NoDecorator())
    assert str(info.value) == (
        "plugin 'nodeco': accelopt_iteration_end is not decorated with @hookimpl, so it is "
        "never called; decorate it with @hookimpl (from accelopt import hookimpl) "
        "(docs/hooks.md)")


def test_an_override_that_dropped_the_decorator_and_a_module_function_are_refused() -> None:
    class Base:
        @hookimpl
        def accelopt_run_start(self, run: Any) -> None:
            pass

    class Override(Base):
        def accelopt_run_start(self, run: Any) -> None:  # pluggy sees no marker here
            pass

    with pytest.raises(PluginResolutionError, match="^plugin 'over': accelopt_run_start is "
                       "not decorated with @hookimpl"):
        _host("over", Override())
    module = types.ModuleType("hooks_of_a_module")

    def accelopt_run_end(run: Any, metrics: Any) -> None:
        pass

    module.accelopt_run_end = accelopt_run_end  # type: ignore[attr-defined]
    with pytest.raises(PluginResolutionError, match="^plugin 'mod': accelopt_run_end is not "
                       "decorated"):
        _host("mod", module)


def test_an_undecorated_method_named_like_no_hook_names_the_closest_hook() -> None:
    class Misspelt:
        def accelopt_iteration_ends(self, context: Any, result: Any) -> None:
            pass

    with pytest.raises(PluginResolutionError, match="^plugin 'typo': accelopt_iteration_ends "
                       r"is named like a hook but is no accelopt hook and has no @hookimpl.*"
                       "rename it to accelopt_iteration_end and decorate it"):
        _host("typo", Misspelt())


def test_decorated_hooks_and_helpers_without_the_prefix_are_accepted() -> None:
    class Fine:
        @hookimpl
        @staticmethod
        def accelopt_iteration_start(context: Any) -> None:
            pass

        @hookimpl
        def accelopt_run_start(self, run: Any) -> None:
            pass

        def helper(self) -> None:
            pass

    class Inherits(Fine):  # inherits the marked method: registered
        pass

    assert _host("fine", Inherits()).hooks_of("fine") == {"accelopt_iteration_start",
                                                          "accelopt_run_start"}


@pytest.mark.timeout(120)
def test_the_command_refuses_it_in_one_line_with_exit_2(tmp_path: Path) -> None:
    from clirun import accelopt

    result = accelopt("run", "+plugins=[nodeco]", "workload=tiny", "cluster.mode=none",
                      "run.compare=none", "run.progress=false", cwd=tmp_path,
                      ACCELOPT_PLUGINS="test_hookimpl_undecorated:NODECO")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "error: plugin 'nodeco': accelopt_iteration_end is not decorated with @hookimpl, so "
        "it is never called; decorate it with @hookimpl (from accelopt import hookimpl) "
        "(docs/hooks.md)"]
