"""Run a real (tiny) job under a plugin from a test, exactly as ``accelopt run`` would.

The config is composed with Hydra's compose API from the packaged ``configs/`` (so the
plugin's config dataclass goes through the same registration and validation as on the
command line) and the run goes through :func:`accelopt.runtime.run.execute`: no mocks, no
shortcuts. Output goes to a private console, so tests stay quiet.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from rich.console import Console

from accelopt.cli.hydra_run import compose_checked
from accelopt.config import register_plugin_configs, register_schema
from accelopt.drivers.processes import refuse_unguarded_main, under_torchrun
from accelopt.plugin import PluginSpec, Registry, resolve
from accelopt.records import RunRecord
from accelopt.runtime.resume_target import run_mode
from accelopt.runtime.run import execute
from accelopt.testing.recorder import RECORDER_NAME, HookRecorder

QUIET_OVERRIDES = ("run.progress=false",)
"""Applied before the caller's overrides (which may change them)."""


def run_workload(
    plugins: Sequence[PluginSpec | str] = (),
    overrides: Sequence[str] = (),
    *,
    tmp_path: Path,
    workload: str = "tiny",
    recorder: HookRecorder | None = None,
    registry: Registry | None = None,
) -> RunRecord:
    """Run ``workload`` with ``plugins`` selected (in this order) and return the record.

    ``plugins`` may mix :class:`PluginSpec` objects (a plugin under development, not
    installed) and names of installed plugins. ``overrides`` are Hydra overrides such as
    ``plugins.NAME.field=3`` or ``run.seed=1``; select plugins and the workload through the
    arguments, not overrides. The run directory is a fresh ``tmp_path/run-N``, so one test
    may run several times. ``registry`` defaults to the installed plugins
    (:meth:`Registry.discover`); the given specs are added to it.

    The record's ``jobs`` say whether each job finished (``status == "done"``) and its
    ``plugin_rows`` hold what each plugin reported; a plugin's exception propagates as
    :class:`accelopt.PluginHookError`. ``overrides`` may select a cluster mode
    (``cluster.mode=ps``): uninstalled specs are then sent to every rank (their factory and
    config must be defined at module level) and the recorder gathers every rank's calls.
    A recorder given to several runs tags each run's calls with its run
    (:meth:`HookRecorder.runs`); give each run a fresh one unless the runs belong together
    (a run and its resume).
    """
    _refuse_selection_overrides(overrides)
    registry = registry if registry is not None else Registry.discover()
    names = [_add_to(registry, plugin) for plugin in plugins]
    if recorder is not None:
        if RECORDER_NAME in names:
            raise ValueError(f"'{RECORDER_NAME}' is reserved for the HookRecorder plugin")
        registry.add(recorder.spec())
        names.append(RECORDER_NAME)
    register_schema(overrides)
    register_plugin_configs(resolve(names, registry))
    selection = [f"+plugins=[{','.join(names)}]"] if names else []
    cfg = compose_checked(
        [f"workload={workload}", *selection, *QUIET_OVERRIDES, *overrides]
    )
    if run_mode(cfg) != "none" and not under_torchrun():
        refuse_unguarded_main("run_workload")  # each rank would import the script and rerun it
    run_dir = _fresh_dir(Path(tmp_path))
    began_at = None
    if recorder is not None:
        began_at = len(recorder.records)
        recorder.begin_run()  # its calls from here are this run's (HookRecorder: runs)
    record = execute(
        cfg,
        run_dir=run_dir,
        registry=registry,
        console=Console(file=io.StringIO(), width=120),
    )
    if recorder is not None:
        recorder.collect(run_dir, began_at)  # a cluster run's ranks wrote their calls there
    return record


def _add_to(registry: Registry, plugin: PluginSpec | str) -> str:
    if isinstance(plugin, PluginSpec):
        registry.add(plugin)
        return plugin.name
    if isinstance(plugin, str):
        return plugin
    raise TypeError(
        f"run_workload: plugins must be PluginSpec objects or installed plugin names, "
        f"got {type(plugin).__name__}"
    )


def _refuse_selection_overrides(overrides: Sequence[str]) -> None:
    """A ``+plugins=[...]`` or ``workload=`` override would fight the arguments that say the
    same thing; refuse it with the fix rather than guess which one the caller meant."""
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.key_or_group
        if key == "plugins":
            raise ValueError(
                f"run_workload: select plugins with the plugins argument, not {override.input_line!r}"
            )
        if key == "workload":
            raise ValueError(
                f"run_workload: pick the workload with workload=..., not {override.input_line!r}"
            )


def _fresh_dir(base: Path) -> Path:
    for n in range(10_000):
        candidate = base / f"run-{n}"
        if not candidate.exists():
            return candidate
    raise RuntimeError(f"{base} already holds 10000 runs")
