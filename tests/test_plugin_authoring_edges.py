"""What a plugin author meets at the edges: the scaffolded plugin's row says it changed
nothing (so ``run.compare`` does not credit it with noise), and a bad ``ACCELOPT_PLUGINS``
entry is said once per run, not once per rank process."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from accelopt import plugin as plugin_module
from accelopt.cli.scaffold import create_plugin
from accelopt.plugin import EXPLICIT_PLUGINS_ENV, PluginWarning, Registry
from accelopt.types import INERT

BAD_ENTRY = "accelopt_no_such_module_here:X"


def test_the_scaffolded_plugin_reports_itself_inert_and_its_tests_check_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As generated the plugin only counts iterations: it changes nothing, so its one row
    carries ``inert`` and the generated tests assert it."""
    root = create_plugin("edgecount", tmp_path)
    source = root / "src" / "accelopt_edgecount" / "__init__.py"
    spec = importlib.util.spec_from_file_location("accelopt_edgecount", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "accelopt_edgecount", module)
    spec.loader.exec_module(module)
    generated = module.EdgecountPlugin(module.EdgecountConfig())
    (row,) = generated.accelopt_report_rows(run=SimpleNamespace(role="single"))
    assert row.plugin == "edgecount" and row.metrics.get(INERT) == 1
    tests = (root / "tests" / "test_edgecount.py").read_text(encoding="utf-8")
    assert "row.metrics.get(INERT) == 1" in tests


def discover_warnings(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                      child: bool) -> list[str]:
    """The PluginWarnings ``Registry.discover`` gives with ``env`` set, in a process that is
    (``child``) or is not a multiprocessing child."""
    monkeypatch.setenv(EXPLICIT_PLUGINS_ENV, BAD_ENTRY)
    monkeypatch.delenv("RANK", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    parent = SimpleNamespace(pid=1) if child else None
    monkeypatch.setattr("multiprocessing.parent_process", lambda: parent)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry = Registry.discover(autoload=False)
    assert BAD_ENTRY in registry.failed_references  # recorded either way: a selection is refused
    return [str(w.message) for w in caught if issubclass(w.category, PluginWarning)]


@pytest.mark.parametrize("env, child, said", [
    ({}, False, True),                 # the command, a plain script, the local launcher
    ({}, True, True),                  # a one-process run inside someone's worker process
    ({"RANK": "0"}, True, False),      # rank 0 the local launcher started: it said it
    ({"RANK": "2"}, True, False),      # any other rank the local launcher started
    ({"RANK": "0"}, False, True),      # torchrun's rank 0: no launcher reads the variable
    ({"RANK": "3"}, False, False),     # torchrun's other ranks
])
def test_a_bad_accelopt_plugins_entry_is_said_once_per_run(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], child: bool, said: bool
) -> None:
    lines = discover_warnings(monkeypatch, env, child)
    assert len(lines) == (1 if said else 0), lines
    if said:
        assert f"cannot load {BAD_ENTRY!r}" in lines[0]


def test_the_rule_reads_the_environment_given() -> None:
    assert not plugin_module.another_process_warns({})
    assert plugin_module.another_process_warns({"RANK": "1"})
