"""salus's one-line hints name what works and what the user set: the service's import error
says how to put a module where ``accelopt serve`` imports from, the threads warning names the
settings as the command line spelled them (the launcher's, serve's flags, or the run's
``plugins.salus.*``), and a sweep's closing line names its one failed run once."""

from __future__ import annotations

import sys
import warnings

import pytest


def _warned(plugin, lanes: int) -> list[str]:
    """The warnings ``plugin.check_threads(lanes)`` gave."""
    from accelopt.plugin import PluginWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin.check_threads(lanes)
    return [str(w.message) for w in caught if issubclass(w.category, PluginWarning)]


def _plugin(**settings):
    from accelopt_plugins.salus import SalusConfig
    from accelopt_plugins.salus.plugin import SalusPlugin

    return SalusPlugin(SalusConfig(**settings))


def test_threads_warning_names_the_settings_the_user_gave(monkeypatch):
    """A packed sweep given hydra.launcher.threads=4 and max_lanes=100 was told to lower
    plugins.salus.threads and plugins.salus.max_lanes, keys its command line never had."""
    from accelopt_plugins.salus.plugin import (
        LAUNCHER_SETTINGS,
        SERVE_SETTINGS,
        settings_named,
    )

    monkeypatch.setattr("accelopt_plugins.salus.plugin.usable_cores", lambda: 2)
    (line,) = _warned(_plugin(threads=4), 100)
    assert line.startswith("plugins.salus.threads=4 x 100 lane(s) is 400 threads, more than "
                           "the 2 cores this process may use")
    assert "plugins.salus.threads=1 or less" in line
    assert line.endswith("or fewer lanes (plugins.salus.max_lanes)")
    assert "serve" not in line and "hydra.launcher" not in line

    with settings_named(LAUNCHER_SETTINGS):
        built = _plugin(threads=4)
    (line,) = _warned(built, 100)
    assert line.startswith("hydra.launcher.threads=4 x 100 lane(s) is 400 threads")
    assert "hydra.launcher.threads=1 or less" in line
    assert line.endswith("or fewer lanes (hydra.launcher.max_lanes)")
    assert "plugins.salus" not in line
    assert _plugin().setting_names.threads == "plugins.salus.threads"  # reset after

    served = _plugin(threads=4)
    served.setting_names = SERVE_SETTINGS  # as accelopt serve, which builds it, sets it
    (line,) = _warned(served, 2)
    assert line.startswith("--threads=4 x 2 lane(s) is 8 threads")
    assert line.endswith("or fewer lanes (--max-lanes)") and "plugins.salus" not in line


def test_the_launcher_names_its_own_settings_unless_the_runs_select_salus(monkeypatch):
    """The launcher's shared execution builds salus in the core, from the config: the names
    travel with the launch. Runs that select salus themselves use their own settings."""
    from accelopt_plugins.salus.plugin import LAUNCHER_SETTINGS, RUN_SETTINGS
    from omegaconf import OmegaConf

    from hydra_plugins.accelopt_salus_launcher.salus_launcher import SalusLauncher

    seen = []

    def launch(launcher, job_overrides, initial_job_idx):
        seen.append(_plugin().setting_names)  # salus built inside the launch
        return []

    monkeypatch.setattr("accelopt_plugins.salus.sweep.launch", launch)
    launcher = SalusLauncher(max_lanes=100, threads=4)
    launcher.config = OmegaConf.create({"run": {"threads": 0}})
    launcher.launch([["workload.jobs.0.lr=0.01"]], 0)
    launcher.config = OmegaConf.create({"plugins": {"salus": {"threads": 4}}})
    launcher.launch([["workload.jobs.0.lr=0.01"]], 0)
    assert seen == [LAUNCHER_SETTINGS, RUN_SETTINGS]
    assert _plugin().setting_names == RUN_SETTINGS  # only inside the launch


@pytest.fixture
def service(tmp_path):
    from accelopt_plugins.salus.service import ServeOptions, Service

    made = Service(ServeOptions(socket=tmp_path / "s.sock", root=tmp_path / "root"))
    yield made
    made.executor.close()


def _refusal(service, factory: str) -> str:
    from accelopt import UserError

    with pytest.raises(UserError) as caught:
        service._specs({"op": "submit", "factory": factory})
    return str(caught.value)


def test_a_factory_module_the_service_cannot_find_says_to_put_it_on_pythonpath(service):
    """"start accelopt serve where it can (its PYTHONPATH and working directory)": started
    in the module's directory, it failed again (a console script does not import from the
    directory it was started in); only PYTHONPATH=<dir> accelopt serve works."""
    line = _refusal(service, "salus_hint_nowhere:make_job")
    assert line.endswith(
        "cannot import 'salus_hint_nowhere:make_job': ModuleNotFoundError: No module named "
        "'salus_hint_nowhere'; install it, or put the directory holding salus_hint_nowhere.py "
        "or salus_hint_nowhere/ on the import path (PYTHONPATH=<that directory> accelopt "
        "serve ...): accelopt serve does not import from the directory it was started in")
    assert "working directory" not in line
    assert "holding salus_hint_nowhere/ on" in _refusal(service, "salus_hint_nowhere.jobs:make")


def test_a_module_the_factory_imports_is_said_missing_where_the_service_runs(
        service, tmp_path, monkeypatch):
    """The user's module found, a module it imports missing: PYTHONPATH for the user's
    module is not the fix; that module is not installed where the service runs."""
    (tmp_path / "salus_hint_jobs.py").write_text(
        "import salus_hint_missing_dep\n\ndef make_job():\n    return {'model': 'mlp'}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    line = _refusal(service, "salus_hint_jobs:make_job")
    assert line.endswith(
        "No module named 'salus_hint_missing_dep'; salus_hint_jobs imports "
        f"'salus_hint_missing_dep', which is not installed where the service runs (its "
        f"Python: {sys.executable}): install it there")
    assert "PYTHONPATH" not in line
    # found, without that attribute: the error says it, no path advice
    (tmp_path / "salus_hint_ok.py").write_text("def make_job():\n    return {'model': 'mlp'}\n")
    line = _refusal(service, "salus_hint_ok:no_such")
    assert line.endswith("AttributeError: module 'salus_hint_ok' has no attribute 'no_such'")


def test_one_failed_run_of_a_sweep_is_labelled_once():
    """"1 of 3 runs of the sweep failed: #1 (#1: ...)": the label said twice."""
    from accelopt.cli.hydra_run import sweep_failures

    assert sweep_failures(["", "1 of 2 jobs did not complete", ""]) == (
        "1 of 3 runs of the sweep failed: #1 (1 of 2 jobs did not complete)")
    assert sweep_failures(["", "a", "b"]) == "2 of 3 runs of the sweep failed: #1, #2 (#1: a)"
    assert sweep_failures(["x", "", "y"], [3, 0, 1]).startswith(
        "2 of 3 runs of the sweep failed: #0, #2 (#2: y; #0: x); 1 exit 1 (")
