"""``run.compare``: a plugin set refused as its jobs are built is refused before any reference
run trains; a failure after reference runs finished says where their outputs are; a plugin
that changed nothing has its comparison row and table column say so; and the hook
watchdog's refusal names the values it accepts."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from accelopt import LayerOffer, PluginSpec, ReportRow, RunInfo, hookimpl
from accelopt.errors import AccelOptError, ConfigError, UserError
from accelopt.plugin import Registry
from accelopt.records import RunRecord
from accelopt.runtime.compare import COMPARED, IDLE_MARK
from accelopt.runtime.run import execute
from accelopt.types import INERT

FAST = ["workload=tiny", "run.progress=false", "run.telemetry_interval_s=5", "run.profile=false",
        "workload.jobs.0.iterations=2", "workload.jobs.1.iterations=2"]
"""The tiny workload, two iterations a job: each run of a comparison takes well under a
second on a CPU."""


class RefusesAtBuild:
    """Refuses every job as its model is built, as SLIDE refuses an SGD job."""

    def __init__(self, config: Any) -> None:
        pass

    @hookimpl
    def accelopt_layer_build(self, layer: LayerOffer) -> Any | None:
        if layer.path == "":
            raise ConfigError(f"refuser: job '{layer.job.name}' cannot be built with it")
        return None


class RefusesAtStart:
    """Refuses the run once its jobs are built, before any trains."""

    def __init__(self, config: Any) -> None:
        pass

    @hookimpl
    def accelopt_run_start(self, run: RunInfo) -> None:
        raise UserError("late: refuses this run at its start")


class Busy:
    """A plugin whose row says it did something (no ``INERT``)."""

    def __init__(self, config: Any) -> None:
        pass

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        return [ReportRow("busy", "did something", {"things": 1})]


REFUSER = PluginSpec(name="refuser", factory=RefusesAtBuild, description="refuses (test)")
LATE = PluginSpec(name="late", factory=RefusesAtStart, description="refuses late (test)")
BUSY = PluginSpec(name="busy", factory=Busy, description="busy (test)")


def _run(run_dir: Path, specs: Sequence[PluginSpec], names: Sequence[str],
         overrides: Sequence[str], console: Console | None = None) -> RunRecord:
    """``execute`` with ``names`` selected (test plugins from ``specs``, the rest installed)."""
    from accelopt.cli.hydra_run import compose_checked
    from accelopt.config import register_plugin_configs, register_schema

    registry = Registry.discover()
    for spec in specs:
        registry.add(spec)
    register_schema()
    register_plugin_configs([registry.get(name) for name in names])
    cfg = compose_checked([f"+plugins=[{','.join(names)}]", *FAST, *overrides])
    return execute(cfg, run_dir=run_dir, registry=registry,
                   console=console or Console(file=io.StringIO(), width=200))


@pytest.mark.timeout(60)
def test_a_set_refused_at_build_is_refused_before_the_baseline_trains(tmp_path):
    """The run's own set refused as its jobs were built: the baseline reference had
    trained into compare/baseline first, the refusal coming after it."""
    run_dir = tmp_path / "r"
    with pytest.raises(ConfigError, match="refuser: job 'tiny-mlp' cannot be built") as info:
        _run(run_dir, [REFUSER], ["refuser"], ["run.compare=baseline"])
    assert "\n" not in str(info.value)
    assert not (run_dir / "compare").exists()  # nothing trained


@pytest.mark.timeout(60)
def test_a_reference_set_refused_at_build_is_refused_before_any_reference_trains(tmp_path):
    """each: the baseline and the first plugin alone had trained before the second
    plugin's reference run was refused as it built its jobs."""
    run_dir = tmp_path / "r"
    with pytest.raises(ConfigError, match="refuser: job 'tiny-mlp' cannot be built") as info:
        _run(run_dir, [BUSY, REFUSER], ["busy", "refuser"], ["run.compare=each"])
    assert "\n" not in str(info.value)
    assert not (run_dir / "compare").exists()
    assert "run.compare" not in str(info.value)  # the plugin's own line, as without compare


