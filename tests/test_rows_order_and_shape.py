"""A plugin's report rows read the same in every mode: a run-scoped plugin's rows as it
returned them (a cluster run rewrote them: its own ``"job"`` key dropped, its per-job rows
collapsed into "all jobs: ..."), and the plugins in selection order (a cluster run listed a
plugin reporting on the server before one selected ahead of it reporting on the workers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from accelopt import PluginSpec, ReportRow, hookimpl
from accelopt.drivers.rows import with_placeholders
from accelopt.testing import run_workload
from accelopt.types import RunInfo

pytestmark = pytest.mark.timeout(120)


class PerJob:
    """Run-scoped; one row per job it saw, carrying a "job" key of its own."""

    def __init__(self, config: Any = None) -> None:
        self.jobs: dict[str, int] = {}

    @hookimpl
    def accelopt_iteration_end(self, context: Any, result: Any) -> None:
        self.jobs[context.job.name] = self.jobs.get(context.job.name, 0) + 1

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        return [ReportRow("perjob", f"{name}: checked", {"job": name, "checked": 1})
                for name in sorted(self.jobs)]


class OnWorkers:
    """Reports on the ranks that train (a worker; the one process of a local run)."""

    def __init__(self, config: Any = None) -> None:
        pass

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        return [] if run.role == "server" else [ReportRow("onworkers", "worker view")]


class OnServers:
    """Reports where the optimizer steps: a server in a PS run, else the training process."""

    def __init__(self, config: Any = None) -> None:
        pass

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        on_a_worker = run.role == "worker" and run.cluster.mode == "ps"
        return [] if on_a_worker else [ReportRow("onservers", "stepped")]


PERJOB = PluginSpec(name="perjob", factory=PerJob, description="per-job rows")
ONWORKERS = PluginSpec(name="onworkers", factory=OnWorkers, description="reports on workers")
ONSERVERS = PluginSpec(name="onservers", factory=OnServers, description="reports on servers")


def _rows(tmp_path: Path, mode: str) -> list[tuple[str, str, dict[str, Any]]]:
    overrides = [f"cluster.mode={mode}", "cluster.timeout_s=60"] if mode != "none" else []
    record = run_workload([ONWORKERS, ONSERVERS, PERJOB], overrides, tmp_path=tmp_path)
    assert all(job.status == "done" for job in record.jobs)
    return [(r.plugin, r.summary, dict(r.metrics)) for r in record.plugin_rows]


@pytest.mark.parametrize("mode", ["ps", "allreduce"])
def test_a_run_scoped_plugins_rows_and_the_plugins_order_are_those_of_a_local_run(
        tmp_path: Path, mode: str) -> None:
    local = _rows(tmp_path / "none", "none")
    names = [job for _, _, metrics in local if "job" in metrics for job in [metrics["job"]]]
    assert len(names) == 2, local  # the tiny workload's two jobs
    assert local == [("onworkers", "worker view", {}), ("onservers", "stepped", {}),
                     *[("perjob", f"{n}: checked", {"job": n, "checked": 1}) for n in names]]
    assert _rows(tmp_path / mode, mode) == local


def test_with_placeholders_puts_rows_in_selection_order_keeping_each_plugins_own() -> None:
    rows = [ReportRow("b", "b1"), ReportRow("c", "c1"), ReportRow("b", "b2")]
    out = with_placeholders(rows, ["a", "b", "c", "d"])
    assert [(r.plugin, r.summary) for r in out] == [
        ("a", "active, but reported nothing about what it did"), ("b", "b1"), ("b", "b2"),
        ("c", "c1"), ("d", "active, but reported nothing about what it did")]