@pytest.mark.timeout(60)
def test_a_refusal_after_the_references_ran_says_where_they_are(tmp_path):
    """A refusal of the run itself once its references had trained (at its start, after
    its jobs were built) ended on its line alone, nothing saying they were kept."""
    run_dir = tmp_path / "r"
    with pytest.raises(UserError, match="late: refuses this run") as info:
        _run(run_dir, [LATE], ["late"], ["run.compare=baseline"])
    line = str(info.value)
    assert "\n" not in line
    assert f"kept their outputs in {run_dir / 'compare'} (baseline)" in line
    assert (run_dir / "compare" / "baseline" / "metrics.json").is_file()


@pytest.mark.timeout(60)
def test_a_failed_reference_run_says_where_the_finished_ones_are(tmp_path):
    """each: the second reference run refused (at its start) after the baseline and the
    first plugin alone had run: the line named only the failed one."""
    run_dir = tmp_path / "r"
    with pytest.raises(UserError, match="the reference run with late alone") as info:
        _run(run_dir, [BUSY, LATE], ["busy", "late"], ["run.compare=each"])
    line = str(info.value)
    assert "\n" not in line
    assert f"kept their outputs in {run_dir / 'compare'} (baseline, busy)" in line


def _compared_row(run_dir: Path, plugin: str) -> dict[str, Any]:
    rows = json.loads((run_dir / "metrics.json").read_text())["plugins"]
    return next(r for r in rows if r["plugin"] == plugin and r["metrics"].get(COMPARED))


@pytest.mark.timeout(90)
def test_an_inert_plugin_is_marked_in_its_comparison_row_and_the_table(tmp_path):
    """each: noop changes nothing (its rows say INERT), yet its comparison row carried
    alone.*.gain figures with no inert key and the table showed its ratio unmarked."""
    run_dir = tmp_path / "r"
    out = io.StringIO()
    _run(run_dir, [BUSY], ["noop", "busy"], ["run.compare=each"],
         Console(file=out, width=250))
    noop = _compared_row(run_dir, "noop")
    assert noop["metrics"].get(INERT) == 1
    assert "alone.avg_jct_s.gain" in noop["metrics"]  # the figures are still there
    assert INERT not in _compared_row(run_dir, "busy")["metrics"]
    printed = out.getvalue()
    assert f"noop {IDLE_MARK}" in printed
    assert f"busy {IDLE_MARK}" not in printed
    assert "noop changed nothing in the run with noop alone" in " ".join(printed.split())


@pytest.mark.timeout(60)
def test_an_inert_plugin_alone_marks_this_runs_column(tmp_path):
    out = io.StringIO()
    run_dir = tmp_path / "r"
    _run(run_dir, [], ["noop"], ["run.compare=baseline"], Console(file=out, width=250))
    assert _compared_row(run_dir, "noop")["metrics"].get(INERT) == 1
    assert f"noop {IDLE_MARK}" in out.getvalue()


@pytest.mark.timeout(30)
def test_the_hook_watchdog_refusal_names_what_it_accepts():
    """A negative run.hook_watchdog_s was told it 'must be > 0 (...; 0: off)'."""
    from accelopt.cli.hydra_run import compose_checked
    from accelopt.config import register_schema
    from accelopt.runtime.run import _validate_settings

    def settings(value: str):
        register_schema()
        return compose_checked(["workload=tiny", f"run.hook_watchdog_s={value}"])

    with pytest.raises(ConfigError, match=r"run.hook_watchdog_s must be a finite number >= 0 "
                                          r"\(.*0: off\), got -1.0") as info:
        _validate_settings(settings("-1"))
    assert "> 0" not in str(info.value).replace(">= 0", "")
    with pytest.raises(ConfigError, match=r"run.hook_watchdog_s must be a finite number >= 0"):
        _validate_settings(settings("nan"))
    with pytest.raises(ConfigError, match=r"run.hook_watchdog_s must be at most"):
        _validate_settings(settings("1e12"))
    _validate_settings(settings("0"))  # off
    _validate_settings(settings("2.5"))


def test_errors_keep_their_class():
    """The notes are added to the error's line, never a new error class (its exit code)."""
    from accelopt.runtime.compare import references_kept

    exc = UserError("x")
    assert references_kept(exc, Path("/nonexistent"), ["baseline"]) is exc
    assert str(exc) == "x" and isinstance(exc, AccelOptError)
